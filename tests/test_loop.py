"""streamer.loop fed from memory: the same results as the in-memory run, the stop conditions, dead
letters as plain state, probes' peek, and a snapshot that continues exactly."""

import asyncio
import json
import signal
import threading
import time
from collections import Counter
from unittest import mock

import pytest
import torch

from producers.wire import Record, Truth
from streamer import checkpoint
from streamer.batching import Batcher
from streamer.source import Fetched
from streamer.distributed import Agreement
from streamer import loop as loop_module
from streamer import step_worker
from streamer.loop import PrequentialLoop
from streamer.step import prequential_step, run
from tests.helpers import batches_from_records, naive, small_stream

CORPUS = {"en": "hello world, how are you " * 300, "fr": "bonjour le monde, ça va " * 300}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class MemorySource:
    """KafkaSource's interface over a list: one partition, `chunk` records per fetch (at most the fetch's
    `max_records`), from offset `start` (each saying the fetch's last offset, as KafkaSource's do, unless not
    `says_last`); `reads` counts the times each offset was fetched."""

    def __init__(self, records, *, start=0, chunk=7, bad=(), says_last=True):
        self.records, self.position, self.chunk, self.bad = records, start, chunk, set(bad)
        self.committed, self.dead, self.reads = None, [], Counter()
        self.says_last = says_last
        self.caps = []  # each fetch's max_records

    async def start(self):
        pass

    async def stop(self):
        pass

    async def fetch(self, max_records=None):
        self.caps.append(max_records)
        await asyncio.sleep(0.001)
        start = self.position
        size = self.chunk if max_records is None else min(self.chunk, max_records)
        end = self.position = min(len(self.records), start + size)  # as Kafka's: past the whole fetch
        last = end - 1 if self.says_last else None
        for offset in range(start, end):
            self.reads[offset] += 1
            if offset in self.bad:
                yield Fetched(None, ("t", 0), offset, "bad_utf8", last=last)
            else:
                yield Fetched(self.records[offset], ("t", 0), offset, last=last)

    def seek(self, tp, offset):
        self.position = offset

    async def send_dead_letter(self, fetched, reason, detail):
        self.dead.append(reason)

    async def commit(self, offsets):
        self.committed = dict(offsets)

    async def lag(self, taken=None, read=None):
        return {0: len(self.records) - max((taken or {}).get(("t", 0), self.position), (read or {}).get(("t", 0), 0))}


@pytest.fixture(scope="module")
def stream():
    return small_stream(CORPUS, fragments=4, mean_tokens=300, streams=2, window=10, seed=1)


def learn(loop, *, peek=False):
    async def go():
        results, peeked = [], []
        async with loop:
            async for result in loop:
                results.append(result)
                if peek and (upcoming := await loop.peek()) is not None:
                    peeked.append(upcoming.truth)
        return results, peeked
    return asyncio.run(go())


def test_the_loop_gives_the_in_memory_runs_results_and_stops_at_the_streams_end(stream):
    records, manifest = stream
    expected = list(run(naive(), batches_from_records(records, 2, 10)))
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), total_records=len(records), queue_size=2)
    results, peeked = learn(loop, peek=True)
    assert [r.loss for r in results] == [r.loss for r in expected]
    assert [r.index for r in results] == list(range(len(expected)))
    assert loop.stop_reason == "end_of_stream" and loop.step == len(results) == manifest["total_batches"]
    assert loop.intake.records == len(records) and loop.tokens == sum(r.tokens for r in results)
    assert peeked == [r.truth for r in expected[1:]]  # the next batch's truth, before it is learned


def test_stop_conditions_and_dead_letters_are_plain_state(stream):
    records, _ = stream
    source = MemorySource([records[0], Record("7", "a third stream"), *records[1:]], bad={3})
    loop = PrequentialLoop(naive(), Batcher(2, 10), source, max_batches=5)
    results, _ = learn(loop)
    assert len(results) == 5 and loop.stop_reason == "max_batches"
    assert dict(loop.intake.dead_letters) == {"extra_stream": 1, "bad_utf8": 1}
    assert source.dead == ["extra_stream", "bad_utf8"]

    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records[:10]), idle_timeout_s=0.3)
    results, _ = learn(loop)
    assert loop.stop_reason == "idle" and loop.step == len(results)


def test_dead_letters_do_not_hold_back_the_offsets_to_commit(stream):
    """A dead letter is taken and learned at once: one never finished kept commit_positions at its offset for
    the run's life (Kafka's committed offset stuck at the first bad record), and no test read them past one."""
    records, _ = stream
    source = MemorySource([records[0], Record("7", "a third stream"), *records[1:]], bad={3})
    loop = PrequentialLoop(naive(), Batcher(2, 10), source, idle_timeout_s=0.3)
    learn(loop)
    assert loop.stop_reason == "idle" and dict(loop.intake.dead_letters) == {"extra_stream": 1, "bad_utf8": 1}
    read, commit = loop.batcher.offsets.next_positions()[("t", 0)], loop.batcher.offsets.commit_positions()[("t", 0)]
    assert read == len(source.records) and read - commit < 2 * 10  # only a part batch's records wait in the batcher


def test_a_limit_set_on_the_loop_after_its_construction_is_refused_not_silently_ignored(stream):
    """The loop's limits live in the rooms its constructor builds: `loop.max_batches = 3` would make an attribute
    nothing reads and the run would go on to its end. Every keyword of the constructor is either still read on the
    loop (an attribute or a property) or refused when set."""
    import inspect
    records, _ = stream
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), total_records=len(records))
    with pytest.raises(AttributeError, match="max_batches is set only by its constructor"):
        loop.max_batches = 3
    assert not hasattr(loop, "max_batches")
    keywords = [name for name, parameter in inspect.signature(PrequentialLoop).parameters.items()
                if parameter.kind is parameter.KEYWORD_ONLY]
    for name in keywords:
        if name in PrequentialLoop._CONSTRUCTOR_ONLY:
            with pytest.raises(AttributeError):
                setattr(loop, name, 1)
        else:
            assert hasattr(loop, name), f"{name}: neither kept on the loop nor refused when set"
    loop.step = 7  # its plain state is still set as before
    assert loop.step == 7


def test_the_ranks_agreement_pace_set_on_the_loop_is_refused(stream):
    """`agree_every_s` is the RankAgreement's, set by the loop's constructor: a copy kept on the loop was read by
    nothing, so `loop.agree_every_s = 1` changed no agreement's pace."""
    records, _ = stream
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records))
    with pytest.raises(AttributeError, match="agree_every_s is set only by its constructor"):
        loop.agree_every_s = 1.0


def test_a_fact_a_room_keeps_set_on_the_loop_is_refused_not_silently_unread(stream):
    """The records read, the dead letters, the run-ahead's snapshot_wanted ... are kept by the loop's rooms and
    read there (loop.intake.records); set on the loop they would make an attribute nothing reads."""
    records, _ = stream
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records))
    for name in ("records", "waiting_since", "busy_s", "broker_lost_since", "snapshot_wanted"):
        with pytest.raises(AttributeError, match=f"{name} is kept by its rooms"):
            setattr(loop, name, 1)
    loop.intake.records = 3
    assert loop.intake.records == 3 and not hasattr(loop, "records")


def test_streams_that_never_sent_a_record_are_said_once_when_the_learning_waits_for_them(stream):
    """A producer of its own keyed every record "0" for a learner of 2 streams: the learner read them all,
    learned nothing and showed only "caught up, waiting for records". It says which streams never sent."""
    records, _ = stream
    only_0 = [r for r in records if r.stream == "0"]
    said = []
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(only_0), idle_timeout_s=1.5, hold_quiet_s=0.2,
                           lag_every_s=0.05, log=said.append)
    results, _ = learn(loop)
    assert results == [] and loop.stop_reason == "idle" and loop.intake.records == len(only_0)
    assert [line for line in said if "sent no record" in line] == [
        "the next batch waits for stream 1, which sent no record since the start: a batch takes a window of each "
        "of the streams 0 to 1 (--streams), so a producer of fewer streams needs --streams that many (said once)"]

    said = []  # both streams send: nothing to say
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), idle_timeout_s=1.0, hold_quiet_s=0.2,
                           lag_every_s=0.05, log=said.append)
    results, _ = learn(loop)
    assert results and not [line for line in said if "sent no record" in line]


