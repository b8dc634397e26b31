"""kd-logit / kd-rep: distillation toward a frozen snapshot; MbPA++: local adaptation that leaves nothing behind."""

import copy
import random

import pytest
import torch
from torch.nn import functional as F

from streamer.models import LSTMConfig, LSTMLanguageModel
from streamer.step import run
from streamer.strategies.base import Batch
from streamer.strategies.distill import KDLogit, KDRep
from streamer.strategies.mbpa import MbPA
from streamer.strategies.naive import Naive
from streamer.strategies.replay import Replay
from tests.conftest import WORDS
from tests.helpers import TINY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EN = "the quick brown fox jumps over the lazy dog "
CS = "příliš žluťoučký kůň úpěl ďábelské ódy "


def windows(text: str, rows: int, window: int = 10, start: int = 0) -> Batch:
    """rows consecutive byte windows of `text` (repeated as needed), targets shifted by one."""
    data = torch.tensor(list(text.encode("utf-8")) * ((start + rows * window) // len(text) + 2), dtype=torch.int64)
    data = data[start: start + rows * window + 1]
    return Batch(inputs=data[:-1].view(rows, window), targets=data[1:].view(rows, window))


def make(cls, seed=0, config=TINY, **hyperparameters):
    torch.manual_seed(seed)
    return cls(LSTMLanguageModel(config), **{"lr": 2e-3, **hyperparameters})


def learn(strategy, text, batches, rows=4, offset=0, window=10, step=40):
    for t in range(batches):
        strategy.learn(windows(text, rows, window=window, start=offset + t * step))


def weights(module):
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- kd-logit and kd-rep ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [KDLogit, KDRep])
def test_distillation_is_zero_at_a_snapshot_and_positive_once_the_student_moves(cls):
    strategy = make(cls, p_write=0.5, r_interval=4, n_replay=8, memory_size=50, boundary="every:3")
    probe = windows(EN, 6, start=3).inputs
    learn(strategy, EN, 2)
    assert strategy.teacher is None and strategy.distillation(probe).item() == 0.0  # plain replay so far
    learn(strategy, EN, 1, offset=80)
    assert strategy.snapshots == (2,)
    with torch.no_grad():  # the same kernels for student and teacher: exactly zero
        assert strategy.distillation(probe).item() == 0.0
    # with gradients the student's LSTM runs another CPU kernel: zero up to rounding
    assert strategy.distillation(probe).item() < 1e-12
    learn(strategy, CS, 1)
    assert strategy.distillation(probe).item() > 1e-6


@pytest.mark.parametrize("cls", [KDLogit, KDRep])
def test_distillation_is_the_mse_between_student_and_teacher_outputs(cls):
    strategy = make(cls, p_write=0.5, r_interval=4, n_replay=8, memory_size=50, boundary="every:3")
    learn(strategy, EN, 5)
    probe = windows(CS, 5).inputs
    state = strategy.model.initial_state(5)
    if cls is KDLogit:
        student, teacher = strategy.model(probe, state)[0], strategy.teacher(probe, state)[0]
    else:
        student, teacher = strategy.model.features(probe, state)[0], strategy.teacher.features(probe, state)[0]
    by_hand = ((student - teacher) ** 2).sum() / student.numel()
    assert by_hand.item() > 0
    assert strategy.distillation(probe).item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_the_teacher_is_frozen_apart_from_the_model_and_refreshed_only_at_boundaries():
    strategy = make(KDLogit, p_write=0.5, r_interval=4, n_replay=8, memory_size=50, boundary="every:5")
    learn(strategy, EN, 5)
    teacher = strategy.teacher
    snapshot = weights(teacher)
    assert equal(snapshot, weights(strategy.model))
    assert not {id(p) for p in teacher.parameters()} & {id(p) for p in strategy.model.parameters()}
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters()) and not teacher.training
    replays = strategy.replays
    learn(strategy, CS, 4)  # updates and replays with distillation, no boundary
    assert strategy.replays > replays
    assert equal(weights(strategy.teacher), snapshot)
    assert not equal(weights(strategy.model), snapshot)
    learn(strategy, CS, 1, offset=160)  # the 10th batch: a new snapshot of the current model
    assert strategy.snapshots == (4, 9)
    assert equal(weights(strategy.teacher), weights(strategy.model))
    assert "teacher" in strategy.state_dict() and equal(strategy.state_dict()["teacher"], weights(strategy.model))


