"""streamer.checkpoint: a saved and loaded run continues exactly as an uninterrupted one, for every
strategy; files are written atomically and hold only tensors and plain values."""

import asyncio
import dataclasses
import errno
import fractions
import random
import re

import numpy as np
import pytest
import torch

from streamer import checkpoint
from streamer.batching import Batcher
from streamer.offsets import OffsetTracker
from streamer.models import LSTMLanguageModel
from streamer.step import prequential_step
from streamer.strategies import STRATEGIES
from tests.helpers import TINY, small_stream
from tests.test_loop import MemorySource

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


def test_a_checkpoint_cut_short_or_another_file_is_one_line_naming_it(tmp_path):
    """A checkpoint cut short (a copy interrupted, a full disk outside save's atomic rename), empty, or
    another file: a CheckpointError saying so, which `learn` shows in one line with --fresh (before: an
    EOFError's traceback for an empty file, "[Errno 22] Invalid argument" or a miniz error otherwise,
    and a text file "holds Python objects")."""
    whole = tmp_path / "whole.pt"
    checkpoint.save(whole, {"step": 3, "weights": torch.arange(1000.0)})
    data = whole.read_bytes()
    files = {"cut": data[: len(data) // 2], "head": data[:300], "empty": b"", "text": b"garbage\n"}
    for name, content in files.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(content)
        with pytest.raises(checkpoint.CheckpointError, match=f"{path} is not a streamer checkpoint "
                                                             f"\\({len(content):,} bytes, not a torch.save archive"):
            checkpoint.load(path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"")
    from streamer.resume import resume_state
    with pytest.raises(ValueError, match="cannot resume from .* not a streamer checkpoint .* use --fresh"):
        resume_state(run_dir, {})


def test_a_checkpoint_with_a_flipped_byte_in_its_weights_is_refused_naming_the_damaged_part(tmp_path):
    """torch.load checks no CRC: a byte flipped in the weights (a disk or copy error) loaded as NaN, the
    learner skipped every later update and exited 0. The archive's CRC-32 of each part is checked."""
    path = tmp_path / "checkpoint.pt"
    weights = torch.arange(1000.0)
    checkpoint.save(path, {"step": 3, "weights": weights})
    data = bytearray(path.read_bytes())
    at = bytes(data).index(weights.numpy().tobytes()) + 2000
    data[at:at + 8] = b"\xff" * 8  # four floats become NaN
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=f"{path} is damaged: its part \\S*data/\\d+ fails its "
                                                         "CRC-32 check"):
        checkpoint.load(path)
    from streamer.resume import resume_state
    with pytest.raises(ValueError, match="cannot resume from .* is damaged: .* use --fresh"):
        resume_state(tmp_path, {})


def test_a_run_is_not_resumed_on_another_streams_manifest(tmp_path):
    """A second production on the topic writes its manifest over the first's; the restart took it, wrote
    the other stream's length into the run and stopped at once with end_of_stream 'batch 500/324'."""
    from streamer.config import LearnConfig
    from streamer.resume import resume_state

    stream = {"total_batches": 3636, "total_records": 11493, "n_fragments": 20, "classes": ["cs", "en"]}
    config = LearnConfig("127.0.0.1:9092", "t", run_dir=tmp_path, run_name="r").with_manifest(stream)
    checkpoint.save(tmp_path / "checkpoint.pt", {"step": 500, "config": checkpoint.plain(config)})
    assert resume_state(tmp_path, config)["step"] == 500
    assert resume_state(tmp_path, config.with_manifest(None))["step"] == 500  # no manifest now: the topic's
    other = config.with_manifest({**stream, "total_batches": 324, "n_fragments": 10})
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'checkpoint.pt'} learned another stream than the "
                                                   "manifest describes (total_batches 3636 -> 324, n_fragments 20 -> "
                                                   f"10); give the run's manifest (a copy: {tmp_path / 'manifest.json'}"
                                                   "), or --fresh to start over")):
        resume_state(tmp_path, other)