def test_a_backlog_read_past_before_the_quiet_names_the_stream_it_waits_for():
    """A restart over a backlog: stream 0's records end early, stream 1's go on, and nothing arrives after
    they are read. Stream 1's surplus is read past (left in Kafka) within hold_quiet_s of the last cut, so
    no record came after the quiet began: no stream was named, while the lag counted the surplus, and
    StreamerLearnerStalled said the consumer was stuck. The records left in Kafka show the others go on."""
    records = [Record("0", "abcdefghijk"), Record("1", "abcdefghijk")] * 5 + [Record("1", "abcdefghijk")] * 400
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records, chunk=50), keep_windows=4, ahead_windows=2,
                           hold_quiet_s=1.0, max_seconds=3)
    learn(loop)
    assert loop.batcher.offsets.unread > 300 and loop.intake.lag == {0: len(records) - loop.intake.records}
    assert loop.intake.waiting_for == (0,) and loop.intake.waiting_since is not None


def test_a_stop_while_a_dead_letter_is_being_sent_leaves_the_record_to_read_again():
    """A stop cancels the fetch side while a dead-letter copy is being sent (the producer waits for the
    .dlq topic's metadata, or for room while the broker is away): the record counted as taken and the
    checkpoint's offsets passed it, so its copy was never sent nor counted and it was never read again.
    It counts as taken only once sent: the checkpoint reads it again."""

    class SlowDeadLetters(MemorySource):
        async def send_dead_letter(self, fetched, reason, detail):
            await asyncio.sleep(5)
            await super().send_dead_letter(fetched, reason, detail)

    records = [Record("0", "abcdefghijklmnop"), Record("1", "abcdefghijklmnop")] * 3
    source = SlowDeadLetters(records, bad={2})
    loop = PrequentialLoop(naive(), Batcher(2, 10), source)

    async def go():
        async with loop:
            await asyncio.sleep(0.5)
            loop.stop("signal")
        return loop.state_dict()
    state = asyncio.run(go())
    assert source.dead == [] and dict(loop.intake.dead_letters) == {} and loop.intake.records == 2
    assert state["offsets"] == {("t", 0): 2}  # (it said 3: past the bad record)


def test_a_snapshot_between_two_results_continues_exactly(stream, tmp_path):
    """State, carry-over (partial windows and batches cut but not learned) and offsets after batch t."""
    records, _ = stream
    whole, _ = learn(PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), total_records=len(records)))

    async def first_part():
        loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), queue_size=4)
        async with loop:
            async for result in loop:
                if result.index == 11:
                    await asyncio.sleep(0.05)  # let the fetch side run ahead: batches wait in the queue
                    saved = {"strategy": loop.strategy.state_dict(), "loop": loop.state_dict()}
                    checkpoint.save(tmp_path / "checkpoint.pt", saved)
                    await loop.commit(saved["loop"]["offsets"])
                    return loop.source.committed, loop.queue_depth
    committed, waiting = asyncio.run(first_part())
    assert waiting > 0 and committed[("t", 0)] > 0

    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    strategy = naive(seed=5)
    strategy.load_state_dict(saved["strategy"])
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, start=committed[("t", 0)]),
                           total_records=len(records))
    loop.load_state_dict(saved["loop"])
    rest, _ = learn(loop)
    assert [r.index for r in rest] == list(range(12, len(whole)))
    assert [r.loss for r in rest] == [r.loss for r in whole[12:]]
    assert torch.equal(torch.tensor([r.tokens for r in rest]), torch.tensor([r.tokens for r in whole[12:]]))


def test_stop_ends_the_loop_after_the_step_in_flight_and_dead_letters_survive_a_snapshot(stream):
    records, _ = stream
    source = MemorySource([records[0], Record("7", "a third stream"), *records[1:]], bad={3})
    loop = PrequentialLoop(naive(), Batcher(2, 10), source)

    async def go():
        results = []
        async with loop:
            async for result in loop:
                results.append(result)
                if result.index == 4:
                    loop.stop()  # what the SIGTERM handler calls, on the event loop
        return results
    results = asyncio.run(go())
    assert len(results) == 5 and loop.stop_reason == "signal"
    saved = loop.state_dict()
    again = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records))
    again.load_state_dict(saved)
    assert again.intake.dead_letters == loop.intake.dead_letters and again.step == 5


def test_dead_letter_sends_that_failed_keep_counting_after_a_resume(stream):
    """The source counts the sends that failed since it started; the loop adds those before the resume."""
    records, _ = stream
    first = MemorySource(records)
    first.dead_letter_failures = 3
    loop = PrequentialLoop(naive(), Batcher(2, 10), first, max_batches=2)
    learn(loop)
    assert loop.intake.dead_letters["dead_letter_failed"] == 3
    second = MemorySource(records, start=loop.state_dict()["offsets"][("t", 0)])
    second.dead_letter_failures = 2
    again = PrequentialLoop(naive(), Batcher(2, 10), second, max_batches=4)
    again.load_state_dict(loop.state_dict())
    learn(again)
    assert again.intake.dead_letters["dead_letter_failed"] == 5


class LosingProbe(MemorySource):
    """A broker probe that loses the cancels landing in it, as Python 3.11's asyncio.wait_for does when its
    inner result arrives as the cancel lands (CPython gh-86296): the KafkaSource probe awaits one."""

    swallowing, lost = True, 0

    async def reachable(self):
        try:
            await asyncio.sleep(0.2)  # nearly all of the watch task's time is spent in here
        except asyncio.CancelledError:
            if not self.swallowing:
                raise
            self.lost += 1
        return True


def test_the_loop_ends_when_its_watch_task_loses_a_cancellation(stream):
    """A learner stopped at --max-batches with its broker watch in such a probe once waited for good
    ("stopping" for 14 minutes); leaving the loop must end its tasks all the same."""
    records, _ = stream
    source = LosingProbe(records)
    loop = PrequentialLoop(naive(), Batcher(2, 10), source, max_batches=3, probe_every_s=0.0001)

    async def learned():
        async with loop:
            async for _ in loop:
                pass

    async def go():
        running = asyncio.create_task(learned())
        done, _ = await asyncio.wait({running}, timeout=10)
        source.swallowing = False  # a failed test must not hang too
        if not done:
            running.cancel()
            await asyncio.wait({running}, timeout=5)
        return bool(done)
    assert asyncio.run(go()) and loop.stop_reason == "max_batches" and loop.step == 3
    assert source.lost >= 1  # the cancel did land in the probe and was lost there


def test_a_task_that_lost_its_cancellation_is_cancelled_again_and_said():
    """What the loop's exit (and its start, stopped by a signal) does with its tasks: a task that keeps
    losing the cancel is asked again until it ends, and a wait that long is said in one line."""
    from streamer.cancellation import tasks_ended

    said = []

    async def stubborn():
        for _ in range(3):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # lost, as Python 3.11's wait_for can lose one
        await asyncio.sleep(10)

    async def go():
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(tasks_ended([task], said.append, again_after_s=0.05, say_after_s=0.1), 5)
        return task
    assert asyncio.run(go()).cancelled()
    assert len(said) == 1 and "stubborn" in said[0] and "cancelling again" in said[0]


def counting(strategy):
    """The strategy, with a list that grows by one each time it learns a batch (in the worker thread)."""
    learned, learn = [], strategy.learn
    strategy.learn = lambda batch: (learned.append(batch), learn(batch))[1]
    return strategy, learned


async def until(condition, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("lands_in", ["the wait for the step", "the end of the fetch and watch tasks"])
def test_an_interrupt_as_the_loop_ends_is_raised_after_the_step_in_flight(stream, monkeypatch, lands_in):
    """The loop's end waits for the step in flight; an interrupt (here SIGUSR1 made one, to this main
    thread) that lands in that wait is raised once the step has ended. The wait was ThreadPoolExecutor's
    shutdown, a Thread.join: on Python 3.11 an interrupted join gives up on the thread for good, and the
    interpreter's exit with the step inside torch's C++ aborted ('terminate called ...'). One landing
    earlier, while the fetch and watch tasks end (here made to take 0.6 s), skipped that wait."""
    if lands_in != "the wait for the step":
        ended_tasks = loop_module.tasks_ended

        async def slow_to_end(*args, **kwargs):
            await asyncio.sleep(0.6)
            await ended_tasks(*args, **kwargs)
        monkeypatch.setattr(loop_module, "tasks_ended", slow_to_end)
    records, _ = stream
    strategy, learned = counting(naive())
    in_flight, ended, learn = threading.Event(), threading.Event(), strategy.learn

    def slow_learn(batch):
        if len(learned) == 1:  # batch 1, running ahead while the consumer holds result 0, and leaves
            in_flight.set()
            time.sleep(1.0)
            ended.set()
        return learn(batch)
    strategy.learn = slow_learn
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), queue_size=64, burst=1)
    loop.run_ahead.snapshot_wanted = lambda index, upcoming, previous: False

    async def go():
        async with loop:
            async for result in loop:
                await until(in_flight.is_set)
                break

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    def interrupt_the_wait(main=threading.main_thread().ident):
        if in_flight.wait(10):  # (else no signal: one after the handler is put back would end pytest)
            time.sleep(0.3)  # the consumer has left: the loop's end waits for the step
            signal.pthread_kill(main, signal.SIGUSR1)
    timer = threading.Thread(target=interrupt_the_wait)
    before = signal.signal(signal.SIGUSR1, interrupt)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(go())
        interrupted_after_the_step = ended.is_set()
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, before)
    assert interrupted_after_the_step