@pytest.mark.parametrize("cls", [KDLogit, KDRep])
def test_with_alpha_zero_it_is_replay(cls):
    replay = make(Replay, p_write=0.5, r_interval=4, n_replay=8, memory_size=50)
    distilling = make(cls, p_write=0.5, r_interval=4, n_replay=8, memory_size=50, alpha=0.0, boundary="every:3")
    batches = [(windows(EN if t < 10 else CS, 4, start=t * 40), None) for t in range(20)]
    assert [r.loss for r in run(distilling, batches)] == [r.loss for r in run(replay, batches)]
    assert distilling.snapshots == (2, 5, 8, 11, 14, 17)


@pytest.mark.parametrize("cls", [KDLogit, KDRep])
def test_a_large_alpha_keeps_the_student_near_the_teacher_on_old_data(cls):
    drift = {}
    for alpha in (0.0, 100.0):
        strategy = make(cls, p_write=0.5, r_interval=4, n_replay=8, memory_size=50, alpha=alpha, boundary="every:30")
        learn(strategy, EN, 30)  # the snapshot after batch 29 knows English
        learn(strategy, CS, 29)  # then Czech, with English windows replayed
        assert strategy.snapshots == (29,) and strategy.replays == 59
        drift[alpha] = strategy.distillation(windows(EN, 8, start=7).inputs).item()
    assert drift[100.0] < 0.1 * drift[0.0], drift


def test_page_hinkley_on_the_training_loss_snapshots_after_a_switch():
    """The default boundary is Page-Hinkley on the training loss: a switch to a new language snapshots."""
    strategy = make(KDLogit, p_write=0.5, r_interval=4, n_replay=8, memory_size=50)
    learn(strategy, "0123456789 " * 5, 40)
    learn(strategy, CS, 20)
    assert strategy.teacher is not None and all(t >= 40 for t in strategy.snapshots)


def test_kd_rep_needs_features():
    class NoFeatures(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="features"):
        KDRep(NoFeatures(), lr=2e-3)
    with pytest.raises(ValueError):
        KDLogit(LSTMLanguageModel(TINY), lr=2e-3, boundary="sometimes")


# --- MbPA++ ----------------------------------------------------------------------------------------


def mbpa(config=TINY, **hyperparameters):
    return make(MbPA, config=config, **{"p_write": 1.0, "r_interval": 10**9, "memory_size": 60, **hyperparameters})


def plain(strategy, batch):
    """The prediction without local adaptation: Naive's, with the strategy's current weights and state."""
    return strategy._trainer.predict(batch, strategy._trainer.start_state(batch)).loss  # without adaptation


def test_predict_adapts_then_restores_the_base_weights_bit_for_bit():
    strategy = mbpa(neighbours=5, local_steps=4)
    learn(strategy, EN, 6)
    learn(strategy, CS, 6)
    batch = windows(CS, 4, start=13)
    parameters = [p.detach().clone() for p in strategy.model.parameters()]
    gradients = [p.grad.clone() for p in strategy.model.parameters()]
    adapted = strategy.predict(batch).loss
    assert all(torch.equal(p, kept) for p, kept in zip(strategy.model.parameters(), parameters))
    assert all(torch.equal(p.grad, kept) for p, kept in zip(strategy.model.parameters(), gradients))
    assert strategy.model.training  # the mode learn left is kept
    assert torch.equal(strategy.predict(batch).loss, adapted)
    assert adapted.item() != plain(strategy, batch).item()


