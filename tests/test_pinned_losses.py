"""The redesign changes no number: a short fixed stream learned through the real broker and the
`streamer` command gives, batch for batch, the losses.jsonl values recorded before it (to 1e-6 nats).

The pinned values (tests/data/pinned_losses.json) were written by the code as it was before the
house redesign, with the same corpus, stream, flags, seed and one torch thread."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_corpus

PINNED = json.loads((Path(__file__).parent / "data" / "pinned_losses.json").read_text())
STREAMER = [sys.executable, "-m", "streamer.cli"]
STRATEGY_FLAGS = {"naive": [], "poe": ["--set", "n_experts=3", "--set", "gate_steps=5", "--set", "warmup_batches=10"]}


@pytest.fixture(scope="module")
def pinned_stream(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("pinned")
    corpus = write_corpus(root / "corpus")
    manifest = root / "pin.manifest.json"
    result = subprocess.run([*STREAMER, "produce", "--corpus", str(corpus), "--bootstrap-servers",
                             broker.bootstrap_servers, "--topic", "pinned", "--fragments", "6", "--lambda", "300",
                             "--streams", "3", "--window", "10", "--seed", "0", "--manifest", str(manifest)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return root, manifest


# naive's pinned losses are checked in the default suite by both of tests/test_poison.py's broker tests
# (the same stream and command with poison around it, to 1e-6): here they are a slow run's
@pytest.mark.parametrize("strategy", [pytest.param("naive", marks=pytest.mark.slow), "poe"])
def test_losses_equal_the_pinned_values(strategy, broker, pinned_stream):
    root, manifest = pinned_stream
    run_dir = root / strategy
    result = subprocess.run(
        [*STREAMER, "learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", "pinned",
         "--manifest", str(manifest), "--streams", "3", "--window", "10", "--hidden", "24", "--embedding", "8",
         "--strategy", strategy, *STRATEGY_FLAGS[strategy], "--no-view", "--no-probe",
         "--group", f"pinned-{strategy}", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    expected = PINNED[strategy]
    assert len(losses) == len(expected)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst <= 1e-6, f"{strategy}: largest difference {worst:.3g} nats"
