"""L2 and online EWC: the penalty as defined, consolidation at boundaries found from the loss alone."""

import copy

import pytest
import torch

from streamer.models import LSTMLanguageModel
from streamer.step import run
from streamer.strategies.regularized import EWC, L2
from tests.helpers import TINY, batches_from_records, naive, permute_classes, small_stream

# Two classes far apart in byte statistics; with seed 1 the stream switches at batches 3, 34 and 39 of 46.
STRONG = {"digits": "0123456789 " * 600, "cs": "příliš žluťoučký kůň úpěl ďábelské ódy " * 300}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def batches(tiny_stream):
    return tiny_stream[1]


@pytest.fixture(scope="module")
def strong():
    records, _ = small_stream(STRONG, fragments=4, mean_tokens=300, streams=3, window=10, seed=1)
    return records, batches_from_records(records, 3, 10)


def make(cls, seed=0, **hyperparameters):
    torch.manual_seed(seed)
    return cls(LSTMLanguageModel(TINY), **{"lr": 2e-3, **hyperparameters})


def learn_all(strategy, batches):
    for batch, _ in batches:
        strategy.learn(batch)


def parameters(strategy):
    return {name: p.detach().clone() for name, p in strategy.model.named_parameters()}


def distance(a, b, weights=None):
    """Euclidean distance between two parameter dicts, optionally weighted per entry (EWC's Fisher)."""
    return sum(((1 if weights is None else weights[n]) * (a[n] - b[n]) ** 2).sum() for n in a).sqrt().item()


