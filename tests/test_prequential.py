"""The recorded loss of batch t comes from the parameters before any update on batch t."""

import copy

import pytest
import torch

from streamer.step import prequential_step, run
from streamer.strategies import Strategy
from tests.helpers import batches_from_records, naive, permute_classes, small_stream

CORPUS = {"en": "hello world, how are you " * 300, "fr": "bonjour le monde, ça va " * 300,
          "cs": "ahoj světe, jak se máš " * 300}


@pytest.fixture
def stream():
    records, manifest = small_stream(CORPUS, fragments=6, mean_tokens=600, streams=3, window=10)
    return records, batches_from_records(records, 3, 10)


def test_recorded_loss_is_the_loss_under_the_parameters_before_the_update(stream):
    _, batches = stream
    strategy = naive(seed=0)
    for t, (batch, truth) in enumerate(batches[:25]):
        snapshot = copy.deepcopy(strategy.state_dict())  # parameters + hidden state before batch t
        result = prequential_step(strategy, batch, truth, t)
        replica = naive(seed=123)  # different init, then overwritten by the snapshot
        replica.load_state_dict(snapshot)
        before = replica.predict(batch).loss.item()
        after = strategy.predict(batch).loss.item()
        assert result.loss == pytest.approx(before, rel=1e-6, abs=1e-7)
        assert abs(after - before) > 1e-6  # the update did change the loss of batch t


def test_predict_changes_nothing_and_learn_changes_the_parameters(stream):
    _, batches = stream
    strategy = naive()
    batch, _ = batches[0]
    before = copy.deepcopy(strategy.state_dict())
    strategy.predict(batch)
    strategy.predict(batch)
    for name, tensor in strategy.state_dict()["model"].items():
        assert torch.equal(tensor, before["model"][name])
    strategy.learn(batch)
    changed = [n for n, t in strategy.state_dict()["model"].items() if not torch.equal(t, before["model"][n])]
    assert changed


def test_state_dict_round_trip_gives_the_same_next_losses(stream):
    _, batches = stream
    strategy = naive()
    for batch, truth in batches[:5]:
        prequential_step(strategy, batch, truth, 0)
    restored = naive(seed=99)
    restored.load_state_dict(copy.deepcopy(strategy.state_dict()))
    a = [r.loss for r in run(strategy, batches[5:12])]
    b = [r.loss for r in run(restored, batches[5:12])]
    assert a == b


def test_naive_satisfies_the_strategy_protocol():
    assert isinstance(naive(), Strategy)


def test_the_model_never_reads_headers(stream):
    records, batches = stream
    shuffled = permute_classes(records, {"en": "cs", "cs": "fr", "fr": "en"})
    shuffled_batches = batches_from_records(shuffled, 3, 10)
    a = [r.loss for r in run(naive(), batches)]
    b = [r.loss for r in run(naive(), shuffled_batches)]
    assert a == b
    assert [t.class_name for _, t in batches] != [t.class_name for _, t in shuffled_batches]


def test_runs_are_reproducible_with_a_seed(stream):
    _, batches = stream
    assert [r.loss for r in run(naive(seed=5), batches)] == [r.loss for r in run(naive(seed=5), batches)]