def test_a_consumer_that_fails_with_work_queued_for_the_worker_ends_the_loop(stream):
    """The loop's end waits for what the worker runs, not for what it has queued and the stop cancelled:
    a consumer that fails with one submission running and another queued behind it (a probe's, a
    checkpoint's gather) ended the loop, then waited for good on the cancelled one."""
    records, _ = stream
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records, chunk=10_000), queue_size=64)
    done = []

    async def go():
        async with loop:
            running, queued = loop.submit(time.sleep, 0.5), loop.submit(done.append, "queued")
            await asyncio.sleep(0.1)
            raise RuntimeError("the consumer fails")
    finished = threading.Event()
    outcome = []
    thread = threading.Thread(target=lambda: (outcome.append(pytest.raises(RuntimeError, asyncio.run, go())),
                                              finished.set()), daemon=True)
    thread.start()
    assert finished.wait(30), "the loop's end waited for a cancelled submission"
    assert "the consumer fails" in str(outcome[0].value) and done == []  # the queued one never ran


def test_the_next_step_runs_ahead_of_the_consumer_unless_a_snapshot_is_wanted(stream):
    """With `snapshot_wanted` set (and no bursts), the worker learns batch k + 1 while the consumer still
    holds result k (never further ahead), the results are the in-memory run's, and a result whose next
    batch was wanted is a snapshot point: the strategy has learned exactly the batches taken in."""
    records, _ = stream
    batches = batches_from_records(records, 2, 10)
    expected = list(run(naive(), batches))
    wanted = {7, 8, 20}
    strategy, learned = counting(naive())
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), total_records=len(records),
                           queue_size=len(batches), burst=1)  # every batch queued before the first step
    asked = []
    loop.run_ahead.snapshot_wanted = lambda index, upcoming, previous: asked.append(index) or index in wanted

    async def go():
        results = []
        async with loop:
            async for result in loop:
                results.append(result)
                following = result.index + 1
                if following in wanted:
                    await asyncio.sleep(0.05)  # time enough for a step that wrongly ran ahead
                    assert loop.run_ahead.at_snapshot and len(learned) == following
                    reference = naive()
                    list(run(reference, batches[:following]))
                    for name, value in reference.model.state_dict().items():
                        assert torch.equal(value, loop.strategy.model.state_dict()[name]), name
                elif following < len(batches):
                    await until(lambda: len(learned) == following + 1)
                    await asyncio.sleep(0.02)
                    assert not loop.run_ahead.at_snapshot and len(learned) == following + 1
        return results
    results = asyncio.run(go())
    assert [r.loss for r in results] == [r.loss for r in expected]
    assert [r.index for r in results] == list(range(len(expected))) and loop.step == len(learned) == len(expected)
    assert sorted(asked) == list(range(1, len(expected)))  # asked once for every batch after the first


def test_a_snapshot_point_and_a_stop_wait_for_the_step_running_ahead(stream):
    """A rebalance's snapshot_point() gets the state after the last result taken in, with no step in
    flight; a stop learns and yields the step already running ahead, then ends (no bursts)."""
    records, _ = stream
    strategy, learned = counting(naive())
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), queue_size=64, burst=1)
    loop.run_ahead.snapshot_wanted = lambda index, upcoming, previous: False
    seen = []

    async def rebalance():
        async with loop.run_ahead.snapshot_point():
            seen.append((loop.run_ahead.at_snapshot, loop.step, len(learned)))

    async def go():
        results, grab = [], None
        async with loop:
            async for result in loop:
                results.append(result)
                await asyncio.sleep(0.005)
                if result.index == 5:
                    grab = asyncio.create_task(rebalance())
                if result.index == 12:
                    await until(lambda: len(learned) == 14)  # batch 13 learned ahead of its result
                    loop.stop()
            await grab
        return results
    results = asyncio.run(go())
    at_snapshot, step, learned_then = seen[0]
    assert len(seen) == 1 and at_snapshot and step == learned_then and 6 <= step <= 9  # at once, not at the end
    assert [r.index for r in results] == list(range(14)) and loop.stop_reason == "signal"
    assert loop.step == len(learned) == 14 and loop.state_dict()["step"] == 14


def test_short_steps_run_ahead_in_bursts_and_a_stop_puts_back_those_not_begun(stream):
    """While steps are short the worker runs up to `burst` batches behind the running step and wakes the
    event loop once per burst (and after the last one handed over), so the consumer takes several
    results at a wake-up; the results are still the in-memory run's, in order, and a wanted snapshot
    still finds exactly the batches taken in learned. A stop lets the running step finish; the steps
    queued behind it learn nothing and their batches are back at the front of the queue, in order."""
    records, _ = stream
    batches = batches_from_records(records, 2, 10)
    expected = list(run(naive(), batches))
    strategy, learned = counting(naive())
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), total_records=len(records),
                           queue_size=len(batches), burst=4)
    wanted = {20}
    loop.run_ahead.snapshot_wanted = lambda index, upcoming, previous: index in wanted
    ahead, wakes = [], []
    wake = loop.worker._results.set
    loop.worker._results.set = lambda: (wakes.append(loop.step), wake())[1]

    async def go():
        results = []
        async with loop:
            async for result in loop:
                results.append(result)
                ahead.append(len(loop.worker.running))  # steps handed over, not yet taken in
                if result.index + 1 in wanted:
                    assert loop.run_ahead.at_snapshot and len(learned) == result.index + 1
                if result.index == 30:
                    await until(lambda: len(learned) >= 32)  # batch 31 done, more queued behind it
                    queued = [ready for ready, _ in loop.worker.running]
                    assert len(queued) >= 2
                    loop.stop()
        return results, queued
    results, queued = asyncio.run(go())
    assert [r.loss for r in results] == [r.loss for r in expected[:len(results)]]
    assert [r.index for r in results] == list(range(len(results)))
    assert max(ahead) == 4 and min(ahead[:20]) >= 0  # up to `burst` behind the one in flight
    assert len(wakes) < len(results) / 2  # a wake-up takes in several results
    # the stop: only the steps begun were learned; the rest are the queue's head again, in order
    assert loop.step == len(results) == len(learned) and loop.stop_reason == "signal"
    assert list(loop.intake.queue)[:len(queued) - (len(results) - 31)] == queued[len(results) - 31:]
    assert loop.state_dict()["step"] == len(results)


def paced_ahead(loop, pause_s: float):
    """Learn with every step stretched by `pause_s` in the worker (as test_spikes paces it) and nothing
    wanting a snapshot: (results, steps handed over and not yet taken in after each, wake-ups)."""
    loop.run_ahead.snapshot_wanted = lambda index, upcoming, previous: False
    ahead, wakes = [], []
    wake = loop.worker._results.set
    loop.worker._results.set = lambda: (wakes.append(loop.step), wake())[1]

    def paced_step(*args, **kwargs):
        time.sleep(pause_s)
        return prequential_step(*args, **kwargs)

    async def go():
        results = []
        async with loop:
            async for result in loop:
                results.append(result)
                ahead.append(len(loop.worker.running))
        return results
    with mock.patch("streamer.step_worker.prequential_step", paced_step):
        results = asyncio.run(go())
    return results, ahead, wakes