def same(a, b):
    """Structural equality of state dicts: tensors by value, everything else by ==."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_l2_penalty_is_half_lambda_times_squared_distance_to_the_anchor(batches):
    strategy = make(L2, l2_lambda=0.7, boundary="every:5")
    assert strategy.penalty().item() == 0.0 and strategy.anchor is None  # plain fine-tuning before consolidating
    learn_all(strategy, batches[:8])
    assert strategy.consolidated_at == (4,)
    anchor, now = strategy.anchor, parameters(strategy)
    by_hand = 0.7 / 2 * sum(((now[name] - anchor[name]) ** 2).sum() for name in now)
    assert by_hand.item() > 0
    assert strategy.penalty().item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_ewc_penalty_is_half_lambda_times_fisher_weighted_squared_distance(batches):
    strategy = make(EWC, ewc_lambda=50.0, fisher_decay=0.8, gamma=0.5, boundary="every:3")
    assert strategy.penalty().item() == 0.0 and strategy.anchor is None  # plain fine-tuning before consolidating
    learn_all(strategy, batches[:3])
    running, first = strategy.fisher, strategy.consolidated_fisher
    assert all(torch.equal(first[n], running[n]) for n in running)  # the first consolidation takes F as it is
    learn_all(strategy, batches[3:8])
    assert strategy.consolidated_at == (2, 5)
    consolidated, anchor, now = strategy.consolidated_fisher, strategy.anchor, parameters(strategy)
    by_hand = 50.0 / 2 * sum((consolidated[n] * (now[n] - anchor[n]) ** 2).sum() for n in now)
    assert by_hand.item() > 0
    assert strategy.penalty().item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_ewc_consolidation_combines_fishers_with_gamma(batches):
    strategy = make(EWC, gamma=0.5, fisher_decay=0.8, boundary="every:3")
    learn_all(strategy, batches[:3])
    previous = strategy.consolidated_fisher
    learn_all(strategy, batches[3:6])
    running = strategy.fisher  # unchanged since the consolidation after batch 5
    expected = {n: 0.5 * previous[n] + running[n] for n in running}
    got = strategy.consolidated_fisher
    assert all(torch.allclose(got[n], expected[n], rtol=1e-6, atol=0) for n in got)


def assert_fisher_step_is_the_data_gradient_squared(strategy, batch, **options):
    """Learning `batch` moves `strategy`'s running Fisher to 0.8 x before + 0.2 x the squared gradient of the
    data loss alone (as learn computes it), taken on a replica of `strategy` made with `options`."""
    before = strategy.fisher
    replica = make(EWC, **options)
    replica.load_state_dict(copy.deepcopy(strategy.state_dict()))
    loss, _ = replica._loss(batch, replica._start_state(batch))  # the data loss, as learn computes it
    loss.backward()
    squared = {n: p.grad ** 2 for n, p in replica.model.named_parameters()}
    strategy.learn(batch)
    after = strategy.fisher
    assert all(torch.allclose(after[n], 0.8 * before[n] + 0.2 * squared[n], rtol=1e-5, atol=1e-12)
               for n in after)


def test_ewc_running_fisher_is_a_decayed_mean_of_squared_data_gradients(batches):
    strategy = make(EWC, fisher_decay=0.8, boundary="none")
    strategy.learn(batches[0][0])
    assert_fisher_step_is_the_data_gradient_squared(strategy, batches[1][0], fisher_decay=0.8, boundary="none")


def test_the_running_fisher_leaves_out_the_penaltys_gradient_once_a_penalty_is_in_place(batches):
    # the test above runs before any consolidation, where the penalty has no gradient: squaring the gradient
    # after the penalty's backward (the data's plus the penalty's) passed it
    strategy = make(EWC, ewc_lambda=1e4, fisher_decay=0.8, boundary="every:2")
    learn_all(strategy, batches[:3])  # consolidated after batch 1; batch 2 moved the weights off the anchor
    assert strategy.consolidated_at == (1,) and strategy.penalty().item() > 0
    assert_fisher_step_is_the_data_gradient_squared(strategy, batches[3][0], ewc_lambda=1e4, fisher_decay=0.8,
                                                    boundary="every:2")


@pytest.mark.parametrize("cls", [L2, EWC])
def test_each_consolidation_moves_the_anchor_to_the_weights_of_that_moment(batches, cls):
    # the penalty tests compute it from the anchor the strategy reports: an anchor taken at the first
    # consolidation only (the later ones leaving it) passed them
    strategy = make(cls, boundary="every:3")
    learn_all(strategy, batches[:3])
    first = strategy.anchor
    assert same(first, parameters(strategy))
    learn_all(strategy, batches[3:6])
    now = parameters(strategy)
    assert strategy.consolidated_at == (2, 5) and not same(first, now)
    assert same(strategy.anchor, now)


@pytest.mark.parametrize("cls,hyperparameters", [(L2, {"l2_lambda": 0.0}), (EWC, {"ewc_lambda": 0.0})])
def test_lambda_zero_gives_naives_losses_exactly(batches, cls, hyperparameters):
    strategy = make(cls, boundary="every:4", **hyperparameters)
    ours = [r.loss for r in run(strategy, batches[:16])]
    assert strategy.consolidations == 4  # the penalty was in place for 12 of the 16 batches
    assert ours == [r.loss for r in run(naive(seed=0), batches[:16])]


@pytest.mark.parametrize("cls,hyperparameters", [(L2, {"l2_lambda": 10.0}), (EWC, {"ewc_lambda": 1e6})])
def test_a_large_lambda_keeps_the_parameters_near_the_anchor(batches, cls, hyperparameters):
    strategy = make(cls, boundary="every:10", **hyperparameters)
    baseline = naive(seed=0)
    learn_all(strategy, batches[:10])
    learn_all(baseline, batches[:10])
    anchor = strategy.anchor
    assert distance(anchor, parameters(baseline)) == 0.0  # identical until the first consolidation
    learn_all(strategy, batches[10:20])
    learn_all(baseline, batches[10:20])
    # EWC anchors only the weights its Fisher marks as important: measure in its metric
    weights = strategy.consolidated_fisher if cls is EWC else None
    ours = distance(parameters(strategy), anchor, weights)
    naives = distance(parameters(baseline), anchor, weights)
    assert ours < 0.5 * naives, (ours, naives)


def test_boundaries_come_from_the_loss_not_the_headers(strong):
    records, batches = strong
    shuffled = batches_from_records(permute_classes(records, {"digits": "cs", "cs": "digits"}), 3, 10)
    assert [t.class_name for _, t in batches] != [t.class_name for _, t in shuffled]
    a, b = make(L2), make(L2)
    losses_a = [r.loss for r in run(a, batches)]
    losses_b = [r.loss for r in run(b, shuffled)]
    assert losses_a == losses_b
    assert a.consolidated_at == b.consolidated_at
    assert a.consolidations >= 1  # Page-Hinkley finds the digits -> cs switch at batch 34


def test_page_hinkley_on_a_strong_switch_consolidates_for_ewc_too(strong):
    _, batches = strong
    strategy = make(EWC)
    learn_all(strategy, batches)
    assert strategy.consolidations >= 1
    assert all(t >= 10 for t in strategy.consolidated_at)  # never before min_instances losses


@pytest.mark.parametrize("n", [1, 4, 7])
def test_every_n_consolidates_floor_batches_over_n_times(batches, n):
    strategy = make(L2, boundary=f"every:{n}")
    learn_all(strategy, batches[:17])
    assert strategy.consolidations == 17 // n
    assert strategy.consolidated_at == tuple(range(n - 1, 17, n))


def test_consolidations_is_read_only():
    strategy = make(L2)
    with pytest.raises(AttributeError):
        strategy.consolidations = 3


def test_bad_boundaries_are_refused():
    for boundary in ("every:0", "every:x", "cusum"):
        with pytest.raises(ValueError):
            make(EWC, boundary=boundary)


@pytest.mark.parametrize("cls", [L2, EWC])
def test_predict_changes_nothing_once_consolidated(strong, cls):
    # test_strategy_conformance checks predict on l2 and ewc before any consolidation
    # (Page-Hinkley finds none in its 40 batches); here the anchor (and EWC's Fishers) exist.
    _, batches = strong
    strategy = make(cls, boundary="every:5")
    learn_all(strategy, batches[:12])
    assert strategy.consolidated_at == (4, 9) and strategy.penalty().item() > 0
    before = copy.deepcopy(strategy.state_dict())
    strategy.predict(batches[12][0])
    strategy.predict(batches[13][0])
    assert same(strategy.state_dict(), before)


@pytest.mark.parametrize("cls", [L2, EWC])
def test_state_dict_round_trip_gives_the_same_next_losses(strong, cls):
    _, batches = strong
    strategy = make(cls)  # page-hinkley: the detector's state decides the next consolidation
    learn_all(strategy, batches[:30])
    assert strategy.consolidations == 0
    strategy_state = copy.deepcopy(strategy.state_dict())
    restored = make(cls, seed=99)
    restored.load_state_dict(copy.deepcopy(strategy_state))
    a = [(r.loss, r.train_loss) for r in run(strategy, batches[30:])]
    b = [(r.loss, r.train_loss) for r in run(restored, batches[30:])]
    assert a == b
    assert strategy.consolidations >= 1 and restored.consolidated_at == strategy.consolidated_at
    # the detector's history matters: with a fresh detector the same weights consolidate elsewhere or never
    forgetful = make(cls, seed=99)
    state = copy.deepcopy(strategy_state)
    state["detector"] = make(cls).state_dict()["detector"]  # a fresh detector, as plain values
    forgetful.load_state_dict(state)
    learn_all(forgetful, batches[30:])
    assert forgetful.consolidated_at != strategy.consolidated_at


def test_state_dict_carries_anchor_and_fisher(batches):
    strategy = make(EWC, boundary="every:3")
    learn_all(strategy, batches[:7])
    restored = make(EWC, seed=5, boundary="every:3")
    restored.load_state_dict(copy.deepcopy(strategy.state_dict()))
    assert restored.penalty().item() == strategy.penalty().item()
    assert restored.consolidated_at == strategy.consolidated_at
    a = [r.loss for r in run(strategy, batches[7:12])]
    b = [r.loss for r in run(restored, batches[7:12])]
    assert a == b and restored.consolidated_at == strategy.consolidated_at


def test_a_daemon_lists_only_its_last_boundaries(batches):
    """Boundaries kept every batch index it found: a daemon's detector finds one every ~150 batches (EWC's
    Page-Hinkley, 1,188 at batch 170,549 of a CALM stream), so the list grew in memory and in every checkpoint
    for the run's life. The count goes on; the indices of the last FOUND_LISTED are kept."""
    from streamer.strategies.boundary import FOUND_LISTED, Boundaries

    boundaries = Boundaries("every:1")
    for _ in range(FOUND_LISTED + 500):
        boundaries.update(torch.tensor(1.0))
    assert boundaries.found == FOUND_LISTED + 500
    assert boundaries.found_at == tuple(range(500, FOUND_LISTED + 500))
    state = copy.deepcopy(boundaries.state_dict())
    assert len(state["found_at"]) == FOUND_LISTED
    resumed = Boundaries("every:1")
    resumed.load_state_dict(state)
    assert (resumed.found, resumed.found_at) == (boundaries.found, boundaries.found_at)
    strategy = make(L2, boundary="every:1")  # a checkpoint of before: every index listed, no count
    learn_all(strategy, batches[:3])
    state = copy.deepcopy(strategy.state_dict())
    state.pop("consolidations", None)
    state["consolidated_at"] = list(range(3 * FOUND_LISTED))
    strategy.load_state_dict(state)
    assert strategy.consolidations == 3 * FOUND_LISTED and len(strategy.consolidated_at) == FOUND_LISTED
    learn_all(strategy, batches[3:4])
    assert strategy.consolidations == 3 * FOUND_LISTED + 1 and strategy.consolidated_at[-1] == 3
    assert strategy.state_dict()["consolidations"] == 3 * FOUND_LISTED + 1
