"""monitor/ never imports torch (not even transitively) and never imports streamer/.

Each module is imported in a fresh interpreter, so what another test imported cannot hide
what the module itself pulls in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MONITOR_MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for path in (ROOT / "monitor").rglob("*.py")
)

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(name for name in sys.modules
                        if name.split(".")[0] in ("torch", "streamer"))))
"""


def test_every_monitor_module_is_listed():
    assert "monitor" in MONITOR_MODULES and "monitor.live" in MONITOR_MODULES


@pytest.mark.parametrize("module", MONITOR_MODULES)
def test_importing_a_monitor_module_loads_neither_torch_nor_streamer(module):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, module], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "torch" not in loaded, f"{module} imports torch"
    assert not [name for name in loaded if name.split(".")[0] == "streamer"], f"{module} imports {loaded}"