def test_with_an_empty_memory_predict_is_naives():
    strategy = mbpa(p_write=0.0)
    naive = make(Naive)
    for t in range(5):
        batch = windows(EN, 3, start=t * 30)
        assert torch.equal(strategy.predict(batch).loss, naive.predict(batch).loss)
        strategy.learn(batch), naive.learn(batch)
    assert len(strategy.memory) == 0


def test_the_adapted_prediction_is_local_gradient_steps_on_the_nearest_neighbours():
    lr, lam, steps = 0.3, 0.5, 3
    strategy = mbpa(neighbours=6, local_steps=steps, local_lambda=lam, local_lr=lr, clip=1e9)  # no clipping
    learn(strategy, EN, 5)
    learn(strategy, CS, 5)
    batch = windows(CS, 4, start=21)
    inputs, targets = strategy.nearest(batch)
    # by hand: theta <- theta - lr * grad(loss on the neighbours from a zero state + lam * ||theta - base||^2)
    model = copy.deepcopy(strategy.model)
    base = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        logits, _ = model(inputs, model.initial_state(len(inputs)))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss = loss + lam * sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), base))
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= lr * g
    model.eval()
    with torch.no_grad():
        logits, _ = model(batch.inputs, strategy._trainer.start_state(batch))  # the carried state of the b streams
    by_hand = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))
    assert strategy.predict(batch).loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert by_hand.item() != pytest.approx(plain(strategy, batch).item(), rel=1e-3)


def test_neighbours_are_the_rows_with_the_nearest_keys():
    strategy = mbpa(neighbours=7)
    learn(strategy, EN, 6, rows=3)
    learn(strategy, CS, 6, rows=3)
    batch = windows(CS, 4, start=17)
    held_inputs, _ = strategy.memory.rows()
    distances = ((strategy.keys(held_inputs) - strategy.keys(batch.inputs).mean(0)) ** 2).sum(1)
    expected = held_inputs[distances.argsort()[:7]]
    inputs, targets = strategy.nearest(batch)
    assert torch.equal(inputs, expected)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # rows stay paired with their targets


def test_keys_of_an_untrained_frozen_lstm_mostly_find_windows_of_the_same_language():
    rng = random.Random(0)
    texts = {name: " ".join(rng.choice(WORDS[name]) for _ in range(400)) for name in ("en", "cs")}
    strategy = mbpa(neighbours=10)
    for name in ("en", "cs"):  # memory slots 0-29 English, 30-59 Czech windows
        learn(strategy, texts[name], 10, rows=3, window=20, step=60)
    held_inputs, _ = strategy.memory.rows()
    same = 0
    for name in ("en", "cs"):
        inputs, _ = strategy.nearest(windows(texts[name], 4, window=20, start=1500))
        slots = [next(i for i in range(60) if torch.equal(held_inputs[i], row)) for row in inputs]
        same += sum((slot >= 30) == (name == "cs") for slot in slots)
    assert same >= 15  # of 20 (measured: 17; at random about 10)


def test_keys_come_from_a_key_network_that_never_learns():
    strategy = mbpa()
    initial = weights(strategy.model)
    learn(strategy, EN, 4)
    assert not equal(weights(strategy.model), initial)
    key_network = strategy.state_dict()["key_network"]
    assert equal(key_network, initial)
    held_inputs, _ = strategy.memory.rows()
    assert torch.allclose(strategy.state_dict()["keys"], strategy.keys(held_inputs), rtol=0, atol=1e-6)


def test_predict_with_dropout_leaves_the_global_rng_alone():
    strategy = mbpa(config=LSTMConfig(embedding=8, hidden=24, layers=2, dropout=0.3), neighbours=4, local_steps=2)
    learn(strategy, EN, 3)
    batch = windows(EN, 4, start=9)
    rng = torch.get_rng_state()
    first = strategy.predict(batch).loss
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(strategy.predict(batch).loss, first)  # the same dropout draws, from the forked RNG