def test_a_strategy_option_restated_at_its_default_is_the_same_run(tmp_path):
    """A replay run started without --set, resumed with --set p_write=0.1 (its default), was refused as a
    run of another configuration (strategy_options [] -> [['p_write', 0.1]]); another value still is."""
    from streamer.config import LearnConfig
    from streamer.resume import differing_keys

    run = LearnConfig("127.0.0.1:9092", "t", run_dir=tmp_path, strategy="replay")
    saved = checkpoint.plain(run)
    assert differing_keys(saved, dataclasses.replace(run, strategy_options=(("p_write", 0.1),))) == []
    assert differing_keys(saved, dataclasses.replace(run, strategy_options=(("p_write", 0.2),))) == [
        "strategy_options"]
    assert differing_keys(saved, dataclasses.replace(run, strategy="naive")) == ["strategy"]
    seeded = dataclasses.replace(run, seed=3)  # a strategy's seed not given is the run's, not its constructor's 0
    assert differing_keys(checkpoint.plain(seeded), dataclasses.replace(seeded, strategy_options=(("seed", 0),))) == [
        "strategy_options"]
    assert differing_keys(checkpoint.plain(seeded), dataclasses.replace(seeded, strategy_options=(("seed", 3),))) == []
    assert differing_keys(checkpoint.plain(seeded), dataclasses.replace(run, seed=7)) == []  # --seed: the run's kept


def test_a_checkpoint_continues_only_its_own_stream_model_and_learning_rate(tmp_path):
    """Only strategy and its options were checked: IDENTITY_KEYS cut to those two passed the suite, so a
    restart with another --window, --streams, --lr, --hidden or --topic would have loaded the checkpoint."""
    from streamer.config import LearnConfig
    from streamer.models import LSTMConfig
    from streamer.resume import differing_keys, resume_state

    run = LearnConfig("127.0.0.1:9092", "t", run_dir=tmp_path, lr=1e-3)
    saved = checkpoint.plain(run)
    changes = {"topic": "other", "model_name": "word", "model": LSTMConfig(hidden=7), "model_options": (("x", 1),),
               "lr": 2e-3, "clip": 0.5, "streams": run.streams + 1, "window": run.window + 1}
    for key, value in changes.items():
        assert differing_keys(saved, dataclasses.replace(run, **{key: value})) == [key]
    assert differing_keys(saved, dataclasses.replace(run, seed=run.seed + 1, run_name="again")) == []
    checkpoint.save(tmp_path / "checkpoint.pt", {"step": 5, "config": saved})
    with pytest.raises(ValueError, match=r"another configuration \(window 20 -> 21\); use --fresh"):
        resume_state(tmp_path, dataclasses.replace(run, window=21))