def test_a_slow_worker_step_takes_no_burst(stream):
    """A step that holds the worker for longer than half of `burst_span_s` (a slower device; here the step
    stretched in the worker, as test_spikes paces it) runs one ahead at most and wakes the event loop
    for every result, so each result's metrics are written as its step ends."""
    records, _ = stream
    strategy, learned = counting(naive())
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), queue_size=16,
                           max_batches=8, burst=4, burst_span_s=0.05)
    results, ahead, wakes = paced_ahead(loop, 0.03)
    assert [r.index for r in results] == list(range(8)) and max(ahead) <= 1 and len(wakes) == 8


def test_a_burst_holds_burst_span_s_of_steps_and_fast_steps_fill_burst(stream):
    """A burst is as many steps as `burst_span_s` holds at the last step's pace, at most `burst`: steps
    stretched to 30 ms in the worker with a 300 ms span go 10 ahead at most (fewer where a loaded host
    stretches them further) and wake the event loop about once per burst, with the in-memory run's
    results; short steps with a long span and the default `burst` and queue run 32 ahead."""
    records, _ = stream
    batches = batches_from_records(records, 2, 10)

    slow = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records, chunk=10_000), total_records=len(records),
                           burst=32, burst_span_s=0.3)
    results, ahead, wakes = paced_ahead(slow, 0.03)
    assert [r.loss for r in results] == [r.loss for r in run(naive(), batches)]
    # The span is ten paces: a loaded host's steps, stretched well past the pause (a 10 ms pace in a 65 ms
    # span once gave 43 wake-ups for 67 results in a full suite on 2 cores, its steps over 32 ms), still
    # make bursts of 2 or more up to 150 ms a step
    assert 2 <= max(ahead) <= 10 and len(wakes) < len(results) / 2
    fast = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records, chunk=10_000), total_records=len(records),
                           burst_span_s=5.0)  # 32 steps of up to 150 ms: a loaded machine's too
    results, ahead, _ = paced_ahead(fast, 0.001)
    assert len(results) > 40 and max(ahead) == 32


def test_a_full_queue_is_refilled_in_bursts_and_never_runs_dry(stream):
    """Backpressure with hysteresis: once the queue is full, the fetch side waits until the worker has
    taken it down to half (queue_size // 2) and then cuts the batches in one burst, instead of one
    batch a step (each wake-up found its Python cold in the caches the step had just used); the
    queue never runs dry while records are there, and the results are the in-memory run's."""
    records, _ = stream
    batches = batches_from_records(records, 2, 10)
    strategy = naive()
    learn = strategy.learn
    strategy.learn = lambda batch: (time.sleep(0.02), learn(batch))[1]  # a slow step: the source is always ahead
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), total_records=len(records),
                           queue_size=8)

    async def go():
        depths, results = [], []
        async with loop:
            async for result in loop:
                results.append(result)
                depths.append(loop.queue_depth)
                if len(results) == 40:
                    break
        return depths, results
    depths, results = asyncio.run(go())
    assert [r.loss for r in results] == [r.loss for r in run(naive(), batches[:40])]
    assert min(depths) >= 1  # never dry (the refill comes four 20 ms steps before the queue would be)
    assert sum(depth <= 5 for depth in depths) >= 10, depths  # drained to the mark between refills (was 7-8 always)


def test_a_hung_step_counts_as_a_batch_waiting_not_as_a_learner_that_caught_up(stream):
    """queue_depth (the exporter's streamer_queue_depth, which StreamerLearnerStalled reads beside the
    lag) counts the batches cut and not yet learned, the step in flight among them: a worker hung on
    the stream's last batch, after the source has given every record (lag 0) and nothing else is
    queued, shows 1, not the 0 of a learner that has caught up and waits; once learned, 0."""
    records, _ = stream
    total = len(batches_from_records(records, 2, 10))
    strategy, learned = counting(naive())
    learn, hanging, release = strategy.learn, threading.Event(), threading.Event()

    def learn_or_hang(batch):
        if len(learned) == total - 1:  # the stream's last batch: the worker hangs in its learn
            hanging.set()
            release.wait(30)
        return learn(batch)
    strategy.learn = learn_or_hang
    loop = PrequentialLoop(strategy, Batcher(2, 10), MemorySource(records, chunk=10_000), total_records=len(records))

    async def go():
        async with loop:
            async def hang_watch():
                await until(lambda: hanging.is_set() and loop.step == total - 1, timeout_s=30)
                await asyncio.sleep(0.05)
                seen = (loop.step, await loop.source.lag(), loop.queue_depth)
                release.set()
                return seen
            watching = asyncio.create_task(hang_watch())
            results = [result async for result in loop]
            return results, await watching
    results, (step, lag, depth) = asyncio.run(go())
    assert step == total - 1 and lag == {0: 0} and depth == 1
    assert len(results) == total and loop.stop_reason == "end_of_stream" and loop.queue_depth == 0


class PeerWithout:
    """Rank 0's side of a distributed learner's collectives (streamer.distributed.Ranks) where the other
    rank never has its next batch: nobody steps until a stop, which every rank then takes. Once `stuck`
    is set, the next agreement does not come back until `freed` is (the other rank stuck in a step).
    Its reports (gather_bytes) say REPORT: its own records, partition and dead letters."""

    REPORT = {"records": 7, "lag": {"3": 5}, "dead_letters": {"bad_key": 2, "unreadable": 1}, "read_again": 6,
              "waiting_for": [3]}
    rank = 0

    def __init__(self):
        self.stuck, self.freed = threading.Event(), threading.Event()
        self.reports = []  # what rank 0 sent

    def agree(self, has_batch, stop_reason, checkpoint, records=0, more=True, total_records=None, report=False,
              idle=False, votes=b"", waited=False):
        if self.stuck.is_set() and not self.freed.is_set():
            self.freed.wait(30)
        return Agreement(False, stop_reason, False, report)

    def gather_bytes(self, data):
        self.reports.append(json.loads(data))
        return [data, json.dumps(self.REPORT).encode()]

    def broadcast_bytes(self, data):
        return data


def test_a_ranks_batches_waiting_for_another_ranks_records_are_not_counted_as_waiting_for_the_model(stream):
    """Ranks step together: while the other rank has no batch of its own, this rank's queued batches
    cannot be learned, as one process cannot cut a batch while one of its streams has no records. The
    run waits for records, not for its model: queue_depth says 0 (StreamerLearnerStalled stays silent
    for a distributed run whose producer paused), though batches are queued, and the learner says it
    waits for records (waiting_for_records_since: rank 0's console says "waiting", not "consuming").
    Once the agreements stop coming (the other rank stuck), the queued batches count again (the alert
    fires) and the learner no longer waits for records; a stop ends it. Meanwhile rank 0 holds the other
    rank's records, lag, dead letters and records read again from its reports (across_ranks), asked for every
    lag_every_s and at the stop, whose report carries this rank's last records."""
    records, _ = stream
    peer = PeerWithout()
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records, bad=(2,)), ranks=peer, queue_size=4,
                           lag_every_s=0.3)

    async def go():
        async with loop:
            async def wait_then_stop():
                await until(lambda: loop.intake.records_batched >= 8 and loop.state_dict()["waiting"])  # a full queue
                await asyncio.sleep(1.0)  # a few agreements (every 0.2 s) and reports (every 0.3 s)
                waiting = (len(loop.state_dict()["waiting"]), loop.queue_depth, loop.waiting_for_records_since,
                           loop.across_ranks(), len(peer.reports), loop.streams_waited_for)
                peer.stuck.set()
                await asyncio.sleep(6)  # past the 5 s in which the last agreement's word holds
                stuck = (len(loop.state_dict()["waiting"]), loop.queue_depth, loop.waiting_for_records_since)
                freed_at = time.time()
                peer.freed.set()
                await asyncio.sleep(0.5)  # agreements again, the other rank still without its batch
                stuck += (loop.waiting_for_records_since - freed_at,)  # a wait anew, not the one before the hang
                loop.stop()
                return waiting, stuck
            stopping = asyncio.create_task(wait_then_stop())
            results = [result async for result in loop]
            return results, await stopping
    started = time.time()
    results, (waiting, stuck) = asyncio.run(go())
    (queued, depth, waiting_since, (all_records, lag, dead_letters, read_again), reports, streams), \
        (queued_stuck, depth_stuck, waiting_stuck, anew) = waiting, stuck
    assert results == [] and loop.stop_reason == "signal" and queued >= 4 and depth == 0
    assert started < waiting_since < time.time()
    assert all_records == loop.intake.records + 7 and lag == {0: len(records) - loop.intake.records_batched - 1, 3: 5}
    assert dead_letters == {"bad_utf8": 1, "bad_key": 2, "unreadable": 1} and read_again == 6
    assert reports >= 3  # the first agreement's, then every 0.3 s
    assert streams == (3,)  # the stream the other rank's next batch waits for, as it reported
    assert depth_stuck == queued_stuck >= 4 and waiting_stuck is None and 0 <= anew < 0.5
    assert peer.reports[-1] == {"records": loop.intake.records,
                                "lag": {"0": len(records) - loop.intake.records_batched - 1},
                                "dead_letters": {"bad_utf8": 1}, "read_again": 0, "waiting_for": []}  # the stop's


