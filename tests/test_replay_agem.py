"""The defining property of each piece: uniform reservoir, replay schedule, A-GEM projection."""

import pytest
import torch

from streamer.models import LSTMLanguageModel
from streamer.strategies.agem import AGEM, project
from streamer.strategies.base import Batch
from streamer.strategies.memory import HerdingMemory, ReservoirMemory, herding_order
from streamer.strategies.replay import Replay
from tests.helpers import TINY


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def windows(text: str, rows: int, window: int = 10, start: int = 0) -> Batch:
    """rows consecutive byte windows of `text` (repeated as needed), targets shifted by one."""
    data = torch.tensor(list(text.encode("utf-8")) * ((start + rows * window) // len(text) + 2), dtype=torch.int64)
    data = data[start: start + rows * window + 1]
    return Batch(inputs=data[:-1].view(rows, window), targets=data[1:].view(rows, window))


def test_reservoir_holds_every_offered_item_with_equal_probability():
    # Algorithm R keeps each of N = 1,000 offered items with probability k / N = 100 / 1,000 = 0.1.
    # Over R = 200 seeded runs an item's inclusion count is Binomial(200, 0.1): mean 20, too noisy to
    # test item by item, so items are grouped in 100 consecutive blocks of 10: a block holds
    # 10 * 0.1 = 1 item per run on average, 200 over all runs, with variance about
    # 200 * 10 * 0.1 * 0.9 = 180 (sd ~ 13). Every block must lie within 200 +- 70 (5 sd), which
    # catches a bias toward early or late items; the first and last 100 items (2,000 expected
    # each, sd ~ 42) must lie within 2,000 +- 200. (N = 10,000 with the same k gave the same
    # statistics at ten times the offers: 25 s of the suite's time.)
    items, capacity, runs = 1_000, 100, 200
    rows = torch.arange(items).unsqueeze(1)
    counts = torch.zeros(items, dtype=torch.int64)
    for seed in range(runs):
        memory = ReservoirMemory(capacity, seed=seed)
        for i in range(items):
            memory.offer(rows[i], rows[i])
        assert len(memory) == capacity and memory.seen == items
        held, targets = memory.sample(capacity, torch.Generator().manual_seed(seed))
        assert torch.equal(held, targets)
        assert held.flatten().unique().numel() == capacity  # a sample of all of it, no repeats
        counts[held.flatten()] += 1
    assert counts.sum() == runs * capacity
    per_item = counts.float() / runs
    assert per_item.mean().item() == pytest.approx(capacity / items)
    blocks = counts.view(100, 10).sum(dim=1)
    assert (blocks - 200).abs().max() <= 70, blocks
    assert abs(counts[:100].sum().item() - 2000) <= 200
    assert abs(counts[-100:].sum().item() - 2000) <= 200


def test_reservoir_state_round_trip_makes_the_same_next_choices():
    rows = torch.arange(500).unsqueeze(1)
    memory = ReservoirMemory(20, seed=3)
    for i in range(200):
        memory.offer(rows[i], rows[i])
    restored = ReservoirMemory(20, seed=77)
    restored.load_state_dict(memory.state_dict())
    for i in range(200, 500):
        memory.offer(rows[i], rows[i])
        restored.offer(rows[i], rows[i])
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(memory.sample(20, g1)[0], restored.sample(20, g2)[0])


def replay(**kw):
    torch.manual_seed(0)
    return Replay(LSTMLanguageModel(TINY), **{"lr": 2e-3, **kw})


def test_replay_makes_one_update_per_r_interval_rows_learned():
    strategy = replay(p_write=0.5, r_interval=7, n_replay=4, memory_size=30)
    batches = 40
    for t in range(batches):
        strategy.learn(windows("hello world, how are you ", rows=3, start=t * 30))
    rows = 3 * batches  # 120 rows -> floor(120 / 7) = 17 replay updates
    assert strategy.replays == rows // 7 == 17
    # counted independently: Adam's step count is one per batch plus one per replay update
    adam_steps = strategy.state_dict()["optimizer"]["state"][0]["step"]
    assert int(adam_steps) == batches + 17


def test_each_replay_update_is_on_n_replay_rows_the_memory_holds():
    """A replay update's loss is taken on n_replay (input, target) rows held in memory. The count and
    Adam's steps above passed with the replay loss taken on other targets (zeros) than the rows'."""
    strategy = replay(p_write=0.5, r_interval=7, n_replay=4, memory_size=30)
    replayed, loss = [], strategy._trainer.zero_state_loss  # noqa: SLF001 - the replay loss Replay.learn passes

    def noted(inputs, targets):
        held = {(tuple(i.tolist()), tuple(t.tolist())) for i, t in zip(*strategy.memory.rows())}
        replayed.append([(tuple(i.tolist()), tuple(t.tolist())) in held for i, t in zip(inputs, targets)])
        return loss(inputs, targets)
    strategy._trainer.zero_state_loss = noted  # noqa: SLF001
    for t in range(40):
        strategy.learn(windows("hello world, how are you ", rows=3, start=t * 30))
    assert len(replayed) == strategy.replays == 17
    assert all(rows == [True] * 4 for rows in replayed), replayed


class CountingTrainer:
    """An OnlineTrainer's step_on that notes the rows of each replay loss it is given."""

    skipped = False

    def __init__(self):
        self.rows = []

    def step_on(self, rows):
        self.rows.append(rows)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_under_ranks_replays_fall_at_one_process_steps_on_n_replay_rows_in_all(world, monkeypatch):
    """r_interval, n_replay and memory_size are the learner's: each of N ranks, learning b/N rows a
    batch, replays when one process of b rows would, on its share of n_replay rows, and keeps its share
    of memory_size (before: N times fewer replays, on N x n_replay rows, from N x memory_size)."""
    from streamer import distributed
    from streamer.strategies.replay import SparseReplay

    b, batches, r_interval, n_replay, memory_size = 6, 30, 14, 5, 31
    due = {}  # rank -> the steps at which it replayed
    sampled, kept = [], []
    for rank in range(world):
        ranks = distributed.Ranks(rank=rank, world=world, device=torch.device("cpu")) if world > 1 else None
        monkeypatch.setattr(distributed, "_current", ranks)
        replay, trainer = SparseReplay(0.5, r_interval, n_replay, memory_size, seed=3), CountingTrainer()
        due[rank] = []
        for t in range(batches):
            batch = windows("hello world, how are you ", rows=b // world, start=t * 60 + rank * 10)
            replay.write(batch)
            before = len(trainer.rows)
            replay.after_learn(batch, trainer, lambda inputs, targets: inputs.shape[0])
            due[rank] += [t] * (len(trainer.rows) - before)
        sampled.append(set(trainer.rows))
        kept.append(replay.memory.capacity)
    one_process = [t for t in range(batches) for _ in range((t + 1) * b // r_interval - t * b // r_interval)]
    assert all(steps == one_process for steps in due.values())  # 12 replays, at one process's steps
    assert sum(rows for (rows,) in sampled) == n_replay and sum(kept) == memory_size


def test_replay_writes_each_row_with_probability_p_write():
    p_write, b, batches, seed = 0.1, 8, 250, 4
    strategy = replay(p_write=p_write, r_interval=10**9, memory_size=10_000, seed=seed)
    for t in range(batches):
        strategy.learn(windows("bonjour le monde, ça va ", rows=b, start=t * 80))
    # the same draw, reimplemented: one uniform per row from a generator seeded with `seed`
    generator = torch.Generator().manual_seed(seed)
    expected = sum(int((torch.rand(b, generator=generator) < p_write).sum()) for _ in range(batches))
    assert len(strategy.memory) == strategy.memory.seen == expected
    # Binomial(2000, 0.1): mean 200, sd ~ 13.4
    assert abs(expected - p_write * b * batches) <= 4 * (b * batches * p_write * (1 - p_write)) ** 0.5
    assert strategy.replays == 0


def test_project_leaves_a_gradient_that_agrees_with_the_reference():
    g_ref = torch.tensor([1.0, 0.0, 0.0])
    # g.g_ref = -2 < 0: g - (-2 / 1) g_ref = (-2, 1, 0) + (2, 0, 0) = (0, 1, 0)
    assert torch.equal(project(torch.tensor([-2.0, 1.0, 0.0]), g_ref), torch.tensor([0.0, 1.0, 0.0]))
    # g.g_ref = 3 >= 0 and g.g_ref = 0: unchanged
    assert torch.equal(project(torch.tensor([3.0, -1.0, 2.0]), g_ref), torch.tensor([3.0, -1.0, 2.0]))
    assert torch.equal(project(torch.tensor([0.0, 5.0, 0.0]), g_ref), torch.tensor([0.0, 5.0, 0.0]))
    # g = (1, -3), g_ref = (1, 1): g.g_ref = -2, |g_ref|^2 = 2 -> g + (1, 1) = (2, -2), orthogonal to g_ref
    projected = project(torch.tensor([1.0, -3.0]), torch.tensor([1.0, 1.0]))
    assert torch.equal(projected, torch.tensor([2.0, -2.0]))
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        g, ref = torch.randn(20, generator=generator), torch.randn(20, generator=generator)
        out = project(g, ref)
        assert torch.dot(out, ref) >= -1e-5
        if torch.dot(g, ref) >= 0:
            assert torch.equal(out, g)


def test_agem_projects_when_memory_holds_a_different_class():
    torch.manual_seed(0)
    strategy = AGEM(LSTMLanguageModel(TINY), lr=2e-3, p_write=1.0, n_ref=8, memory_size=50)
    for t in range(30):  # memory fills with English windows
        strategy.learn(windows("the quick brown fox jumps over the lazy dog ", rows=4, start=t * 40))
    english = strategy.projections
    for t in range(30):  # then Czech: its gradient conflicts with the English reference
        strategy.learn(windows("příliš žluťoučký kůň úpěl ďábelské ódy ", rows=4, start=t * 40))
    assert strategy.projections > english
    assert strategy.projections <= 59  # at most once per update with a non-empty memory


def test_agem_steps_with_the_projected_gradient():
    """The update is made with project(g, g_ref): g from the batch (carried state), g_ref from the
    reference rows the sample generator draws from memory (zero state). The projection count alone
    (above) passed with the unprojected g applied: naive fine-tuning that counted conflicts."""
    import copy

    def flat(model):
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in model.parameters()])

    options = dict(lr=1e-2, p_write=1.0, n_ref=8, memory_size=50)  # (9 of the 30 Czech updates conflict)
    torch.manual_seed(0)
    strategy = AGEM(LSTMLanguageModel(TINY), **options)
    for t in range(30):  # memory fills with English windows
        strategy.learn(windows("the quick brown fox jumps over the lazy dog ", rows=4, start=t * 40))
    applied, step = [], strategy._trainer.clip_and_step  # noqa: SLF001 - the gradient the optimizer is given
    strategy._trainer.clip_and_step = lambda *args: applied.append(flat(strategy.model)) or step(*args)  # noqa: SLF001
    conflicts = 0
    for t in range(30):  # Czech: its gradient conflicts with the English reference
        batch = windows("příliš žluťoučký kůň úpěl ďábelské ódy ", rows=4, start=t * 40)
        twin = AGEM(LSTMLanguageModel(TINY), **options)
        twin.load_state_dict(copy.deepcopy(strategy.state_dict()))
        trainer = twin._trainer  # noqa: SLF001
        twin.model.train()
        trainer.loss(batch, trainer.start_state(batch))[0].backward()
        g = flat(twin.model)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.zero_state_loss(*twin.memory.sample(twin.n_ref, twin._sample_generator)).backward()  # noqa: SLF001
        g_ref = flat(twin.model)
        strategy.learn(batch)
        assert torch.allclose(applied[-1], project(g, g_ref), rtol=1e-5, atol=1e-8), t
        if torch.dot(g, g_ref) < 0:
            conflicts += 1
            assert not torch.allclose(applied[-1], g, rtol=1e-3, atol=1e-6), t
    assert conflicts >= 5, conflicts


def test_agem_without_memory_is_naive():
    from streamer.strategies.naive import Naive

    batch = windows("hello world, how are you ", rows=3)
    torch.manual_seed(0)
    agem = AGEM(LSTMLanguageModel(TINY), lr=2e-3, p_write=0.0)
    torch.manual_seed(0)
    naive = Naive(LSTMLanguageModel(TINY), lr=2e-3)
    for _ in range(3):
        a, n = agem.learn(batch), naive.learn(batch)
        assert torch.equal(a.loss, n.loss) and torch.equal(a.grad_norm, n.grad_norm)
    assert agem.projections == 0 and len(agem.memory) == 0


# --- herding selection (seed 001, iCaRL) -----------------------------------------------------------


def test_herding_order_matches_the_greedy_order_computed_by_hand():
    features = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0], [3.0, 3.0], [0.0, 0.0]])
    # Squared distances to the mean (1.2, 1.4). Pick 1: x itself: 2.6, 4.0, 0.2, 5.8, 3.4 -> row 2 (1, 1).
    # Pick 2: (x + (1, 1)) / 2 against the mean: 0.9, 0.85, -, 1.0, 1.3 -> row 1 (0, 3).
    # Pick 3: (x + (1, 4)) / 3: row 0 -> (1, 4/3): 0.044; row 3 -> (4/3, 7/3): 0.889;
    #         row 4 -> (1/3, 4/3): 0.756 -> row 0.
    # Pick 4: (x + (3, 4)) / 4: row 3 -> (1.5, 1.75): 0.2125; row 4 -> (0.75, 1): 0.3625 -> row 3. Then row 4.
    assert herding_order(features, 5).tolist() == [2, 1, 0, 3, 4]
    assert herding_order(features, 2).tolist() == [2, 1]  # a prefix is the herding choice of that size
    assert herding_order(features, 9).tolist() == [2, 1, 0, 3, 4]  # never more than the rows there are
    # the mean of a 10-row herding prefix is closer to the mean than that of any of 50 random 10-row subsets
    generator = torch.Generator().manual_seed(0)
    cloud = torch.randn(200, 8, generator=generator)
    herded = (cloud[herding_order(cloud, 10)].mean(0) - cloud.mean(0)).norm()
    random_prefixes = torch.stack([(cloud[torch.randperm(200, generator=generator)[:10]].mean(0) - cloud.mean(0)).norm()
                                   for _ in range(50)])
    assert herded < random_prefixes.min()


