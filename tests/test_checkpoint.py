"""streamer.checkpoint: a saved and loaded run continues exactly as an uninterrupted one, for every
strategy; files are written atomically and hold only tensors and plain values."""

import fractions
import random

import numpy as np
import pytest
import torch

from streamer import checkpoint
from streamer.batching import Batcher
from streamer.models import LSTMLanguageModel
from streamer.step import prequential_step
from streamer.strategies import STRATEGIES
from tests.helpers import TINY, small_stream

CORPUS = {"en": "hello world, how are you " * 300, "fr": "bonjour le monde, ça va " * 300,
          "cs": "ahoj světe, jak se máš " * 300}

# Small enough that memories, gates, Fisher terms, boundaries and adapters all act within the stream.
SMALL = {"replay": dict(r_interval=5, n_replay=4, memory_size=30),
         **{name: dict(r_interval=5, n_replay=4, memory_size=30, boundary="every:6") for name in ("kd-logit", "kd-rep")},
         "mbpa": dict(r_interval=5, n_replay=4, memory_size=30, neighbours=4, local_steps=2),
         "agem": dict(n_ref=4, memory_size=30),
         **{name: dict(n_experts=3, gate_steps=5, warmup_batches=3) for name in ("poe", "moe")},
         **{name: dict(n_experts=3, gate_hidden=8, warmup_batches=3) for name in ("poe-lstm", "moe-lstm")},
         "ensemble": dict(n_experts=3), "mos": dict(n_components=3)}
SAVED_AFTER = 24  # batches learned before the checkpoint; the stream has about 60

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def records():
    records, _ = small_stream(CORPUS, fragments=6, mean_tokens=300, streams=3, window=10, seed=3)
    return records


def build(name, seed=0):
    torch.manual_seed(seed)
    return STRATEGIES[name](LSTMLanguageModel(TINY), lr=1e-3, **SMALL.get(name, {}))


def learn(strategy, batcher, records, index=0, stop_after=None):
    """Feed records, learning each batch as it is cut; stops at a record boundary once `stop_after`
    batches are learned. Returns (losses, the next record to feed)."""
    losses = []
    for position, record in enumerate(records):
        batcher.add(record, ("topic", 0), position)
        while batcher.ready():
            ready = batcher.pop()
            losses.append(prequential_step(strategy, ready.batch, ready.truth, index + len(losses)).loss)
        if stop_after is not None and len(losses) >= stop_after:
            return losses, position + 1
    return losses, len(records)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_loaded_checkpoint_continues_exactly_like_an_uninterrupted_run(name, records, tmp_path):
    torch.manual_seed(7)
    whole, _ = learn(build(name), Batcher(3, 10), records)

    torch.manual_seed(7)
    strategy, batcher = build(name), Batcher(3, 10)
    before, resume_at = learn(strategy, batcher, records, stop_after=SAVED_AFTER)
    checkpoint.save(tmp_path / "checkpoint.pt", {
        "strategy": strategy.state_dict(), "model": strategy.model.state_dict(), "rng": checkpoint.rng_state(),
        "loop": {"batcher": batcher.state_dict()}, "step": len(before)})
    del strategy, batcher

    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    strategy, batcher = build(name, seed=99), Batcher(3, 10)  # fresh, and from other weights
    strategy.load_state_dict(saved["strategy"])
    batcher.load_state_dict(saved["loop"]["batcher"])
    checkpoint.set_rng_state(saved["rng"])
    after, _ = learn(strategy, batcher, records[resume_at:], index=saved["step"])

    assert len(before) >= SAVED_AFTER and len(before) + len(after) == len(whole)
    assert before + after == whole  # exactly: the same numbers, not approximately


def test_load_refuses_a_file_holding_a_python_object(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"format_version": 1, "step": fractions.Fraction(1, 3)}, path)  # pickles a Python object
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load"):
        checkpoint.load(path)


def test_save_is_atomic_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "run" / "checkpoint.pt"
    checkpoint.save(path, {"step": 1})
    checkpoint.save(path, {"step": 2, "weights": torch.arange(3)})
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    loaded = checkpoint.load(path)
    assert loaded["step"] == 2 and loaded["format_version"] == checkpoint.FORMAT_VERSION
    assert torch.equal(loaded["weights"], torch.arange(3))


def test_rng_states_round_trip(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    checkpoint.save(tmp_path / "rng.pt", {"rng": checkpoint.rng_state()})
    expected = (torch.rand(3), np.random.standard_normal(3), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "rng.pt")["rng"])
    again = (torch.rand(3), np.random.standard_normal(3), random.random())
    assert torch.equal(expected[0], again[0]) and (expected[1] == again[1]).all() and expected[2] == again[2]


def test_a_config_is_stored_as_plain_values():
    from streamer.config import LearnConfig

    config = LearnConfig(bootstrap_servers="b:9092", topic="t", run_dir=__import__("pathlib").Path("runs/x"),
                         strategy_options=(("memory_size", 10),), model=TINY)
    plain = checkpoint.plain(config)
    assert plain["run_dir"] == "runs/x" and plain["strategy_options"] == [["memory_size", 10]]
    assert plain["model"]["hidden"] == 24