class _DiskFull:
    """Refused midway through a checkpoint's write, as a full disk refuses it."""

    def __reduce__(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_save_is_atomic_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "run" / "checkpoint.pt"
    checkpoint.save(path, {"step": 1})
    checkpoint.save(path, {"step": 2, "weights": torch.arange(3)})
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    loaded = checkpoint.load(path)
    assert loaded["step"] == 2 and loaded["format_version"] == checkpoint.FORMAT_VERSION
    assert torch.equal(loaded["weights"], torch.arange(3))
    # a write that fails midway leaves the previous checkpoint whole (written in place, it was cut or gone:
    # the lines above passed with save writing straight to checkpoint.pt)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.save(path, {"step": 3, "weights": torch.arange(100_000.0), "late": _DiskFull()})
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    assert checkpoint.load(path)["step"] == 2


def test_an_empty_carry_over_buffer_loads(tmp_path):
    """pickle writes b"" as a call of `bytes` (not as data): a checkpoint taken when a row's buffer is
    empty (at a revoke before any record, or a batch that used up a row exactly) must still load."""
    checkpoint.save(tmp_path / "checkpoint.pt", {"loop": {"batcher": {"buffers": [{"data": b""}, {"data": b"ab"}]}}})
    assert checkpoint.load(tmp_path / "checkpoint.pt")["loop"]["batcher"]["buffers"] == [{"data": b""}, {"data": b"ab"}]


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


class CheckedSource(MemorySource):
    """tests.test_loop's MemorySource whose commit first reads checkpoint.pt: Kafka is never told an
    offset the checkpoint on disk does not hold. Each commit notes (the checkpoint's step, results the
    consumer had taken in by then, whether on_revoke itself committed)."""

    def __init__(self, records, path, observed):
        super().__init__(records)
        self.path, self.observed, self.commits, self.revoker = path, observed, [], None

    async def commit(self, offsets):
        saved = checkpoint.load(self.path)
        assert saved["loop"]["offsets"] == offsets
        self.commits.append((saved["step"], self.observed(), asyncio.current_task() is self.revoker))
        self.committed = dict(offsets)
        return True


def learn_with_checkpoints(records, run_dir, every_s, revoke=False):
    """The learner's consumer of loop results with a Checkpointer (periodic writes started between two
    results, one at the end); with `revoke`, a task beside it calls on_revoke over and over, as a
    rebalance listener would. Returns (results, source, checkpointer, a snapshot taken at result 5,
    the model's weights then)."""
    from monitor.live import LiveMonitor
    from streamer.config import LearnConfig
    from streamer.checkpointer import Checkpointer
    from streamer.loop import PrequentialLoop
    from tests.helpers import naive

    async def go():
        results, done = [], asyncio.Event()
        source = CheckedSource(records, run_dir / "checkpoint.pt", lambda: len(results))
        loop = PrequentialLoop(naive(), Batcher(2, 10), source, total_records=len(records), queue_size=4)
        monitor = LiveMonitor(run="r", strategy="naive")
        checkpointer = Checkpointer(run_dir / "checkpoint.pt", every_s, config=LearnConfig("b:9092", "t", run_dir),
                                    loop=loop, monitor=monitor)

        async def revoking():
            while not done.is_set():
                await checkpointer.on_revoke()
                await asyncio.sleep(0.02)

        async with loop:
            if revoke:
                source.revoker = asyncio.create_task(revoking())
            async for result in loop:
                monitor.observe(result)
                results.append(result)
                if result.index == 5:
                    snapshot = checkpointer.state()
                    weights = {k: v.clone() for k, v in loop.strategy.model.state_dict().items()}
                if checkpointer.due():
                    checkpointer.start()
                    assert checkpointer.writing  # steps go on while it is written
            done.set()
            if source.revoker is not None:
                await asyncio.wait_for(source.revoker, 60)  # a hang guard, not a timing
            await checkpointer.write()
        return results, source, checkpointer, snapshot, weights
    return asyncio.run(go())


@pytest.fixture(scope="module")
def loop_stream():
    """(records, the losses of a plain in-memory run over them)."""
    from streamer.step import run
    from tests.helpers import batches_from_records, naive
    from tests.test_loop import CORPUS as LOOP_CORPUS

    records = small_stream(LOOP_CORPUS, fragments=3, mean_tokens=200, streams=2, window=10, seed=1)[0]
    return records, [r.loss for r in run(naive(), batches_from_records(records, 2, 10))]


def test_background_checkpoints_commit_only_what_is_on_disk_and_leave_the_losses_alone(loop_stream, tmp_path):
    records, expected = loop_stream
    results, source, checkpointer, snapshot, weights = learn_with_checkpoints(records, tmp_path, every_s=0.0)
    assert [r.loss for r in results] == expected
    assert len(source.commits) > 2 and source.commits[-1][0] == len(results)  # the last one: the end
    assert [step for step, _, _ in source.commits] == sorted(step for step, _, _ in source.commits)
    assert not checkpointer.writing and checkpointer.last_written is not None
    assert checkpointer.copy_s > 0 and checkpointer.write_s > 0
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    assert saved["step"] == len(results) and saved["loop"]["offsets"] == source.committed
    # the copy taken at result 5 is that moment's, though the model learned on after it
    assert snapshot["step"] == 6 and all(torch.equal(snapshot["model"][k], v) for k, v in weights.items())
    assert any(not torch.equal(snapshot["model"][k], v) for k, v in saved["model"].items())


def test_on_revoke_checkpoints_and_commits_at_a_snapshot_point(loop_stream, tmp_path):
    """on_revoke called at any moment, beside the periodic background writes, writes the state of
    exactly the results the consumer has taken in (never mid-step, never between a step and its
    consumer), then commits; nothing deadlocks and the losses stay those of a plain run."""
    records, expected = loop_stream
    results, source, _, _, _ = learn_with_checkpoints(records, tmp_path, every_s=0.0, revoke=True)
    assert [r.loss for r in results] == expected
    revoked = [(step, observed) for step, observed, by_revoke in source.commits if by_revoke]
    assert len({step for step, _ in revoked}) > 2  # revokes fell all along the stream
    assert all(step == observed for step, observed in revoked)


def test_on_device_moves_a_strategys_tensors_but_leaves_generator_states_on_the_cpu():
    """A checkpoint loads on the CPU; a run on a GPU moves the strategy's carried state, memories and
    penalties to its device, and keeps the generators' uint8 states where torch takes them."""
    from collections import OrderedDict

    generator = torch.Generator().get_state()
    model = LSTMLanguageModel(TINY).state_dict()
    state = {"model": model, "hidden": (torch.zeros(2, 3), torch.ones(2, 3)),
             "memory": {"inputs": torch.arange(6).view(2, 3)}, "fisher": {"w": torch.full((2,), 0.5)},
             "write_generator": generator, "rows_learned": 7, "found_at": [3, 9], "kind": "poe", "keys": None}
    saved = checkpoint.from_bytes(checkpoint.to_bytes(state))  # as a checkpoint loads it
    assert type(saved["model"]) is OrderedDict and type(saved["fisher"]) is dict
    moved = checkpoint.on_device(saved, torch.device("meta"))
    assert [t.device.type for t in moved["hidden"]] == ["meta", "meta"] and isinstance(moved["hidden"], tuple)
    assert moved["memory"]["inputs"].device.type == "meta" and moved["memory"]["inputs"].dtype == torch.int64
    assert moved["fisher"]["w"].device.type == "meta"
    assert moved["model"] is saved["model"]  # load_state_dict copies it into the parameters, wherever they are
    assert moved["write_generator"].device.type == "cpu"  # uint8: torch.Generator.set_state needs it there
    assert {k: moved[k] for k in ("rows_learned", "found_at", "kind", "keys")} == {
        "rows_learned": 7, "found_at": [3, 9], "kind": "poe", "keys": None}
    assert saved["hidden"][0].device.type == "cpu"  # the loaded state itself is left as it was


def test_a_run_that_fails_while_its_checkpoint_write_fails_reports_only_its_own_error(loop_stream, tmp_path, caplog):
    """A step fails while the background write started before it has failed too (a dead peer breaks the
    step's collectives and the checkpoint's gather; a full disk, then a bad step): the run ends with the
    step's error, and asyncio does not log the write's later as 'Task exception was never retrieved',
    traceback and all, once the run is over (a rank's console in CI had it)."""
    import gc
    import time

    from monitor.live import LiveMonitor
    from streamer.checkpointer import Checkpointer
    from streamer.config import LearnConfig
    from streamer.result_consumers import consume_results
    from streamer.loop import PrequentialLoop
    from tests.helpers import naive
    from tests.test_loop import MemorySource

    strategy, learned = naive(), []
    learn = strategy.learn

    def learn_then_fail(batch):
        learned.append(batch)
        if len(learned) == 2:
            time.sleep(0.5)  # the write started after result 1 has failed by then
            raise RuntimeError("the step's own error")
        return learn(batch)

    strategy.learn = learn_then_fail

    class Quiet:
        def update(self, *_args, **_kw):
            pass

    records = loop_stream[0]
    (tmp_path / "checkpoint.pt").mkdir()  # the write's rename onto it fails
    (tmp_path / "checkpoint.pt" / "in-the-way").touch()

    async def go():
        loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records), total_records=len(records))
        monitor = LiveMonitor(run="r", strategy="naive")
        checkpointer = Checkpointer(tmp_path / "checkpoint.pt", 0.0, config=LearnConfig("b:9092", "t", tmp_path),
                                    loop=loop, monitor=monitor)
        await consume_results(loop, monitor, checkpointer, None, None, Quiet(), final_probe=False)

    with caplog.at_level("ERROR", logger="asyncio"), pytest.raises(RuntimeError, match="the step's own error"):
        asyncio.run(go())
    gc.collect()  # an unretrieved task's exception is logged when the task is collected
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]


