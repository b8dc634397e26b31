"""One conformance suite, run against every registered strategy (river's `checks`), and the catalog."""

import copy
import dataclasses
import io
import math
import random
import subprocess
import sys

import pytest
import torch

from streamer.models import LSTMLanguageModel
from streamer.step import run
from streamer.strategies import STRATEGIES, Strategy
from streamer.strategies.boundary import Boundaries
from streamer.strategies.catalog import STRATEGY_CATALOG, strategy_class
from streamer.strategies.params import clone, config_record, hyperparameters
from tests.helpers import TINY, batches_from_records, permute_classes

# The learning rate each strategy is given (the model's default is not known here); the expert
# strategies used 1e-3 before lr became a required argument.
LR = {name: 1e-3 for name in ("poe", "moe", "ensemble", "poe-lstm", "moe-lstm", "mos")}

# Hyperparameters small enough that memory and replay act within a short stream; absent keys use defaults.
SMALL = {"replay": dict(r_interval=30, n_replay=8, memory_size=50),
         **{name: dict(r_interval=30, n_replay=8, memory_size=50, boundary="every:10") for name in ("kd-logit", "kd-rep")},
         "mbpa": dict(r_interval=30, n_replay=8, memory_size=50, neighbours=4, local_steps=2),
         "agem": dict(n_ref=8, memory_size=50),
         **{name: dict(n_experts=3, gate_steps=5, warmup_batches=3) for name in ("poe", "moe")},
         **{name: dict(n_experts=3, gate_hidden=8, warmup_batches=3) for name in ("poe-lstm", "moe-lstm")},
         "ensemble": dict(n_experts=3), "mos": dict(n_components=3)}

NAMES = sorted(STRATEGY_CATALOG)
every_strategy = pytest.mark.parametrize("name", NAMES)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(name, seed=0):
    torch.manual_seed(seed)
    return strategy_class(name)(LSTMLanguageModel(TINY), lr=LR.get(name, 2e-3), **SMALL.get(name, {}))