class RankOf2:
    """A rank's side of the start's broadcast (streamer.distributed.Ranks.broadcast_bytes): rank 0 having
    failed to start with `line` (None: it started); rank 0's own is what it sends."""

    world = 2

    def __init__(self, line: bytes | None, rank: int = 1):
        self.line, self.rank, self.leader, self.sent = line, rank, rank == 0, []

    def broadcast_bytes(self, data):
        self.sent.append(data)
        return data if self.leader else self.line


class StartsThenStops(MemorySource):
    """A MemorySource that says when it was started and stopped, or fails to start with `failure`."""

    def __init__(self, records, failure: Exception | None = None):
        super().__init__(records)
        self.failure, self.calls = failure, []

    async def start(self):
        self.calls.append("start")
        if self.failure is not None:
            raise self.failure

    async def stop(self):
        self.calls.append("stop")


def test_rank_0s_failure_to_start_ends_the_other_ranks_on_its_line(stream):
    """A refusal only rank 0 makes (another learner in the learner group, which only rank 0 joins) is
    every rank's: a rank that started stops its source and ends with SourceError, every_rank (it leaves the
    line to rank 0) rather than wait in its first agreement for a rank 0 that is gone (then its own line,
    'another rank is gone'). A rank's own failure stays its own, and rank 0's is what it sends; a start that
    went well on rank 0 too goes on."""
    from streamer.source import SourceError

    records, _ = stream
    line = b"group g on 127.0.0.1:9092 has another running learner: ..."

    async def enter(loop):
        async with loop:
            return True

    source, ranks = StartsThenStops(records), RankOf2(line)
    with pytest.raises(SourceError, match="has another running learner") as raised:
        asyncio.run(enter(PrequentialLoop(naive(), Batcher(2, 10), source, ranks=ranks)))
    assert raised.value.every_rank and source.calls == ["start", "stop"] and ranks.sent == [None]
    own = SourceError("cannot reach Kafka at 127.0.0.1:9092")
    for ranks, sent in ((RankOf2(line), None), (RankOf2(None, rank=0), str(own).encode())):
        source = StartsThenStops(records, own)
        with pytest.raises(SourceError) as raised:
            asyncio.run(enter(PrequentialLoop(naive(), Batcher(2, 10), source, ranks=ranks)))
        assert raised.value is own and ranks.sent == [sent]
    source, ranks = StartsThenStops(records), RankOf2(None)
    assert asyncio.run(enter(PrequentialLoop(naive(), Batcher(2, 10), source, ranks=ranks)))
    assert source.calls == ["start", "stop"] and ranks.sent == [None]


class LeaderOfTwo:
    """Rank 0's side of a checkpoint's gather (streamer.checkpoint.save_gathered) with a rank 1 whose part
    says it has read 99 records, one of them dead-lettered."""

    leader, rank, world = True, 0, 2

    def __init__(self):
        self.said = []  # what all_true was told

    def gather_bytes(self, data):
        part = {"loop": {"records": 99, "dead_letters": {"bad_key": 1}, "read_again": 11, "offsets": {}},
                "strategy": {}, "rng": {}}
        return [data, checkpoint.to_bytes(part)]

    def all_true(self, value):
        self.said.append(value)
        return value

    def broadcast_bytes(self, data):
        return data


def test_a_checkpoints_parts_give_rank_0_the_other_ranks_records_and_dead_letters(tmp_path):
    """The checkpoint after a stop holds what the other ranks read after the stop's report: rank 0 takes
    their records, dead letters and records read again from its parts (their lag stays that of the last
    report), before the write is awaited. After the loop has closed, the gather still ends with every rank told it is written."""
    ranks = LeaderOfTwo()
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource([]), ranks=ranks)
    loop.agreement._reports = {1: {"records": 5, "lag": {3: 7}, "dead_letters": {}}}  # the stop's report
    state = {"loop": {"offsets": {}}, "strategy": {}, "rng": {}}

    async def go():
        async with loop:
            written = await loop.submit(checkpoint.save_gathered, tmp_path / "a.pt", state, ranks,
                                        loop.checkpointed_parts)
            return written, loop.across_ranks()
    written, (records, lag, dead_letters, read_again) = asyncio.run(go())
    # (its own: no records; its partition 0's lag, read or not yet read by now, is not rank 1's)
    assert written and (records, lag.get(3), dead_letters, read_again) == (99, 7, {"bad_key": 1}, 11)
    assert checkpoint.save_gathered(tmp_path / "b.pt", state, ranks, loop.checkpointed_parts)  # no event loop left
    assert ranks.said == [True, True] and (tmp_path / "b.pt").exists()



class PacedSource(MemorySource):
    """A MemorySource whose fetches take `pace_s`, and whose records stop for `pause_s` once, at `pause_at`
    (its fetches return none meanwhile, as Kafka's)."""

    def __init__(self, records, *, pace_s=0.02, pause_at=None, pause_s=0.0, chunk=2):
        super().__init__(records, chunk=chunk)
        self.pace_s, self.pause_at, self.pause_s = pace_s, pause_at, pause_s
        self.paused_until = None

    async def fetch(self, max_records=None):
        await asyncio.sleep(self.pace_s)
        if self.position == self.pause_at and self.paused_until is None:
            self.paused_until = time.monotonic() + self.pause_s
        if self.paused_until is not None and time.monotonic() < self.paused_until:
            return
        async for fetched in super().fetch(max_records):
            yield fetched


def watched(loop):
    """Learn with `loop`, sampling (wall time, waiting_for, waiting_since) every 10 ms."""
    async def go():
        samples, results = [], []

        async def watch():
            while True:
                samples.append((time.time(), loop.intake.waiting_for, loop.intake.waiting_since))
                await asyncio.sleep(0.01)
        async with loop:
            watcher = asyncio.create_task(watch())
            async for result in loop:
                results.append(result)
            watcher.cancel()
        return results, samples
    return asyncio.run(go())


def test_a_stream_that_stops_while_others_send_is_named_until_its_records_come_and_the_losses_stay():
    """Stream 1 sends nothing for a while (60 records of stream 0: 30 fetches, 0.6 s) while stream 0 goes on:
    once no batch was cut for hold_quiet_s while stream 0 holds more than ahead_windows windows, the loop
    names stream 1 as the one the learning waits for, waiting since the last batch, until a batch is cut
    again; the losses are the in-memory run's. Streams that pause together, or come in turn, are not named."""
    text = "hello world, how are you " * 40

    def record(stream, k):
        return Record(str(stream), text[10 * k: 10 * k + 10])
    records = [record(s, k) for k in range(6) for s in (0, 1)]  # 5 batches' worth of both (and a window carried)
    records += [record(0, k) for k in range(6, 66)]  # stream 1 silent: 30 fetches of 2 records, 20 ms each
    records += [record(1, k) for k in range(6, 66)]
    expected = [r.loss for r in run(naive(), batches_from_records(records, 2, 10))]
    loop = PrequentialLoop(naive(), Batcher(2, 10), PacedSource(records), max_batches=len(expected), hold_quiet_s=0.2,
                           ahead_windows=4)
    results, samples = watched(loop)
    assert [r.loss for r in results] == expected
    assert {streams for _, streams, _ in samples} == {(), (1,)}, samples
    named = [(at, since) for at, streams, since in samples if streams]
    assert named and all(since is not None and at - since >= 0.2 for at, since in named), named
    assert len({since for _, since in named}) == 1  # since the last batch before stream 1 stopped
    assert samples[-1][1] == ()

    steady = [record(s, k) for k in range(36) for s in (0, 1)]
    expected = [r.loss for r in run(naive(), batches_from_records(steady, 2, 10))]
    # a pause of 0.6 s after 7 records of each (the batch after the 6th waits for both), none coming
    loop = PrequentialLoop(naive(), Batcher(2, 10), PacedSource(steady, pause_at=14, pause_s=0.6),
                           max_batches=len(expected), hold_quiet_s=0.2, ahead_windows=4)
    results, samples = watched(loop)
    assert [r.loss for r in results] == expected
    assert all(streams == () for _, streams, _ in samples)
    assert any(since is not None for _, _, since in samples)  # caught up, waiting for records
    # stream 0 three times as fast as stream 1, far ahead of it, then both stop: a pause of every stream
    uneven = [record(s, k) for k in range(24) for s in (0, 0, 0, 1)]
    expected = [r.loss for r in run(naive(), batches_from_records(uneven, 2, 10))]
    loop = PrequentialLoop(naive(), Batcher(2, 10), PacedSource(uneven), idle_timeout_s=1.0, hold_quiet_s=0.2,
                           ahead_windows=4)
    results, samples = watched(loop)
    assert [r.loss for r in results] == expected and loop.stop_reason == "idle"
    assert loop.batcher.far_ahead(4) and all(streams == () for _, streams, _ in samples)
    # a producer's slow pace: one record a fetch of 0.15 s, in turn, a batch every 0.3 s (past hold_quiet_s)
    expected = [r.loss for r in run(naive(), batches_from_records(steady[:16], 2, 10))]
    loop = PrequentialLoop(naive(), Batcher(2, 10), PacedSource(steady[:16], pace_s=0.15, chunk=1),
                           max_batches=len(expected), hold_quiet_s=0.2, ahead_windows=4)
    results, samples = watched(loop)
    assert [r.loss for r in results] == expected and all(streams == () for _, streams, _ in samples)