def segment(memory, first_value, rows, generator):
    """Offer `rows` rows whose every entry is a distinct value from first_value on; random features."""
    for value in range(first_value, first_value + rows):
        memory.offer(torch.full((4,), value), torch.full((4,), value))
    candidates, _ = memory.candidates()
    return candidates, torch.randn(len(candidates), 5, generator=generator)


def test_herding_memory_splits_capacity_evenly_and_keeps_each_segments_best_prefix():
    generator = torch.Generator().manual_seed(0)
    memory = HerdingMemory(12, seed=1)
    candidates, features = segment(memory, 0, 20, generator)  # 20 offered to a 12-row candidate reservoir
    assert len(memory) == len(candidates) == 12 and memory.exemplars == 0
    memory.close_segment(features)
    unit = features / features.norm(dim=1, keepdim=True)  # iCaRL herds on L2-normalised features
    first, _ = memory.exemplar_rows()
    assert torch.equal(first, candidates[herding_order(unit, 12)])
    assert memory.segment_sizes == (12,) and memory.candidates() is None
    memory.close_segment(torch.zeros(0, 5))  # an empty segment is not counted
    _, features = segment(memory, 100, 9, generator)
    memory.close_segment(features)
    assert memory.segment_sizes == (6, 6)
    held, _ = memory.exemplar_rows()
    assert torch.equal(held[:6], first[:6])  # the older segment keeps the first 6 of its herding order
    _, features = segment(memory, 200, 30, generator)
    memory.close_segment(features)
    assert memory.segment_sizes == (4, 4, 4)
    held, targets = memory.exemplar_rows()
    assert torch.equal(held, targets) and torch.equal(held[:4], first[:4])
    assert (held[4:8] >= 100).all() and (held[4:8] < 200).all() and (held[8:] >= 200).all()
    for k in range(13):  # more segments than capacity: one row each, the oldest dropped
        _, features = segment(memory, 1000 + 10 * k, 2, generator)
        memory.close_segment(features)
        assert memory.exemplars <= 12
    assert memory.segment_sizes == (1,) * 12
    rows, _ = memory.sample(30, torch.Generator().manual_seed(0))
    assert set(rows[:, 0].tolist()) <= set(memory.exemplar_rows()[0][:, 0].tolist())


