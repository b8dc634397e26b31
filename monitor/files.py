"""Small files that other programs read while a learner runs (status.json, config.json, results.json):
written beside the old one and renamed over it, so a reader never sees half a file, as strict JSON (json_safe);
and the learner that holds a run directory (its .lock's pid), as those programs see it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["json_safe", "learner_process", "replace_text"]


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by "inf", "-inf" or "nan": strict JSON (``json.dumps`` wrote
    bare Infinity and NaN, which other JSON readers refuse), written with ``allow_nan=False``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a hidden file beside it (one per process), renamed over `path`."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        staging.write_text(text, encoding="utf-8")
    except BaseException:  # a full disk: no empty hidden file left behind
        staging.unlink(missing_ok=True)
        raise
    staging.replace(path)


def learner_process(run_dir: str | os.PathLike) -> dict:
    """{"pid", "running"}: the pid in the run directory's .lock (None without one) and whether that
    process is a live streamer (a pid reused by another program is not)."""
    run_dir = Path(run_dir)
    try:
        pid = int((run_dir / ".lock").read_text().strip())
    except (OSError, ValueError):
        return {"pid": None, "running": False}
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return {"pid": pid, "running": False}
    except PermissionError:  # another user's process: alive
        pass
    try:  # a reused pid is not our learner
        running = b"streamer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        running = True
    return {"pid": pid, "running": running}