def test_the_last_checkpoint_counts_the_dead_letter_copies_that_were_in_flight(loop_stream, tmp_path):
    """The learner's results consumer ends the fetch side and settles the source's dead-letter copies in
    flight (delivered, or counted as failed: KafkaSource.settle_dead_letters) before its last checkpoint,
    so the checkpoint holds every copy sent; they failed at the source's stop, after it. A stream whose
    records after the first batches are all bad, stopped at 2 batches: the fetch side went on sending
    copies while the consumer settled and checkpointed (34 after the settle began, helper-119)."""
    from monitor.live import LiveMonitor
    from streamer.checkpointer import Checkpointer
    from streamer.config import LearnConfig
    from streamer.loop import PrequentialLoop
    from streamer.result_consumers import consume_results
    from tests.helpers import naive
    from tests.test_loop import MemorySource

    class InFlight(MemorySource):  # every copy is in flight at the end, and settle counts it as failed
        dead_letter_failures, settled, sent_after = 0, False, 0

        async def send_dead_letter(self, fetched, reason, detail):
            await super().send_dead_letter(fetched, reason, detail)
            self.sent_after += self.settled

        async def settle_dead_letters(self):
            await asyncio.sleep(0.2)  # (the broker's answer): the fetch side would have read on meanwhile
            self.dead_letter_failures, self.settled = len(self.dead), True

    class Quiet:
        def update(self, *_args, **_kw):
            pass

    records = loop_stream[0] * 100  # (only the first 12 are read as records)
    source = InFlight(records, bad=range(12, len(records)), chunk=3)

    async def go():
        loop = PrequentialLoop(naive(), Batcher(2, 10), source, total_records=len(records), max_batches=2)
        monitor = LiveMonitor(run="r", strategy="naive")
        checkpointer = Checkpointer(tmp_path / "checkpoint.pt", 60.0, config=LearnConfig("b:9092", "t", tmp_path),
                                    loop=loop, monitor=monitor)
        await consume_results(loop, monitor, checkpointer, None, None, Quiet(), final_probe=False)

    asyncio.run(go())
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    assert source.dead and source.sent_after == 0
    assert saved["loop"]["dead_letters"] == {"bad_utf8": len(source.dead), "dead_letter_failed": len(source.dead)}