class WrittenSource(MemorySource):
    """A MemorySource whose records are written over time, `pace_s` apart (after the first `at_once`): a fetch
    returns those written by then, waiting up to 0.2 s for one, and the lag counts only written records not
    yet read (as Kafka's)."""

    def __init__(self, records, *, at_once, pace_s, chunk=4):
        super().__init__(records, chunk=chunk)
        self.at_once, self.pace_s, self.started = at_once, pace_s, time.monotonic()

    def _written(self):
        return min(len(self.records), self.at_once + int((time.monotonic() - self.started) / self.pace_s))

    async def fetch(self, max_records=None):
        waited = time.monotonic()
        while self._written() <= self.position and time.monotonic() - waited < 0.2:
            await asyncio.sleep(0.005)
        cap = self._written() - self.position
        if cap > 0:
            async for fetched in super().fetch(cap if max_records is None else min(cap, max_records)):
                yield fetched

    async def lag(self, taken=None, read=None):
        return {0: self._written() - max((taken or {}).get(("t", 0), self.position), (read or {}).get(("t", 0), 0))}


def test_records_that_make_no_batch_are_a_wait_for_records_not_learning():
    """Stream 1 is late while stream 0's records keep coming, too few to hold ahead_windows windows: no
    stream is named, yet once no batch was cut for hold_quiet_s with nothing unread, the loop says it
    waits for records since its last batch (it showed as consuming, and the console counted it as
    compute), until stream 1's records let a batch be cut; the losses are the in-memory run's."""
    text = "hello world, how are you " * 40

    def record(stream, k):
        return Record(str(stream), text[10 * k: 10 * k + 10])
    records = [record(s, k) for k in range(6) for s in (0, 1)]  # 5 batches of both, written at once
    records += [record(0, k) for k in range(6, 26)] + [record(1, k) for k in range(6, 26)]  # a record every 50 ms
    expected = [r.loss for r in run(naive(), batches_from_records(records, 2, 10))]
    loop = PrequentialLoop(naive(), Batcher(2, 10), WrittenSource(records, at_once=12, pace_s=0.05),
                           max_batches=len(expected), hold_quiet_s=0.3, ahead_windows=100, lag_every_s=0.05)
    started = time.time()
    results, samples = watched(loop)
    assert [r.loss for r in results] == expected
    assert all(streams == () for _, streams, _ in samples)
    waits = [(at, since) for at, _, since in samples if since is not None]
    # said once no batch was cut for hold_quiet_s, since the last result (its step ends a little after the cut)
    assert waits and all(at - since >= 0.2 for at, since in waits), waits
    assert {since for _, since in waits} == {waits[0][1]} and started < waits[0][1] < started + 0.3
    assert waits[-1][0] - waits[0][0] > 0.3  # (while stream 0's 20 records came: 1 s)
    assert samples[-1][2] is None  # stream 1's records came: a batch was cut


class PeakBatcher(Batcher):
    """A Batcher that notes the most bytes a stream held."""
    peak = 0

    def add(self, record, tp=None, offset=None):
        super().add(record, tp, offset)
        self.peak = max(self.peak, *(len(buf.data) for buf in self._buffers))


class TakenBatcher(Batcher):
    """A Batcher that notes the offsets it took."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.taken = set()

    def add(self, record, tp=None, offset=None):
        super().add(record, tp, offset)
        self.taken.add(offset)


def orders(records):
    """The stream's records in three orders within one partition: stream 1 after all of stream 0; stream 0
    three times as fast at first; and both streams in runs of 7 records."""
    zero, one = [r for r in records if r.stream == "0"], [r for r in records if r.stream == "1"]
    fast = [r for k in range(0, len(one)) for r in (*zero[3 * k: 3 * k + 3], *one[k: k + 1])]
    runs = [r for k in range(0, len(zero), 7) for r in (*zero[k: k + 7], *one[k: k + 7])]
    return {"late": zero + one, "fast": fast, "runs": runs}


@pytest.mark.parametrize("order", ["late", "fast", "runs"])
def test_a_stream_far_ahead_is_left_in_kafka_and_read_again_in_order_with_the_same_losses(stream, order):
    """While the next batch waits for stream 1, stream 0 may hold keep_windows windows (3 here); its further
    records are skipped and read again once it holds half as many, records taken meanwhile passed over:
    memory stays bounded, every record is counted once, and the losses are the in-memory run's."""
    records, _ = stream
    expected = [r.loss for r in run(naive(), batches_from_records(records, 2, 10))]
    ordered = orders(records)[order]
    assert len(ordered) == len(records)
    batcher, lines, source = PeakBatcher(2, 10), [], MemorySource(ordered, chunk=5)
    loop = PrequentialLoop(naive(), batcher, source, total_records=len(records), keep_windows=3, log=lines.append)
    results, _ = learn(loop)
    assert [r.loss for r in results] == expected
    assert loop.stop_reason == "end_of_stream" and loop.intake.records == len(records)
    assert batcher.peak <= 3 * 10 + 10  # keep_windows windows, and the record that went over
    # each fetch after an offset's first
    assert loop.intake.read_again == sum(source.reads.values()) - len(source.reads) > 0
    unbounded, source = PeakBatcher(2, 10), MemorySource(ordered, chunk=5)
    loop = PrequentialLoop(naive(), unbounded, source, total_records=len(records))
    learn(loop)
    assert unbounded.peak > 3 * 10 + 10  # (without the bound: most of stream 0 at once, or two runs of it)
    assert loop.intake.read_again == 0 and max(source.reads.values()) == 1
    longer = ordered + [Record("0", "more of stream 0 ") for _ in range(30)]  # no batch can use them
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(longer, chunk=5), total_records=len(longer),
                           keep_windows=3, idle_timeout_s=30)
    results, _ = learn(loop)
    assert [r.loss for r in results] == expected and loop.stop_reason == "end_of_stream"
    said = [line for line in lines if "stay in Kafka" in line]
    assert len(said) == 1 and said[0].startswith("partition 0: stream 0 holds more than 3 windows"), said


def far_apart_backlogs() -> list[Record]:
    """Records of 10 bytes (a window each): the three streams in turn; streams 0 and 2; stream 0 stops while 2
    sends five for each of stream 1's; the three in turn again."""
    def record(stream, k):
        return Record(str(stream), "0123456789"[k % 10:] + "0123456789"[:k % 10])
    order = [record(s, i) for i in range(30) for s in (0, 2, 1)]
    order += [record(s, 100 + i) for i in range(20) for s in (0, 2)]
    order += [record(s, 200 + i) for i in range(100) for s in (2, 2, 2, 2, 2, 1)]
    return order + [record(s, 400 + i) for i in range(100) for s in (0, 1, 2)]


