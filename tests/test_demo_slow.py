"""The demo as shipped: real corpus (built on first use), default stream, embedded broker. Run with -m slow."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_demo_shows_switch_spikes_on_the_real_corpus(tmp_path):
    run_dir = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "streamer.cli", "demo", "--no-view", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    results = json.loads((run_dir / "results.json").read_text())
    metrics = results["metrics"]
    assert results["span"]["complete"], "the default demo should finish its stream within its time limit"
    assert metrics["n_revisits"] > 0
    assert metrics["ppl@sw"] > metrics["ppl"]  # the switch spike
    assert set(metrics["per_class"]) == {"cs", "de", "en", "es", "fr"}
    assert (run_dir / "loss_curve.png").stat().st_size > 10_000
