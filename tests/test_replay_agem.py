"""The defining property of each piece: uniform reservoir, replay schedule, A-GEM projection."""

import pytest
import torch

from streamer.models import LSTMLanguageModel
from streamer.strategies.agem import AGEM, project
from streamer.strategies.base import Batch
from streamer.strategies.memory import ReservoirMemory
from streamer.strategies.replay import Replay
from tests.helpers import TINY


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def windows(text: str, rows: int, window: int = 10, start: int = 0) -> Batch:
    """rows consecutive byte windows of `text` (repeated as needed), targets shifted by one."""
    data = torch.tensor(list(text.encode("utf-8")) * ((start + rows * window) // len(text) + 2), dtype=torch.int64)
    data = data[start: start + rows * window + 1]
    return Batch(inputs=data[:-1].view(rows, window), targets=data[1:].view(rows, window))


def test_reservoir_holds_every_offered_item_with_equal_probability():
    # Algorithm R keeps each of N = 10,000 offered items with probability k / N = 100 / 10,000 = 0.01.
    # Over R = 200 seeded runs an item's inclusion count is Binomial(200, 0.01): mean 2, too noisy to
    # test item by item, so items are grouped in 100 consecutive blocks of 100: a block holds
    # 100 * 0.01 = 1 item per run on average, 200 over all runs, with variance about
    # 200 * 100 * 0.01 * 0.99 ~ 198 (sd ~ 14). Every block must lie within 200 +- 70 (5 sd), which
    # catches a bias toward early or late items; the first and last 1,000 items (2,000 expected
    # each, sd ~ 44) must lie within 2,000 +- 200.
    items, capacity, runs = 10_000, 100, 200
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
    blocks = counts.view(100, 100).sum(dim=1)
    assert (blocks - 200).abs().max() <= 70, blocks
    assert abs(counts[:1000].sum().item() - 2000) <= 200
    assert abs(counts[-1000:].sum().item() - 2000) <= 200


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
    return Replay(LSTMLanguageModel(TINY), **kw)


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
    strategy = AGEM(LSTMLanguageModel(TINY), p_write=1.0, n_ref=8, memory_size=50)
    for t in range(30):  # memory fills with English windows
        strategy.learn(windows("the quick brown fox jumps over the lazy dog ", rows=4, start=t * 40))
    english = strategy.projections
    for t in range(30):  # then Czech: its gradient conflicts with the English reference
        strategy.learn(windows("příliš žluťoučký kůň úpěl ďábelské ódy ", rows=4, start=t * 40))
    assert strategy.projections > english
    assert strategy.projections <= 59  # at most once per update with a non-empty memory


def test_agem_without_memory_is_naive():
    from streamer.strategies.naive import Naive

    batch = windows("hello world, how are you ", rows=3)
    torch.manual_seed(0)
    agem = AGEM(LSTMLanguageModel(TINY), p_write=0.0)
    torch.manual_seed(0)
    naive = Naive(LSTMLanguageModel(TINY))
    for _ in range(3):
        a, n = agem.learn(batch), naive.learn(batch)
        assert torch.equal(a.loss, n.loss) and torch.equal(a.grad_norm, n.grad_norm)
    assert agem.projections == 0 and len(agem.memory) == 0
