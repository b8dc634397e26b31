"""One forward per batch: with dropout 0 the prequential score and the update share the training-mode
forward (OnlineTrainer.shares_forward); the updates stay exactly as with a separate eval-mode score.
Speed is benchmarks/step_cost.py's; these tests check behaviour only."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from streamer.models import LSTMLanguageModel
from streamer.multitask import ShuffledNaive
from streamer.step import run
from streamer.strategies.base import Batch
from streamer.strategies.catalog import STRATEGY_CATALOG, strategy_class
from streamer.strategies.naive import Naive
from streamer.strategies.trainer import adam, forward_is_mode_free
from tests.helpers import TINY
from tests.test_strategy_conformance import build

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD = 20  # batches of the tiny stream per run


def _trainer(strategy):
    return getattr(strategy, "_trainer", None)


# every strategy whose learning goes through an OnlineTrainer
TRAINED = [name for name in sorted(STRATEGY_CATALOG) if _trainer(build(name)) is not None]


def _run(strategy, batches, shared: bool):
    _trainer(strategy).shares_forward &= shared
    return list(run(strategy, batches))


def test_the_tested_strategies_include_naive_and_the_experts():
    assert {"naive", "poe", "moe", "ensemble", "poe-lstm", "ewc", "agem", "replay"} <= set(TRAINED)


@pytest.mark.parametrize("name", TRAINED)
def test_the_shared_forward_changes_no_update(name, tiny_stream):
    """The same parameters and training losses, bit for bit, as scoring with a separate eval-mode forward;
    the recorded losses equal to float rounding."""
    _, batches = tiny_stream
    shared, separate = build(name), build(name)
    assert _trainer(shared).shares_forward  # TINY has dropout 0
    with_shared, with_separate = _run(shared, batches[:HEAD], True), _run(separate, batches[:HEAD], False)
    assert [r.train_loss for r in with_shared] == [r.train_loss for r in with_separate]
    assert [r.loss for r in with_shared] == pytest.approx([r.loss for r in with_separate], abs=1e-5)
    for (key, a), b in zip(shared.model.state_dict().items(), separate.model.state_dict().values()):
        assert torch.equal(a, b), key


def _forwards(name, batches, shared: bool) -> int:
    strategy = build(name)
    calls = [0]
    module = strategy.model.experts if name == "poe" else strategy.model
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    _run(strategy, batches, shared)
    return calls[0]


@pytest.mark.parametrize("name", ["naive", "poe", "ewc", "agem"])
def test_one_forward_less_per_batch_with_dropout_0(name, tiny_stream):
    """naive and poe: one forward per batch; A-GEM's reference gradients add their own forwards."""
    _, batches = tiny_stream
    shared, separate = _forwards(name, batches[:HEAD], True), _forwards(name, batches[:HEAD], False)
    assert separate - shared == HEAD
    if name in ("naive", "poe", "ewc"):
        assert shared == HEAD


@pytest.mark.parametrize("name", ["naive", "poe"])
def test_with_dropout_the_score_is_a_separate_eval_mode_forward(name, tiny_stream):
    _, batches = tiny_stream
    torch.manual_seed(0)
    template = LSTMLanguageModel(dataclasses.replace(TINY, dropout=0.3))
    options = dict(n_experts=3, gate_steps=2, warmup_batches=0) if name == "poe" else {}
    strategy = strategy_class(name)(template, lr=1e-3, **options)
    assert not _trainer(strategy).shares_forward
    batch = batches[0][0]
    first, again = strategy.predict(batch).loss, strategy.predict(batch).loss
    assert torch.equal(first, again)  # no dropout mask drawn: eval mode
    stats = strategy.learn(batch)
    assert not torch.equal(stats.loss, first)  # the update's forward drops out
    assert strategy.model.training


def test_a_prediction_is_not_reused_after_the_parameters_change(tiny_stream):
    """predict, then load other parameters, then learn: the update starts from the loaded ones."""
    _, batches = tiny_stream
    learned = build("naive")
    for batch, _ in batches[:3]:
        learned.learn(batch)
    saved = copy.deepcopy(learned.state_dict())
    strategy = build("naive")
    batch = batches[3][0]
    strategy.predict(batch)
    strategy.load_state_dict(saved)
    fresh = build("naive")
    fresh.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(strategy.learn(batch).loss, fresh.learn(batch).loss)