@pytest.mark.parametrize("says_last", [True, False])
def test_backlogs_far_apart_are_read_again_by_jumping_from_one_to_the_next(says_last):
    """Stream 0 went ahead and was skipped, then stopped while stream 2 sent five times as fast as stream 1:
    both filled up while the learning waited for stream 0, so their backlogs (stream 2's dense, stream 1's
    sparse) lie far apart when stream 0 sends again. At each rewind the rereading takes from stream 2's
    backlog, soon too full again, then jumps on to stream 1's first untaken record rather than reading
    through (skipping again) all that lies between. Fetches of 7 records read each record about 12 times on
    average, fetches of 50 about 14 times; now fewer than 3 times, whether the rest of a fetch is read through
    to the jump's end or dropped by a seek (a source that does not say its fetch's last offset). While reading
    again a fetch returns at most the loop's `reread_records` (16): with fetches of 500 (Kafka's are up to
    2,000) and none, each record was read 16 times (27 with the seeks), since a rewind's fetch held far more
    than its streams could take before they were skipped again. The losses are the in-memory run's."""
    order = far_apart_backlogs()
    expected = [r.loss for r in run(naive(), batches_from_records(order, 3, 10))]
    for chunk, capped, reads in ((7, True, (1, 3)), (50, True, (1, 3)), (500, True, (1, 3)), (500, False, (10, 40))):
        source = MemorySource(order, chunk=chunk, says_last=says_last)
        loop = PrequentialLoop(naive(), Batcher(3, 10), source, total_records=len(order), keep_windows=4,
                               **({} if capped else {"reread_records": chunk}))
        results, _ = learn(loop)
        assert [r.loss for r in results] == expected and loop.stop_reason == "end_of_stream", chunk
        fetched = sum(source.reads.values())
        assert reads[0] * len(order) < fetched < reads[1] * len(order), (chunk, capped, fetched)
        assert loop.intake.read_again == fetched - len(order), (chunk, fetched)


def test_fetches_are_small_only_while_reading_again_and_one_that_takes_nothing_is_not_caught_up():
    """The far-apart backlogs above, fetches of 500 and a queue of one batch: the loop asks for at most
    `reread_records` only while a partition is read again, and a fetch that takes none of its records (each
    passed over, skipped again or dropped by a jump's seek) is not "caught up": records remain. With the cap,
    such fetches came often, and each one with the queue empty said caught up and counted as waiting."""
    order = far_apart_backlogs()

    class Watched(MemorySource):
        caught_up = []  # at each fetch: the loop said caught up while records remained

        async def fetch(self, max_records=None):
            self.caught_up.append(loop.intake.waiting_since is not None and self.position < len(self.records))
            async for fetched in super().fetch(max_records):
                yield fetched

    source = Watched(order, chunk=500)
    loop = PrequentialLoop(naive(), Batcher(3, 10), source, total_records=len(order), keep_windows=4, queue_size=1)
    learn(loop)
    assert loop.stop_reason == "end_of_stream" and loop.intake.read_again > 0
    assert source.caps[0] is None and 16 in source.caps and set(source.caps) == {None, 16}, source.caps
    again = [index for index, cap in enumerate(source.caps) if cap == 16]
    assert source.caps[again[-1] + 1:] and set(source.caps[again[-1] + 1:]) == {None}  # (caught up: as Kafka's)
    assert not any(source.caught_up), source.caught_up.count(True)


def test_the_lag_counts_the_records_read_past_and_not_those_read_again(stream):
    """Stopped while stream 0's records are skipped, and again while they are read again: the lag is the
    records not yet taken (never read, or read past and not read again), not the records beyond the
    reader's position (which left out those read past, and counted the ones taken again when reading again)."""
    records, _ = stream
    ordered = orders(records)["late"]
    states = set()
    for stop in (3, 8, 14, 20, 30):
        loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(ordered, chunk=5), max_batches=stop,
                               keep_windows=3, queue_size=2)
        learn(loop)
        asyncio.run(loop.intake.read_lag(now=True))
        offsets = loop.batcher.offsets
        states.add((bool(offsets.skipping(("t", 0))), offsets.reading_again()))
        assert loop.intake.lag == {0: len(ordered) - loop.intake.records}, stop
        assert offsets.unread > 0 or offsets.reading_again(), stop
    assert {(True, False), (False, True)} <= states


def test_a_restart_while_records_are_skipped_or_read_again_is_invisible(stream, tmp_path):
    """Stopped after batch k, saved, loaded and read on from the batcher's own next offset, whatever the
    skipping's state then (records skipped, or being read again): the losses are one run's, and the
    offset a checkpoint lets Kafka commit never passes a record not learned nor carried over."""
    records, _ = stream
    expected = [r.loss for r in run(naive(), batches_from_records(records, 2, 10))]
    ordered = orders(records)["late"]
    states = set()
    for stop in (3, 8, 14, 20, 30):
        first = PrequentialLoop(naive(), TakenBatcher(2, 10), MemorySource(ordered, chunk=5), max_batches=stop,
                                keep_windows=3, queue_size=2)
        results, _ = learn(first)
        offsets = first.batcher.offsets
        states.add((bool(offsets.skipping(("t", 0))), offsets.reading_again()))
        kept = first.state_dict()["offsets"][("t", 0)]
        read_again = sum(first.source.reads.values()) - len(first.source.reads)
        assert first.intake.read_again == read_again, stop  # (at the stop)
        assert set(range(kept)) <= first.batcher.taken, stop  # (the batcher holds those not learned yet)
        checkpoint.save(tmp_path / "c.pt", {"strategy": first.strategy.state_dict(), "loop": first.state_dict()})
        saved = checkpoint.load(tmp_path / "c.pt")
        strategy = naive(seed=5)
        strategy.load_state_dict(saved["strategy"])
        batcher = Batcher(2, 10)
        again = PrequentialLoop(strategy, batcher, MemorySource(ordered, chunk=5), total_records=len(records),
                                keep_windows=3)
        again.load_state_dict(saved["loop"])
        again.source.position = batcher.offsets.next_positions()[("t", 0)]
        rest, _ = learn(again)
        assert [r.loss for r in results + rest] == expected, stop
        assert again.intake.records == len(records) and again.stop_reason == "end_of_stream"
        reads = first.source.reads + again.source.reads  # (the first reads none past what its state says it read)
        assert again.intake.read_again == sum(reads.values()) - len(reads), stop
    assert {(True, False), (False, True)} <= states  # stopped while skipping, and while reading again


def test_a_checkpoint_holding_a_batch_ready_to_cut_cuts_it_when_every_record_read_on_is_skipped():
    """A checkpoint taken while the fetch side waited for room in the queue holds a batcher with a batch
    ready and not cut. Loaded, it was cut only after the next record added; when every record read on is
    skipped (stream 0 holds more than keep_windows), none is added, no batch is cut, no stream drains and
    no rewind comes: the run waited for ever (here: stopped idle, no batch learned). Each fetch first cuts
    what is ready (found by the review of the rereading's jumps)."""
    order = [Record("0", "abcdefghij")] * 8 + [Record("1", "abcdefghij")] * 2 + [Record("0", "abcdefghij")] * 6
    expected = [r.loss for r in run(naive(), batches_from_records(order, 2, 10))]
    batcher, tp, taken = Batcher(2, 10), ("t", 0), 0
    for offset, record in enumerate(order):
        if batcher.admit(tp, offset, record.stream, 3) == "take":
            batcher.add(record, tp, offset)
            taken += 1
        if batcher.ready():
            break  # the fetch side waits for room here, and a checkpoint is taken
    assert batcher.skipped_streams(tp) == (0,) and len(expected) == 1
    state = PrequentialLoop(naive(), batcher, MemorySource(order), keep_windows=3).state_dict() | {"records": taken}
    again = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(order), total_records=len(order), keep_windows=3,
                            idle_timeout_s=5)
    again.load_state_dict(state)
    again.source.position = again.batcher.offsets.next_positions()[tp]
    results, _ = learn(again)
    assert [r.loss for r in results] == expected and again.stop_reason == "end_of_stream"


