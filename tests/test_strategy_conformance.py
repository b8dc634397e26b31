"""One conformance suite, run against every registered strategy (river's `checks`)."""

import copy

import pytest
import torch

from streamer.models import LSTMLanguageModel
from streamer.step import run
from streamer.strategies import STRATEGIES, Strategy
from tests.helpers import TINY, batches_from_records, permute_classes, small_stream

CORPUS = {"en": "hello world, how are you " * 300, "fr": "bonjour le monde, ça va " * 300,
          "cs": "ahoj světe, jak se máš " * 300}

# Hyperparameters small enough that memory and replay act within a short stream; absent keys use defaults.
SMALL = {"replay": dict(r_interval=30, n_replay=8, memory_size=50),
         **{name: dict(r_interval=30, n_replay=8, memory_size=50, boundary="every:10") for name in ("kd-logit", "kd-rep")},
         "mbpa": dict(r_interval=30, n_replay=8, memory_size=50, neighbours=4, local_steps=2),
         "agem": dict(n_ref=8, memory_size=50),
         **{name: dict(n_experts=3, gate_steps=5, warmup_batches=3) for name in ("poe", "moe")},
         **{name: dict(n_experts=3, gate_hidden=8, warmup_batches=3) for name in ("poe-lstm", "moe-lstm")},
         "ensemble": dict(n_experts=3), "mos": dict(n_components=3)}

pytestmark = [pytest.mark.parametrize("name", sorted(STRATEGIES)), pytest.mark.usefixtures("one_torch_thread")]


def build(name, seed=0):
    torch.manual_seed(seed)
    return STRATEGIES[name](LSTMLanguageModel(TINY), **SMALL.get(name, {}))


@pytest.fixture(scope="module")
def stream():
    records, _ = small_stream(CORPUS, fragments=6, mean_tokens=600, streams=3, window=10)
    return records, batches_from_records(records, 3, 10)


def assert_same(a, b, where="state"):
    """Exact equality of nested dicts, lists, tuples, tensors and plain values."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def losses(strategy, batches):
    return [result.loss for result in run(strategy, batches)]


def test_satisfies_the_protocol(name):
    assert isinstance(build(name), Strategy)


def test_predict_changes_nothing(name, stream):
    _, batches = stream
    strategy = build(name)
    losses(strategy, batches[:40])  # optimizer moments, memory and counters are populated
    batch, _ = batches[40]
    before = copy.deepcopy(strategy.state_dict())
    before_params = [(n, p.detach().clone()) for n, p in strategy.model.named_parameters()]
    rng_before = torch.get_rng_state()
    first = strategy.predict(batch).loss
    second = strategy.predict(batch).loss
    assert torch.equal(first, second)
    assert_same(strategy.state_dict(), before)  # parameters, optimizer, hidden state, memory, RNGs
    for (param_name, param), (_, kept) in zip(strategy.model.named_parameters(), before_params):
        assert torch.equal(param, kept), param_name
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_learn_changes_the_parameters(name, stream):
    _, batches = stream
    strategy = build(name)
    before = copy.deepcopy(strategy.model.state_dict())
    strategy.learn(batches[0][0])
    after = strategy.model.state_dict()
    assert [n for n in before if not torch.equal(before[n], after[n])]


def test_state_dict_round_trip_gives_the_same_next_losses(name, stream):
    _, batches = stream
    strategy = build(name)
    losses(strategy, batches[:10])
    restored = build(name, seed=99)  # different initial weights, then overwritten
    restored.load_state_dict(copy.deepcopy(strategy.state_dict()))
    assert losses(strategy, batches[10:20]) == losses(restored, batches[10:20])
    assert_same(strategy.state_dict(), restored.state_dict())


def test_the_model_never_sees_headers(name, stream):
    records, batches = stream
    shuffled = batches_from_records(permute_classes(records, {"en": "cs", "cs": "fr", "fr": "en"}), 3, 10)
    assert [t.class_name for _, t in batches] != [t.class_name for _, t in shuffled]
    assert losses(build(name), batches) == losses(build(name), shuffled)


def test_runs_are_reproducible_with_a_seed(name, stream):
    _, batches = stream
    assert losses(build(name, seed=5), batches) == losses(build(name, seed=5), batches)