def test_a_prediction_of_another_batch_is_not_used(tiny_stream):
    _, batches = tiny_stream
    a, b = build("naive"), build("naive")
    a.predict(batches[1][0])
    assert torch.equal(a.learn(batches[0][0]).loss, b.learn(batches[0][0]).loss)


def test_in_place_changes_between_predict_and_learn_are_seen():
    torch.manual_seed(0)
    strategy = Naive(LSTMLanguageModel(TINY), lr=1e-3)
    inputs = torch.randint(0, 256, (2, 5))
    batch = Batch(inputs=inputs, targets=inputs.roll(-1, 1))
    before = strategy.predict(batch).loss
    with torch.no_grad():
        strategy.model.decode.weight.mul_(2.0)  # an in-place change, as MbPA's local adaptation makes
    stats = strategy.learn(batch)
    assert not torch.equal(stats.loss, before)


@pytest.mark.parametrize("model, free", [
    (LSTMLanguageModel(TINY), True),
    (LSTMLanguageModel(dataclasses.replace(TINY, dropout=0.1)), False),
    (nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0), nn.ReLU()), True),
    (nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), False),
    (nn.LSTM(3, 3, num_layers=1, dropout=0.0), True),
    (nn.LSTM(3, 3, num_layers=2, dropout=0.2), False),
    (nn.MultiheadAttention(4, 2), False),
])
def test_forward_is_mode_free(model, free):
    assert forward_is_mode_free(model) is free


def test_adam_is_fused_and_updates_as_the_per_tensor_loop():
    """trainer.adam (every strategy's optimizer) is torch's fused kernel on CPU and gives torch's
    per-tensor Adam's update; a checkpoint of either optimizer continues in the other alike."""
    torch.manual_seed(0)
    model = nn.LSTM(4, 8, num_layers=2)
    twin = copy.deepcopy(model)
    fused, loop = adam(model.parameters(), 1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2, foreach=False)
    assert fused.defaults["fused"] and not loop.defaults["fused"]

    def steps(n):
        for _ in range(n):
            inputs = torch.randn(5, 2, 4)
            for module, optimizer in ((model, fused), (twin, loop)):
                optimizer.zero_grad()
                module(inputs)[0].square().sum().backward()
                optimizer.step()

    steps(5)
    fused.load_state_dict(copy.deepcopy(loop.state_dict()))  # a checkpoint of the loop's, resumed fused
    loop.load_state_dict(copy.deepcopy(fused.state_dict()))
    steps(5)
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert int(fused.state_dict()["state"][0]["step"]) == 10


def test_multitask_zero_state_learner_runs_one_forward_per_batch(tiny_stream):
    """`streamer multitask`'s learner starts each batch from a zero state: predict and learn take the
    same one, so learn reuses predict's forward (it ran two a batch, and a graph was built for nothing)."""
    _, batches = tiny_stream
    counts, losses = {}, {}
    for shared in (True, False):
        torch.manual_seed(0)
        strategy = ShuffledNaive(LSTMLanguageModel(TINY), lr=2e-3)
        calls = [0]
        strategy.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        losses[shared] = [(r.loss, r.train_loss) for r in _run(strategy, batches[:HEAD], shared)]
        counts[shared] = calls[0]
    assert counts == {True: HEAD, False: 2 * HEAD}
    assert [t for _, t in losses[True]] == [t for _, t in losses[False]]
    assert [s for s, _ in losses[True]] == pytest.approx([s for s, _ in losses[False]], abs=1e-5)


def test_step_cost_benchmark_puts_the_second_forward_in_its_own_column():
    """benchmarks/step_cost.py's "update" is backward, clip and optimizer alone: the training forward
    that learn runs (dropout > 0, or `separate`) is its "train fwd" column (it was counted as update)."""
    from argparse import Namespace

    from benchmarks.step_cost import measure

    args = Namespace(embedding=16, vocab=64, streams=2, window=6, warmup=1, batches=3)
    shared, _ = measure(args, "lstm-200", 0.0)
    assert shared["streamer"]["shared"] and shared["streamer"]["train fwd"] == 0
    assert shared["separate"]["train fwd"] > 0 and shared["reference"]["train fwd"] == 0
    dropped, _ = measure(args, "lstm-200", 0.2)
    assert not dropped["streamer"]["shared"] and dropped["streamer"]["train fwd"] > 0