# Runs that go through a stream twice per strategy take its first 60 batches (of 162): the
# classes switch at batches 21 and 49 within them.
HEAD = 60


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
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def assert_plain(value, where="state"):
    """Only tensors and dict/list/tuple/str/int/float/bool/None, all the way down."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) in (str, int), f"{where}: key {key!r}"
            assert_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")
    else:
        assert value is None or type(value) in (torch.Tensor, str, int, float, bool), f"{where}: {type(value)}"


def saved_and_loaded(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def losses(strategy, batches):
    return [result.loss for result in run(strategy, batches)]


# --- the catalog ---------------------------------------------------------------------------------

def test_the_catalog_names_every_strategy_class():
    assert set(STRATEGY_CATALOG) == set(STRATEGIES)
    for name, info in STRATEGY_CATALOG.items():
        cls = strategy_class(name)
        assert cls is STRATEGIES[name] and cls.__name__ == info.class_name and cls.__module__ == info.module
        assert info.description and "\n" not in info.description
        assert info.oracle == bool(getattr(cls, "oracle", False))


def test_the_catalog_does_not_import_torch():
    code = ("import sys, streamer.strategies.catalog, streamer.strategies.params, streamer.strategies; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy_class("sometimes")


# --- every strategy ------------------------------------------------------------------------------

@every_strategy
def test_satisfies_the_protocol(name):
    assert isinstance(build(name), Strategy)


@every_strategy
def test_lr_is_required(name):
    with pytest.raises(TypeError):
        strategy_class(name)(LSTMLanguageModel(TINY), **SMALL.get(name, {}))


@every_strategy
def test_hyperparameters_are_the_init_arguments(name):
    strategy = build(name)
    found = hyperparameters(strategy)
    assert found["lr"] == LR.get(name, 2e-3)
    assert {k: found[k] for k in SMALL.get(name, {})} == SMALL.get(name, {})
    assert repr(strategy) == f"{type(strategy).__name__}({', '.join(f'{k}={v!r}' for k, v in found.items())})"
    record = config_record(strategy)
    assert record["hyperparameters"] == found and saved_and_loaded(record) == record


@every_strategy
def test_clone_has_equal_hyperparameters_and_fresh_state(name, tiny_stream):
    _, batches = tiny_stream
    strategy = build(name)
    losses(strategy, batches[:12])
    torch.manual_seed(0)
    cloned = clone(strategy, LSTMLanguageModel(TINY))
    assert type(cloned) is type(strategy) and hyperparameters(cloned) == hyperparameters(strategy)
    assert_same(cloned.state_dict(), build(name).state_dict())


@every_strategy
def test_state_dict_holds_plain_values_and_round_trips_through_torch_save(name, tiny_stream):
    _, batches = tiny_stream
    strategy = build(name)
    losses(strategy, batches[:10])
    state = strategy.state_dict()
    assert_plain(state)
    restored = build(name, seed=99)  # different initial weights, then overwritten
    restored.load_state_dict(saved_and_loaded(state))
    assert_same(strategy.state_dict(), restored.state_dict())
    assert torch.equal(strategy.predict(batches[10][0]).loss, restored.predict(batches[10][0]).loss)
    assert losses(strategy, batches[10:20]) == losses(restored, batches[10:20])


@every_strategy
def test_learning_changes_predictions(name, tiny_stream):
    _, batches = tiny_stream
    strategy = build(name)
    batch = batches[0][0]
    before = strategy.predict(batch).loss
    strategy.learn(batch)
    assert not torch.equal(strategy.predict(batch).loss, before)


@every_strategy
def test_predict_changes_nothing(name, tiny_stream):
    _, batches = tiny_stream
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


@every_strategy
def test_learn_changes_the_parameters(name, tiny_stream):
    _, batches = tiny_stream
    strategy = build(name)
    before = copy.deepcopy(strategy.model.state_dict())
    strategy.learn(batches[0][0])
    after = strategy.model.state_dict()
    assert [n for n in before if not torch.equal(before[n], after[n])]


@pytest.fixture(scope="module")
def shuffled_head(tiny_stream):
    """The first HEAD batches of the stream with every class header permuted."""
    records, batches = tiny_stream
    shuffled = batches_from_records(permute_classes(records, {"en": "cs", "cs": "fr", "fr": "en"}), 3, 10)[:HEAD]
    classes = [t.class_name for _, t in batches[:HEAD]]
    assert sum(a != b for a, b in zip(classes, classes[1:])) >= 2  # the head holds class switches
    assert classes != [t.class_name for _, t in shuffled]
    return shuffled


@pytest.fixture(scope="module")
def headless_head(tiny_stream):
    """The first HEAD batches of the stream from the same records without their headers: no class, and no
    switch either (a permutation of the classes keeps every switch where it was)."""
    records, batches = tiny_stream
    headless = batches_from_records([dataclasses.replace(r, truth=None) for r in records], 3, 10)[:HEAD]
    assert all(truth is None for _, truth in headless)
    assert all(torch.equal(a.inputs, b.inputs) for (a, _), (b, _) in zip(batches[:HEAD], headless))
    return headless


@every_strategy
def test_the_model_never_sees_headers(name, tiny_stream, shuffled_head, headless_head):
    """The same losses with the class headers permuted and, but for the oracle (it routes by class), with
    no headers at all: the permutation alone passed with the true switches resetting the carried state."""
    _, batches = tiny_stream
    expected = losses(build(name), batches[:HEAD])
    assert losses(build(name), shuffled_head) == expected
    if not STRATEGY_CATALOG[name].oracle:
        assert losses(build(name), headless_head) == expected


@every_strategy
def test_runs_are_reproducible_with_a_seed(name, tiny_stream):
    _, batches = tiny_stream
    assert losses(build(name, seed=5), batches[:HEAD]) == losses(build(name, seed=5), batches[:HEAD])


# --- boundary detectors, saved without pickle ----------------------------------------------------

def _loss_stream(seed=0, length=400):
    """Losses with level shifts (so every detector fires, some more than once) and noise."""
    rng = random.Random(seed)
    levels = [2.0, 4.0, 1.0, 3.5, 0.5]
    return [levels[(i // 80) % len(levels)] + rng.gauss(0, 0.3) for i in range(length)]


@pytest.mark.parametrize("detector", ["page-hinkley", "adwin", "kswin"])
def test_a_detector_restored_mid_stream_behaves_like_the_uninterrupted_one(detector):
    values = [torch.tensor(v, dtype=torch.float32) for v in _loss_stream()]
    whole = Boundaries(detector)
    decisions = [whole.update(v) for v in values]
    assert whole.found_at  # the stream drifts
    for cut in (1, 37, 81, 163, whole.found_at[0] + 1, whole.found_at[-1], whole.found_at[-1] + 1, 399):
        first = Boundaries(detector)
        head = [first.update(v) for v in values[:cut]]
        state = saved_and_loaded(first.state_dict())
        assert_plain(state)
        resumed = Boundaries(detector)
        resumed.load_state_dict(state)
        assert head + [resumed.update(v) for v in values[cut:]] == decisions, f"cut at {cut}"
        assert resumed.found_at == whole.found_at
        assert_same(saved_and_loaded(resumed.state_dict()), saved_and_loaded(whole.state_dict()))


def test_components_take_their_repr_from_the_signature_too():
    from streamer.strategies.memory import HerdingMemory, ReservoirMemory
    from streamer.strategies.replay import SparseReplay

    assert repr(Boundaries("adwin")) == "Boundaries(boundary='adwin')"
    assert repr(ReservoirMemory(5, seed=2)) == "ReservoirMemory(capacity=5, seed=2)"
    assert repr(HerdingMemory(4)) == "HerdingMemory(capacity=4, seed=0)"
    assert repr(SparseReplay(0.5, 10, 2, 8)) == ("SparseReplay(p_write=0.5, r_interval=10, n_replay=2, memory_size=8, "
                                                 "selection='reservoir', seed=0)")
