"""Numeric faults: a NaN or infinite loss skips that update for every strategy, leaves the strategy's
whole state (parameters, optimizer moments, memories, gates, Fisher terms, boundaries, carried hidden
state) as it was, says skipped=True with a finite recorded loss, and the next good batch learns.
The Prometheus sink counts skipped updates."""

import math

import pytest
import torch

from monitor.exporter import create_metrics
from monitor.live import LiveMonitor
from monitor.results import StepResult
from streamer.step import prequential_step
from streamer.strategies import STRATEGIES
from tests.helpers import batches_from_records, small_stream
from tests.test_checkpoint import CORPUS, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BEFORE = 8  # good batches first: memories, gates and Fisher terms hold something when the fault comes


@pytest.fixture(scope="module")
def batches():
    records, _ = small_stream(CORPUS, fragments=3, mean_tokens=150, streams=3, window=10, seed=4)
    return [batch for batch, _ in batches_from_records(records, 3, 10)][: BEFORE + 2]


def flat(state, prefix=""):
    """{path: value} of a nested state_dict: tensors cloned, so later updates cannot change them."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}/{i}").items()}
    return {prefix: state.detach().clone() if torch.is_tensor(state) else state}


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if torch.is_tensor(value):
            assert torch.equal(value.isnan(), after[key].isnan()), key
            assert torch.equal(value.nan_to_num(), after[key].nan_to_num()), key
        else:
            assert value == after[key] or (value != value and after[key] != after[key]), key


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_non_finite_loss_skips_the_update_and_changes_nothing(name, batches):
    strategy, last = build(name), math.nan
    for index, batch in enumerate(batches[:BEFORE]):
        result = prequential_step(strategy, batch, None, index, last)
        assert not result.skipped
        last = result.loss

    poisoned = next(strategy.model.parameters())  # every path's forward reads it: the loss becomes NaN
    kept = poisoned.detach().clone()
    with torch.no_grad():
        poisoned.fill_(math.nan)
    before = flat(strategy.state_dict())
    result = prequential_step(strategy, batches[BEFORE], None, BEFORE, last)
    assert result.skipped and result.loss == last and result.train_loss == last  # the log stays finite
    assert_same(before, flat(strategy.state_dict()))

    with torch.no_grad():
        poisoned.copy_(kept)
    weights = [p.detach().clone() for p in strategy.model.parameters() if p.requires_grad]
    result = prequential_step(strategy, batches[BEFORE + 1], None, BEFORE + 1, last)
    assert not result.skipped and math.isfinite(result.loss)
    changed = [p for p, w in zip((p for p in strategy.model.parameters() if p.requires_grad), weights)
               if not torch.equal(p, w)]
    assert changed and all(torch.isfinite(p).all() for p in changed)  # it learns again


def test_an_infinite_loss_from_a_runaway_learning_rate_is_skipped_too(batches):
    """Finite but huge weights overflow the logits: those updates are skipped, no weight is ever NaN
    (the model has diverged all the same: the guard keeps it finite, it cannot make it good)."""
    strategy, results = STRATEGIES["naive"](build("naive").model, lr=1e36, clip=1e30), []
    for index, batch in enumerate(batches):
        results.append(prequential_step(strategy, batch, None, index, results[-1].loss if results else math.nan))
    assert any(r.skipped for r in results)
    assert all(torch.isfinite(p).all() for p in strategy.model.parameters())  # never a NaN parameter
    assert all(math.isfinite(r.loss) and math.isfinite(r.train_loss) for r in results)


def test_the_sink_counts_skipped_updates():
    monitor = LiveMonitor(run="r", strategy="naive", metrics=create_metrics())
    labels = {"run": "r", "strategy": "naive"}
    sample = lambda: monitor.metrics.registry.get_sample_value("streamer_skipped_updates_total", labels)  # noqa: E731
    assert sample() == 0  # exported before the first skip, so increase() sees it
    for index, skipped in enumerate((False, True, True, False)):
        monitor.observe(StepResult(index=index, loss=2.0, train_loss=2.0, grad_norm=1.0, tokens=30, truth=None,
                                   predict_s=0.01, learn_s=0.01, finished_at=0.0, skipped=skipped))
    assert sample() == 2
