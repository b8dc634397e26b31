"""The learner on a CUDA device, through the real CLI and the embedded broker: a run killed with
SIGKILL and started again gives, batch for batch, the losses of an uninterrupted CUDA run, for naive,
poe (experts' states, the gate's moments) and mbpa (memory, keys, generators): the checkpoint loads
on the CPU and the strategy's tensors must go back to the GPU, and the resume's restore and the
checkpoint's copy run in passing threads, which must work on the caller's GPU; more ranks than GPUs
is one line from the rank without one; `spin.in_passing` runs on the caller's CUDA device (a real
check only with 2 GPUs or more: with one, the last is the default). They need a GPU, so on a machine
with none (CI) they skip; they run on a lent GPU machine (`pytest tests/test_gpu.py`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import write_corpus
from tests.learners import produce
from tests.test_distributed import worst_difference
from tests.test_resume import STRATEGY_FLAGS, kill_after_checkpoint, read_lines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STREAMER = [sys.executable, "-m", "streamer"]
TOPIC = "gpu"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def stream(broker, tmp_path_factory):
    """4 streams (2 ranks can split them), one partition each."""
    root = tmp_path_factory.mktemp("gpu")
    manifest = root / "manifest.json"
    produce(broker.bootstrap_servers, write_corpus(root / "corpus"), TOPIC, manifest, 6, 2500,
            "--streams", "4", "--partitions", "4", "--probe-tokens", "0")
    return root, manifest


def learn(broker, manifest, run_dir: Path, *extra) -> list[str]:
    """`streamer learn`'s flags (after the command) for a CUDA run of the topic in `run_dir`."""
    return ["learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", TOPIC,
            "--manifest", str(manifest), "--streams", "4", "--window", "10", "--hidden", "64", "--embedding", "16",
            "--device", "cuda", "--no-view", "--no-probe", "--checkpoint-every", "0.3", "--group", run_dir.name,
            "--run-dir", str(run_dir), *extra]


def losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in read_lines(run_dir / "losses.jsonl")]


def uninterrupted_run(broker, stream, strategy: str = "naive") -> list[dict]:
    root, manifest = stream
    run_dir = root / f"whole-{strategy}"
    if not (run_dir / "results.json").exists():
        result = subprocess.run([*STREAMER, *learn(broker, manifest, run_dir, "--strategy", strategy,
                                                   *STRATEGY_FLAGS[strategy])],
                                cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    expected = losses(run_dir)
    assert len(expected) == json.loads(manifest.read_text())["total_batches"]
    return expected


@pytest.mark.parametrize("strategy", ["naive", "poe", "mbpa"])
def test_a_cuda_learner_killed_and_started_again_gives_the_uninterrupted_losses(broker, stream, strategy):
    root, manifest = stream
    expected = uninterrupted_run(broker, stream, strategy)
    run_dir = root / f"killed-{strategy}"
    command = [*STREAMER, *learn(broker, manifest, run_dir, "--strategy", strategy, *STRATEGY_FLAGS[strategy])]
    lines, step = kill_after_checkpoint(command, root, run_dir, at_least=len(expected) // 3)
    assert len(lines) >= step and step < len(expected)  # killed mid-run
    last = subprocess.run(command, cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resuming from the checkpoint at batch {step}" in last.stdout
    worst = worst_difference(losses(run_dir), expected)
    print(f"{strategy}: killed at checkpoint {step} of {len(expected)}; largest loss difference {worst:.3g}")
    assert worst <= 1e-4


def test_more_ranks_than_gpus_is_one_line(broker, stream):
    root, manifest = stream
    ranks = torch.cuda.device_count() + 1
    if 4 % ranks:
        pytest.skip(f"the topic's 4 streams do not split over {ranks} ranks")
    result = subprocess.run([*STREAMER, *learn(broker, manifest, root / "too-many", "--nproc", str(ranks))], cwd=root,
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"local rank {ranks - 1} has no GPU of its own" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_in_passing_runs_on_the_callers_cuda_device():
    from streamer.spin import in_passing

    device = torch.cuda.device_count() - 1  # the last GPU: cuda:0 is what a fresh thread would get
    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")  # CUDA initialised in this thread
    assert in_passing(torch.cuda.current_device) == device
    assert in_passing(lambda: torch.ones(3, device="cuda").sum().device) == torch.device("cuda", device)