def test_a_checkpoint_of_a_later_format_is_refused_and_one_of_format_1_loads(tmp_path):
    """A streamer refuses a checkpoint written in a format it does not know (it read format 2's offsets,
    dicts, as format 1's lists, with no error, and read on from nonsense), and still reads format 1's."""
    path = tmp_path / "c.pt"
    torch.save({"format_version": checkpoint.FORMAT_VERSION + 1, "step": 3}, path)
    with pytest.raises(checkpoint.CheckpointError, match=f"format version {checkpoint.FORMAT_VERSION + 1}; "
                                                         f"this streamer reads up to {checkpoint.FORMAT_VERSION}"):
        checkpoint.load(path)
    offsets = [[["t", 0], [5], [], 6]]  # format 1: a list a partition (streamer.offsets._from_list)
    torch.save({"format_version": 1, "step": 3, "loop": {"batcher": {"offsets": offsets}}}, path)
    tracker = OffsetTracker()
    tracker.load_state_dict(checkpoint.load(path)["loop"]["batcher"]["offsets"])
    assert checkpoint.FORMAT_VERSION == 2 and tracker.commit_positions() == {("t", 0): 5}


def test_the_checkpoint_views_read_what_an_old_or_partial_checkpoint_holds():
    """CheckpointView is how every reader takes a checkpoint's parts: a config of None (or none) reads as {}, a run
    of one process has world size 1 and its own part at the top level, a distributed one each rank's."""
    assert checkpoint.CheckpointView({"config": None, "step": 3}).config == {}
    assert checkpoint.CheckpointView({"step": 3}).config == {}
    one = checkpoint.CheckpointView({"step": 3, "strategy": {"s": 1}, "loop": {}, "rng": {}})
    assert one.world_size == 1 and one.part().strategy == {"s": 1} and one.tracker is None
    ranks = checkpoint.CheckpointView({"step": 3, "world_size": 2, "ranks": [{"strategy": 0}, {"strategy": 1}]})
    assert ranks.world_size == 2 and ranks.part(1).strategy == 1


def test_a_snapshot_copy_keeps_views_of_one_memory_apart_by_shape_and_is_independent_of_the_run():
    """copied() writes two names of one tensor once, but a view of the same memory with another shape (a
    flattened weight, a row of it) is its own tensor, with its own shape and values; lists and tuples are
    rebuilt, so what the run changes after the snapshot (in place, or a list it appends to) is not in it."""
    weight = torch.arange(6.0).reshape(2, 3)
    memory = [torch.ones(2)]
    state = {"model": {"w": weight}, "strategy": {"w": weight, "flat": weight.view(-1), "row": weight[1]},
             "memory": memory, "pair": (weight[0], 5)}
    copy = checkpoint.copied(state)
    assert copy["model"]["w"] is copy["strategy"]["w"]  # one tensor, written once
    assert copy["strategy"]["flat"].shape == (6,) and copy["strategy"]["flat"].tolist() == [0, 1, 2, 3, 4, 5]
    assert copy["strategy"]["row"].tolist() == [3, 4, 5] and copy["pair"][0].tolist() == [0, 1, 2]
    weight.add_(10)
    memory[0].add_(1)
    memory.append(torch.zeros(1))
    assert copy["model"]["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and copy["strategy"]["flat"][5] == 5
    assert len(copy["memory"]) == 1 and copy["memory"][0].tolist() == [1, 1] and copy["pair"][1] == 5


def test_a_checkpoint_names_the_next_offset_of_each_partition_its_loop_read():
    """The top-level offsets, {"topic:partition": next offset}, are what a resume says it reads on from."""
    state = checkpoint.run_checkpoint({"topic": "t"}, model={}, strategy={}, rng={}, step=4, tracker=None,
                                      loop={"offsets": {("t", 0): 5, ("t", 1): 7}})
    view = checkpoint.CheckpointView(state)
    assert view.offsets == {"t:0": 5, "t:1": 7} and view.step == 4 and view.world_size == 1
    assert view.part().loop_offsets == {("t", 0): 5, ("t", 1): 7}