def test_records_still_to_read_again_keep_a_finite_run_from_ending():
    """Every record counted as read (taken, or skipped and not read again yet) and no batch to cut is the end
    of a finite stream, unless a partition is being read again: its skipped records come yet. Streams 0 and
    2's records lie before all of stream 1's; a reader (as the loop reads) stops where every record has been
    read once and the skipped ones are being read again: the loop's end check waited for none of them (a
    learner ended 'end_of_stream' 22 batches early, through the real broker); now only once they are read."""
    from tests.test_batching import read_with_skips

    records, _ = small_stream(CORPUS, fragments=3, mean_tokens=300, streams=3, window=10, seed=1)
    order = [r for r in records if r.stream != "1"] + [r for r in records if r.stream == "1"]
    checked = []

    def check(batcher, taken):
        offsets = batcher.offsets
        loop = PrequentialLoop(naive(), batcher, MemorySource(order), total_records=len(order), keep_windows=2)
        loop.intake.records = taken
        loop._check_stop()
        if loop.intake.records_read() == len(order) and not batcher.ready() and offsets.unread:
            checked.append(offsets.reading_again())
            assert loop.stop_reason is None
    for seed in range(20):
        read_with_skips({0: order}, 3, 10, 2, seed=seed, watch=check)
    assert True in checked


def test_a_queued_batch_from_a_checkpoint_without_votes_votes_for_its_own_truth():
    """The global batch's truth (ranks) is voted from each rank's part; a checkpoint written before the
    votes were kept held a queued batch's truth alone: it then counts as that part's one vote, where no
    vote at all made rank 0 log the first resumed batches with no class (a false switch and back)."""
    from monitor.results import BatchTruth
    from streamer.intake import ready_from_plain, ready_to_plain
    from streamer.rank_agreement import global_truth

    batch = Batcher(2, 3)
    for stream, text in (("0", "abcdefgh"), ("1", "ijklmnop")):
        batch.add(Record(stream, text, Truth("en", 4, position=0, produced=0.0)))
    saved = ready_to_plain(batch.pop())
    assert saved["votes"] == [["en", 4, 6]]
    del saved["votes"]  # as before 2026-11-29
    ready = ready_from_plain(saved, batch)
    assert ready.truth == BatchTruth("en", 4) and ready.votes == (("en", 4, ready.batch.tokens),)
    assert global_truth([json.dumps(ready.votes).encode()] * 2) == BatchTruth("en", 4)


class PeerInStep:
    """Rank 0's side of the per-step agreement with a rank that always has its batch: each agreement takes
    `agree_s` (the all-gather waits for the other rank's step and hand-over). `waits`: "round", every
    other agreement first says the other rank waits for its records (no step: this rank waits); "before",
    every agreement steps, but the other rank says it waited for its records before it came (it held this
    rank in the all-gather meanwhile)."""

    rank = 0

    def __init__(self, agree_s: float, waits: str | None = None):
        self.agree_s, self.waits, self._asked = agree_s, waits, 0

    def agree(self, has_batch, stop_reason, checkpoint, records=0, more=True, total_records=None, report=False,
              idle=False, votes=b"", waited=False):
        time.sleep(self.agree_s)
        self._asked += 1
        if stop_reason is not None or not (has_batch or more):
            return Agreement(False, stop_reason or "end_of_stream", False)
        others_wait = self.waits == "round" and self._asked % 2
        return Agreement(has_batch and not others_wait, None, False, votes=[votes] if has_batch else None,
                         waited=waited or self.waits == "before")

    def gather_bytes(self, data):
        return [data]

    def broadcast_bytes(self, data):
        return data


@pytest.mark.usefixtures("one_torch_thread")
def test_under_ranks_the_agreement_between_two_steps_is_compute_unless_a_rank_waited_for_records(stream):
    """The console's compute time is the worker's (busy_s), the rest of a consuming run's time idle. Under
    ranks the steps run in lockstep: the agreement and hand-over between two steps with every rank's batch
    queued are the price of stepping together, not waiting for records (a backlogged --nproc 2 run said
    idle 1.2 s of 5.5). A gap in which a rank waited for its records stays out of busy_s, the other rank's
    wait before its agreement included (it held this rank in the all-gather: counted, a word model's
    ranks, whose streams run apart, said 9.6 s of compute for 5.1 s of steps)."""
    records, _ = stream
    records = records[:60]
    busy = {}
    for waits in (None, "round", "before"):
        loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), ranks=PeerInStep(0.04, waits),
                               total_records=len(records))
        stepped = []
        loop_module_prequential = step_worker.prequential_step

        def timed_step(*args, **kwargs):
            started = time.perf_counter()
            result = loop_module_prequential(*args, **kwargs)
            stepped.append(time.perf_counter() - started)
            return result
        with mock.patch.object(step_worker, "prequential_step", timed_step):
            results, _ = learn(loop)
        assert len(results) >= 8 and loop.stop_reason == "end_of_stream"
        busy[waits] = (loop.worker.busy_s - sum(stepped), len(results))
    between, steps = busy[None]
    assert between >= 0.9 * 0.04 * (steps - 1)  # every gap after the first step: its agreement at least
    waited, steps = busy["round"]
    assert waited <= 0.5 * 0.04 * (steps - 1)  # the agreements that waited are not counted, nor what followed
    waited, steps = busy["before"]
    assert waited <= 0.1 * 0.04 * (steps - 1)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_word_models_stream_end_is_its_end_however_long_ago_its_last_record_was_read(stream):
    """A word-level model's stream ends by its records (total_records; the manifest's byte batches are not
    its batches). Every record is read in the first fetches; when learning them outlasted --idle-timeout,
    the run said it stopped 'idle' (poe on lstm-word under compare --jobs 2), not at the stream's end."""
    records, _ = stream
    records = records[:40]
    real_step = step_worker.prequential_step

    def slow_step(*args, **kwargs):
        time.sleep(0.1)  # a model slower than its stream: the learning outlasts the idle timeout
        return real_step(*args, **kwargs)
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records, chunk=1000), total_records=len(records),
                           idle_timeout_s=0.5)
    with mock.patch.object(step_worker, "prequential_step", slow_step):
        results, _ = learn(loop)
    assert len(results) * 0.1 > 0.5 and loop.intake.records == len(records)
    assert loop.stop_reason == "end_of_stream"


def test_a_collective_held_past_stall_s_is_timed_apart():
    """A rank stopped or hung holds the others in their next collective (agreement, all-reduce, report): the
    seconds past STALL_S are kept apart from the work (they were counted as compute), and the collective in
    progress is known while it lasts (the loop says it)."""
    import time

    from streamer import distributed

    before = distributed.stalled_s()
    with distributed._collective():  # noqa: SLF001 - what every collective runs in
        assert time.monotonic() - distributed.in_collective_since() < 1
        time.sleep(0.05)
    assert distributed.in_collective_since() is None and distributed.stalled_s() == before  # short: work
    stall, distributed.STALL_S = distributed.STALL_S, 0.1
    try:
        with distributed._collective():  # noqa: SLF001
            time.sleep(0.4)
    finally:
        distributed.STALL_S = stall
    assert 0.25 <= distributed.stalled_s() - before < 1


def test_the_loop_is_at_rest_while_its_consumer_waits_for_the_next_batch_in_a_probes_peek():
    """A probe's peek between two results holds the snapshot point (snapshot_point waits for it), so the idle
    checkpoint, taken through it, never came while a run with probes waited for records. at_rest says when a
    snapshot copied on the event loop is one of "after the last result": here, while the consumer waits in
    peek with the topic quiet; not while it takes a result in."""
    records = [Record(str(i % 2), "abcdefghijk") for i in range(40)]
    loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), idle_timeout_s=2.0)
    taking_in, quiet = [], []

    async def go():
        async with loop:
            async for _ in loop:
                taking_in.append(loop.at_rest)  # the consumer holds the point, not in a peek
                if await loop.peek() is None:  # a probe's look at the next batch: none comes, the loop stops
                    break

    async def watch():  # the topic quiet for half a second: every record learned
        while loop.intake.waiting_since is None or time.time() - loop.intake.waiting_since < 0.5:
            await asyncio.sleep(0.05)
        quiet.append((loop.at_rest, loop.step))

    async def both():
        watcher = asyncio.ensure_future(watch())
        await go()
        await watcher

    asyncio.run(both())
    assert taking_in and not any(taking_in) and quiet == [(True, len(taking_in))]


def test_the_kafka_source_and_a_list_in_memory_meet_the_loops_source_protocol():
    from streamer.kafka.consumer import KafkaSource
    from streamer.source import Source

    assert isinstance(MemorySource([]), Source)
    assert isinstance(KafkaSource("127.0.0.1:9", "t", "g", dead_letter=False, log=lambda line: None), Source)
    assert not isinstance(object(), Source)