def test_replay_with_herding_closes_a_segment_at_each_boundary():
    strategy = replay(p_write=1.0, r_interval=6, n_replay=4, memory_size=20, selection="herding", boundary="every:5")
    for t in range(17):
        strategy.learn(windows("hello world, how are you " if t < 10 else "bonjour le monde ", rows=3, start=t * 30))
    assert strategy.boundaries_at == (4, 9, 14)
    # 15 candidates per segment; m = 20 // 1 keeps all 15, then 20 // 2 = 10 each, then 20 // 3 = 6 each
    assert strategy.memory.segment_sizes == (6, 6, 6)
    assert len(strategy.memory.candidates()[0]) == 6  # batches 15 and 16
    assert strategy.replays == 17 * 3 // 6
    assert "boundaries" not in replay().state_dict()  # the reservoir path looks for none


def test_replay_with_herding_round_trips_and_predict_changes_nothing():
    import copy

    from tests.test_strategy_conformance import assert_same

    options = dict(p_write=0.5, r_interval=6, n_replay=4, memory_size=20, selection="herding", boundary="every:4")
    strategy = replay(**options)
    for t in range(10):
        strategy.learn(windows("hello world, how are you ", rows=3, start=t * 30))
    before = copy.deepcopy(strategy.state_dict())
    strategy.predict(windows("bonjour le monde ", rows=3))
    assert_same(strategy.state_dict(), before)
    torch.manual_seed(9)
    restored = Replay(LSTMLanguageModel(TINY), **{"lr": 2e-3, **options})
    restored.load_state_dict(copy.deepcopy(before))
    later = [windows("bonjour le monde ", rows=3, start=t * 30) for t in range(8)]
    assert [strategy.learn(b).loss for b in later] == [restored.learn(b).loss for b in later]
    assert_same(strategy.state_dict(), restored.state_dict())


def test_unknown_selection_is_refused():
    with pytest.raises(ValueError, match="selection"):
        replay(selection="random")
