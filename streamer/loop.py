"""The prequential loop over a topic: an async generator of one StepResult per learned batch, in order.

    asyncio loop (Kafka side)                               single worker thread (model side)
    fetch -> decode -> dead-letter -> batch  ==bounded queue==>  predict -> record -> learn

The fetch side is a task on the event loop (the consumer's heartbeat runs there too); the step runs in
one worker thread, so a slow step never starves the heartbeat, and a full queue pauses fetching
(backpressure). The loop owns no monitor, exporter, view or file: whoever iterates it reads the
results and, between two results, the plain state below (records, dead_letters, read_again, lag,
queue_depth, waiting_since, broker_lost_since).

A watch task asks the source whether its broker answers (`source.reachable()`, when it has one) every
`probe_every_s`: a broker that has not answered for `lost_after_s` is lost (one line; the model is
kept, the queued batches are learned, nothing is committed), one that answers again is back (one line;
the consumer rejoins its group and reads on from the learner's own offsets); one lost for
`broker_timeout_s` stops the loop with stop_reason "broker_lost" (the learner then checkpoints).

Ranks of a distributed learner (`ranks`, streamer.distributed) start together: rank 0's failure to
start (a refusal only it can make) ends every rank, and rank 0 alone says it. They step together:
before each step every rank says, in one collective in the worker thread, whether it has its next
batch, whether it stops (and why) and (rank 0) whether a checkpoint is due; all step when all have a
batch, all stop when one stops, and all checkpoint after the step when rank 0 asks. A rank waiting
for records says so every `agree_every_s`, so a stop reaches every rank within that time. Every
`lag_every_s`, and at the stop, rank 0 also asks each rank for its records, lag, dead letters and
records read again (a gather after the agreement), so that `across_ranks()` and
`waiting_for_records_since` describe the whole learner there.

A consumer that sets `snapshot_wanted` lets the next steps run ahead of it: while step k runs, batch
k + 1 is queued behind it in the worker, so the worker goes from one step to the next without
waiting for the consumer to take in result k; the loop asks snapshot_wanted(k + 1, batch, truth
after k) first, and a True (a checkpoint or a probe due after step k) keeps step k + 1 until result
k has been taken in. A result is then a snapshot point only where `at_snapshot` says so. While steps
are short, a burst of batches is queued behind the running step: as many as `burst_span_s` (0.25 s)
holds at the last step's pace, at most `burst` (32), where that is two or more (steps of up to
125 ms). The worker wakes the event loop only when one step is left behind the one it finished: the
consumer takes results in bursts, and the fetch side refills at the same wake-up. Each wake-up finds the
event loop's Python and data cold in the caches the step has used; beside the default LSTM's 7 ms
step on 2 cores the event loop took 0.57 CPU ms a batch with a wake-up a result, 0.38 with bursts of
4 and 0.20-0.25 with bursts of 16-32 (benchmarks/throughput.py). `stop()` lets the running step
finish; the steps queued behind it learn nothing and their batches go back to the queue.

    async with PrequentialLoop(strategy, batcher, source, max_batches=...) as loop:
        async for result in loop:
            ...  # at a result where loop.at_snapshot (every result without snapshot_wanted): strategy,
                 # batcher carry-over and offsets describe "after batch result.index"
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, NamedTuple

from monitor.results import BatchTruth, StepResult
from producers.wire import stream_id
from streamer import distributed
from streamer.batching import ReadyBatch, vote
from streamer.checkpoint import RankPart
from streamer.source import Source, SourceError
from streamer.spin import outlast
from streamer.step import prequential_step
from streamer.strategies.base import Batch

NOT_READ = ("dead_letter_failed", "deleted_before_read")  # dead-letter counts of no record read (records_batched)

__all__ = ["PrequentialLoop"]


class PrequentialLoop:
    """Learn batches from `source` (a streamer.source.Source: streamer.consumer.KafkaSource) until
    a stop condition: `max_batches` learned, `max_seconds` elapsed, `idle_timeout_s` without a record,
    or the end of the stream: `total_batches` learned, or every one of `total_records` read and no
    whole batch left (both from the producer's manifest)."""

    def __init__(self, strategy, batcher, source: Source, *, max_batches: int | None = None,
                 total_batches: int | None = None, total_records: int | None = None,
                 max_seconds: float | None = None, idle_timeout_s: float | None = None, queue_size: int = 64,
                 broker_timeout_s: float | None = None, probe_every_s: float = 1.0, lost_after_s: float = 3.0,
                 log=None, ranks=None, agree_every_s: float = 0.2, burst: int = 32, burst_span_s: float = 0.25,
                 lag_every_s: float = 1.0, ahead_windows: int = 256, hold_quiet_s: float = 5.0,
                 keep_windows: int = 1024, reread_records: int = 16):
        self.strategy, self.batcher, self.source = strategy, batcher, source
        self.ranks, self.agree_every_s = ranks, agree_every_s  # streamer.distributed.Ranks; None: one process
        self.checkpoint_wanted = lambda: False  # rank 0's Checkpointer sets it: asked at each agreement
        self.checkpoint_agreed = False  # the last agreement asks for a checkpoint after its step
        self.broker_timeout_s, self.probe_every_s, self.lost_after_s = broker_timeout_s, probe_every_s, lost_after_s
        self._log = log or (lambda line: None)
        self.max_batches, self.total_batches, self.total_records = max_batches, total_batches, total_records
        self.max_seconds, self.idle_timeout_s = max_seconds, idle_timeout_s
        # plain state, read between results
        self.step = 0  # batches learned; the next result's index
        self.tokens = 0
        self.skipped = 0  # batches whose update was skipped (non-finite loss or gradients)
        self.last_loss = float("nan")  # the last recorded loss; stands in for a non-finite one
        self.records = 0  # records read: learned, carried over or dead-lettered
        self.dead_letters: Counter = Counter()  # reason -> records
        self.read_again = 0  # records read more than once (each read after the first): rewinds and jumps (_admitted)
        self._failed_before = 0  # dead-letter sends that failed before the resume (the source counts its own)
        self.lag: dict[int, int] = {}  # partition -> records in the log not yet taken into the batcher (_read_lag)
        self.lag_every_s, self._lag_read_at = lag_every_s, float("-inf")  # lag is read anew at most this often
        # a partition far ahead (its streams hold ahead_windows windows, a batch waits for another's) is not
        # read meanwhile, unless no batch was cut for hold_quiet_s (the short stream's records are behind
        # others' in a held partition): then every partition is read until the next batch is cut
        self.ahead_windows, self.hold_quiet_s = ahead_windows, hold_quiet_s  # (Batcher.ahead takes at least 1)
        # a stream that holds more than keep_windows windows (a batch waits for another) is not read into
        # memory: its records stay in Kafka and are read again once it holds half as many (Batcher.admit);
        # only with a source that can seek and a batcher of windows (an utterance batcher keeps all)
        self.keep_windows = keep_windows
        # while a partition is read again, a fetch returns at most reread_records records: a rewind's streams
        # fill up again within a few records, and the jump on (a seek) drops the rest of the fetch
        self.reread_records = reread_records
        if reread_records < 1:
            raise ValueError(f"reread_records must be at least 1, not {reread_records}")
        self._ahead_at = min(ahead_windows, keep_windows // 2)  # far ahead: never beyond what a stream may keep
        self._skips = hasattr(batcher, "admit") and hasattr(source, "seek")
        self._skips_said: set = set()  # the partitions whose skipping the log has said
        self._cut_at = time.monotonic()  # when the last batch was cut (or the fetch side began)
        self._cut_wall = time.time()  # then, as wall time
        self._learned_wall = self._cut_wall  # when the last result was taken in (wall time)
        # the streams the learning waits for (_streams_waited_for): a stream that stopped sending; () otherwise
        self.waiting_for: tuple[int, ...] = ()
        self.truth: BatchTruth | None = None  # the latest truth of a learned batch
        self.labels_known: int | None = None  # classifiers: labels known when the last batch was cut
        self.stop_reason: str | None = None
        self.waiting_since: float | None = None  # wall time since when it is caught up and waits for records
        self.broker_lost_since: float | None = None  # wall time of the broker's last answer while it is lost
        self._peeking = 0  # peek()s waiting (at_rest)
        self.topic_gone = False  # lost as the topic was deleted (the broker answers): said so
        self._queue: deque[ReadyBatch] = deque()  # bounded by queue_size; [0] is the next batch to learn
        # ranks: when an agreement last found another rank without its next batch while this one had its
        # own (None once they step), and since when (wall time); counted as waiting for records only while
        # agreements keep coming
        self._others_waited_at: float | None = None
        self._others_waiting_since: float | None = None
        # ranks: the other ranks' reports (rank -> records, lag, dead letters), on rank 0, as of the last
        # gather (a report's, or a checkpoint's: checkpointed_parts)
        self._reports: dict[int, dict] = {}
        self._reported_at = float("-inf")
        self._agreements_fresh_s = max(5.0, 10 * agree_every_s)
        self._queue_size = queue_size
        self._refill_at = queue_size // 2  # a full queue is refilled once this few batches are left in it
        self._changed = asyncio.Event()
        self._started = self._last_record = time.monotonic()
        self._worker: ThreadPoolExecutor | None = None
        self._submitted: list[concurrent.futures.Future] = []  # to the worker, those not done when last seen
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the one the loop runs on (__aenter__)
        self._fetcher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._rank_watcher: asyncio.Task | None = None  # ranks: says a collective another rank holds
        self._closing = False  # set on leaving the `async with`: the fetch and watch tasks' loops end
        # Held from taking a batch until the consumer of its result asks for the next one with no
        # step in flight (none runs ahead): whoever holds it sees a snapshot point. The generator's own consumer (between two results) is at
        # one already and must not wait on it; others (a rebalance callback) use `snapshot_point()`.
        self._between_results = asyncio.Lock()
        self._snapshot_asked = 0  # snapshot_point() callers waiting
        # Steps handed to the worker, oldest first: (batch, future of its StepResult); up to burst + 1 ahead
        self._running: deque[tuple[ReadyBatch, concurrent.futures.Future]] = deque()
        # Results in bursts: while steps are short (`burst_span_s` holds two or more of the worker's last),
        # a burst (`burst_span_s` of steps, at most `burst`) runs ahead of the consumer, plus one, and the
        # worker wakes the event loop once one step is left behind the one it finished, not after each
        # (_stepped)
        self.burst, self.burst_span_s = max(1, burst), burst_span_s
        self._step_s = math.inf  # the worker's last step, wall seconds (none yet: no burst)
        self.busy_s = 0.0  # the worker's seconds in steps in this process (the console's compute time)
        # Ranks: when the last step ended (perf_counter), while the time since counts as stepping together
        # (_stepping): None once this rank or another waited for records, or a checkpoint came between
        self._lockstep_from: float | None = None
        self._checkpoint_between = False
        self._results = asyncio.Event()  # the worker's wake-up: results are waiting
        self._handed = -1  # the index of the last step handed to the worker
        self._halting = False  # stop() was called: the worker begins no further step
        self._stepped_loss = float("nan")  # the worker's last recorded loss (a step's stand-in for a non-finite one)
        # Set by the consumer to let a step run ahead of its consumer: snapshot_wanted(index, upcoming, previous
        # truth) is asked before batch `index` (a ReadyBatch) is queued behind the step in flight, whose result
        # is then not yet taken in; True keeps it until then. None: every result is a snapshot point.
        self.snapshot_wanted = None

    @property
    def records_batched(self) -> int:
        """Records that reached the batcher: read, less those dead-lettered (the manifest counts only these)."""
        return self.records - sum(count for reason, count in self.dead_letters.items() if reason not in NOT_READ)

    def _records_read(self) -> int:
        """Records read: those that reached the batcher and those it left in Kafka (Batcher.admit) meanwhile."""
        return self.records_batched + self._left_in_kafka()

    def _left_in_kafka(self) -> int:
        """Records read past and not yet read again (Batcher.admit; 0 for a batcher or source without it)."""
        return self.batcher.offsets.unread if self._skips else 0

    def _more(self) -> bool:
        """Whether the batcher has a batch to cut, or records to read again that may make one: a partition
        being read again, or one to rewind (Batcher.rewinds)."""
        if self.batcher.ready():
            return True
        return self._skips and (self.batcher.offsets.reading_again()
                                or bool(self.batcher.rewinds(self.keep_windows, apply=False)))

    @property
    def consuming(self) -> bool:
        """Started, fetching, the broker answering, and not stopped: what /readyz reports."""
        return (self._fetcher is not None and not self._fetcher.done() and self.stop_reason is None
                and self.broker_lost_since is None)

    @property
    def queue_depth(self) -> int:
        """Batches cut whose results are not yet taken in: those queued, and those handed to the worker (the
        step in flight among them; up to a burst of them). 0 only when the worker has nothing it can learn:
        a stuck step with nothing behind it shows 1, where the queue alone would show 0; a rank's queued
        batches while another rank has none of its own (the run waits for records, as one process whose
        streams are not all there to cut a batch) show 0, as long as the ranks' agreements keep coming (an
        agreement that hangs, a rank stuck, shows them)."""
        if self._others_waiting and not self._running:
            return 0
        return len(self._queue) + len(self._running)

    @property
    def _others_waiting(self) -> bool:
        """Ranks: the last agreement, recent enough, found another rank without its next batch while this
        one had its own."""
        return (self._others_waited_at is not None
                and time.monotonic() - self._others_waited_at < self._agreements_fresh_s)

    @property
    def waiting_for_records_since(self) -> float | None:
        """Wall time since when the learner waits for records (None: it does not): this process caught up
        (`waiting_since`), or (ranks) this rank has its next batch and another rank not, as long as the
        agreements keep coming (the learner as a whole cannot cut its next global batch)."""
        if self.waiting_since is not None:
            return self.waiting_since
        return self._others_waiting_since if self._others_waiting else None

    def across_ranks(self) -> Counts:
        """Counts of the whole learner: this process's own and, on rank 0 of ranks, the other ranks' as of
        their last report (every `lag_every_s`, and at the stop)."""
        records, lag, dead_letters = self.records, dict(self.lag), Counter(self.dead_letters)
        read_again = self.read_again
        for report in self._reports.values():
            records += report["records"]
            lag.update(report["lag"])
            dead_letters.update(report["dead_letters"])
            read_again += report.get("read_again", 0)
        return Counts(records, lag, dead_letters, read_again)

    async def __aenter__(self) -> PrequentialLoop:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step")
        self._event_loop = asyncio.get_running_loop()
        try:
            try:
                started = await self._start_source()
            except Exception as exc:
                if self.ranks is not None:
                    await self._after_every_ranks_start(exc)
                raise
            if self.ranks is not None:
                await self._after_every_ranks_start(None)
        except BaseException:  # no __aexit__ follows
            self._worker.shutdown(wait=False)
            raise
        if not started:
            return self  # stopped while starting (a signal, --minutes or --idle-timeout while it waited)
        self._last_record = time.monotonic()  # (--minutes counts from the loop's start: _started)
        self._fetcher = asyncio.create_task(self._fetch())
        self._watcher = asyncio.create_task(self._watch())
        if self.ranks is not None:
            self._rank_watcher = asyncio.create_task(self._watch_ranks())
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True  # the fetch and watch tasks end at their next turn even if a cancel is lost
        try:  # (an interrupt, or asyncio.run's cancel, landing while they end still stops the worker)
            await _ended([task for task in (self._fetcher, self._watcher, self._rank_watcher) if task is not None],
                         self._log)
            self._count_failed_sends()  # (a stop may end the fetch side before its first fetch ends)
        finally:
            self._worker.shutdown(wait=False, cancel_futures=True)  # a step queued ahead never starts
            # the step in flight ends first, on a wait that an interrupt cannot cut short (Thread.join, in
            # shutdown's wait, on Python 3.11: then the exit aborted while the step was inside torch's C++);
            # not on those cancelled, which concurrent.futures.wait never counts as done (it hung on them)
            in_flight = [future for future in self._submitted if not future.done()]
            try:
                outlast(lambda: concurrent.futures.wait(in_flight))
            finally:  # an interrupt the wait held back still leaves the group
                await self.source.stop()

    async def _after_every_ranks_start(self, failure: Exception | None) -> None:
        """Ranks: rank 0's failure to start is every rank's. A refusal only rank 0 can make (another learner
        in the group: only rank 0 is a member of the learner group, learner_group.Membership) left the
        other ranks waiting for it in their first agreement; its end then failed them as 'another rank is
        gone', a line of their own. One broadcast of rank 0's line, the loop's first collective, which every
        rank reaches whether its start went well, failed or was given up: a rank that started ends on rank 0's
        line as on a refusal every rank makes alike (SourceError, every_rank: rank 0 says it, it says nothing);
        a rank's own failure is still its own."""
        line = None
        if failure is not None and self.ranks.rank == 0:
            line = (str(failure) or type(failure).__name__).encode()
        said = await self.in_worker(self.ranks.broadcast_bytes, line)
        if said is not None and failure is None and self.ranks.rank != 0:
            await self.source.stop()  # started: it leaves now, as no __aexit__ follows
            raise SourceError(said.decode(errors="replace"), every_rank=True)

    async def _start_source(self) -> bool:
        """source.start(), given up when the loop is stopped meanwhile; False then. While the broker has
        answered and the topic does not exist, `max_seconds` (from the loop's start) and `idle_timeout_s`
        (from when the topic was found missing: no record can come before it exists) stop it: a mistyped
        topic does not keep a bounded run waiting for ever. (A broker that does not answer is
        --broker-timeout's: an error, exit 2, however short the run.)"""
        starting = asyncio.ensure_future(self.source.start())
        while not starting.done():
            await asyncio.wait({starting}, timeout=0.2)
            missing = getattr(self.source, "topic_missing_since", None)
            if missing is not None and self.stop_reason is None:
                if self.max_seconds and time.monotonic() - self._started >= self.max_seconds:
                    self.stop_reason = "time_limit"
                elif self.idle_timeout_s and time.time() - missing >= self.idle_timeout_s:
                    self.stop_reason = "idle"
            if self.stop_reason is not None and not starting.done():
                await _ended([starting], self._log)
                return False
        starting.result()  # re-raise: the broker unreachable, the group shared
        return True

    async def __aiter__(self) -> AsyncIterator[StepResult]:
        holding = False  # self._between_results: from taking a batch until a result is taken in with none in flight
        try:
            while True:
                if not self._running:
                    # fetch -> batch: the fetch task has cut it; None: a stop condition (of any rank)
                    ready = await (self.peek() if self.ranks is None else self._agreed())
                    if ready is None:
                        if self.ranks is None:  # (ranks: read before the stop's report, _agreed)
                            await self._read_lag(now=True)  # the last records taken since the last read
                        return
                    await self._between_results.acquire()
                    holding = True
                    if self.ranks is None and (not self._queue or self._queue[0] is not ready
                                               or self.stop_reason is not None):
                        self._between_results.release()  # changed while a snapshot was taken: look again
                        holding = False  # (ranks: agreed, so step)
                        continue
                    self._hand_over()
                self._run_ahead()
                ready, stepped = self._running[0]
                result = await self._result_of(stepped)  # predict -> record -> learn happened in the worker, in this order
                if result is None:  # stop() came before this step began: it and those behind it are not learned
                    await self._put_back()
                    continue
                self._running.popleft()
                self._learned_wall = time.time()
                self.step += 1
                self.tokens += result.tokens
                self.skipped += result.skipped
                self.last_loss = result.loss
                self.truth = result.truth or self.truth
                self.labels_known = ready.batch.labels_known
                # SNAPSHOT POINT where at_snapshot: strategy, carry-over and offsets describe "after batch result.index"
                yield result
                if not self._running:
                    self._between_results.release()
                    holding = False
        finally:
            if holding:
                self._between_results.release()

    @property
    def at_snapshot(self) -> bool:
        """No step in flight: the strategy, the carry-over and the offsets describe "after the last
        result". Always so between two results unless `snapshot_wanted` let the next step run ahead."""
        return not self._running

    def _hand_over(self) -> None:
        """The next queued batch to the worker thread, behind any step in flight."""
        ready = self._queue.popleft()
        index = self.step + len(self._running)
        self._handed = index  # before the submit: the worker reads it when the step is done
        stepped = self._submit(self._stepping, ready, index)
        stepped.add_done_callback(functools.partial(self._stepped, index))
        self._running.append((ready, stepped))

    @property
    def _bursting(self) -> bool:
        """Results come in bursts: steps run ahead (one process, a consumer that set snapshot_wanted) and
        burst_span_s holds two or more of the last one (none before the first step)."""
        return self._burst_size >= 2 and self.snapshot_wanted is not None and self.ranks is None

    async def _put_back(self) -> None:
        """The batches handed to the worker but not begun before a stop go back to the front of the queue
        (a checkpoint then holds them as waiting), in their order."""
        for _, stepped in self._running:
            await self._result_of(stepped)  # each returns at once: the stop came before it began
        self._queue.extendleft(ready for ready, _ in reversed(self._running))
        self._running.clear()

    @property
    def _burst_size(self) -> int:
        """Steps in a burst: `burst_span_s` of them at the last step's pace, 1 to `burst`."""
        return min(self.burst, max(1, int(self.burst_span_s / max(self._step_s, 1e-6))))

    def _stepped(self, index: int, stepped: concurrent.futures.Future) -> None:
        """In the worker, once step `index` is done: wake the event loop for its result, unless results
        come in bursts and more than one step was handed over behind this one. The wake-up at the
        next to last leaves the worker the last one to learn while the consumer takes in the burst
        and hands over the next."""
        if (not self._bursting or index >= self._handed - 1
                or stepped.cancelled() or stepped.exception() is not None):
            with contextlib.suppress(RuntimeError):  # the event loop closed under an abort: nobody waits
                self._event_loop.call_soon_threadsafe(self._results.set)

    async def _result_of(self, stepped: concurrent.futures.Future) -> StepResult | None:
        """The step's result once the worker has woken the event loop for it (or for a later one)."""
        while not stepped.done():
            self._results.clear()
            if stepped.done():
                break
            await self._results.wait()
        return stepped.result()

    def _run_ahead(self) -> None:
        """While a step runs and its result is not yet taken in, queue the next batch behind it, so that
        the worker goes on without waiting for the consumer (the loss log, the metrics, the hand-over's
        two thread wake-ups: 0.6 ms a batch of the default LSTM, 4% of its step) unless anything needs
        the state after a step in flight: `snapshot_wanted` (a checkpoint due, a probe before the next
        batch), a snapshot_point() asked for (a rebalance), a stop; never for ranks, which agree first.
        While steps are short, a burst of batches goes behind it (results then come in bursts), each
        asked for in turn."""
        if self.snapshot_wanted is None or self.ranks is not None or not self._running:
            return
        self._queue_ahead(self._burst_size + 1 if self._bursting else 2)
        if self._bursting and len(self._queue) <= self._refill_at:
            self._changed.set()  # the fetch side refills at this wake-up, not at one of its own (_stepping)

    def _queue_ahead(self, ahead: int) -> None:
        """Hand over batches until `ahead` steps are in flight, asking for each as _run_ahead says."""
        while len(self._running) < ahead and self._queue:
            index = self.step + len(self._running)
            self._check_stop()
            if (self.stop_reason is not None or self._snapshot_asked or (self.max_batches and index >= self.max_batches)
                    or (self.total_batches and index >= self.total_batches)):
                return
            previous = next((ready.truth for ready, _ in reversed(self._running) if ready.truth), self.truth)
            if self.snapshot_wanted(index, self._queue[0], previous):
                return
            self._hand_over()

    def _stepping(self, ready: ReadyBatch, index: int) -> StepResult | None:
        """Step `index`, in the worker thread, where the steps run one after another: the last loss it
        stands in for a non-finite one is the worker's own; None, learning nothing, when `stop()` came
        before it began (one process only: ranks agreed to step). Only once the step runs is the fetch side
        told there is room in the queue: refilled on the event loop before, the refill's Python held
        the GIL the worker needed to start (0.4 ms a batch of the default LSTM); now it runs beside the
        step's torch kernels. And only once the queue is down to `_refill_at` batches (a stale length
        read here only moves the wake-up to the next step): the fetch side then cuts them in one burst,
        where a wake-up a batch found its Python and data cold in the caches the step had just used.
        While results come in bursts the event loop is awake for them anyway: _run_ahead asks then."""
        if self._halting and self.ranks is None:
            return None
        if len(self._queue) <= self._refill_at and not self._bursting:  # in bursts: _run_ahead asks
            self._event_loop.call_soon_threadsafe(self._changed.set)
        started = time.perf_counter()
        if self._lockstep_from is not None:  # ranks, every one with its batch: the agreement and hand-over
            self.busy_s += started - self._lockstep_from  # are the price of stepping together, not idle
        stalled = distributed.stalled_s()
        result = prequential_step(self.strategy, ready.batch, ready.truth, index, self._stepped_loss)
        self._stepped_loss = result.loss
        # the worker's own time for it, not the step's timings: whatever holds the worker delays the results
        ended = time.perf_counter()
        self._step_s = ended - started
        self.busy_s += self._step_s - (distributed.stalled_s() - stalled)  # (a rank that held its all-reduce)
        self._lockstep_from = ended if self.ranks is not None else None
        return result

    @contextlib.asynccontextmanager
    async def snapshot_point(self):
        """`async with loop.snapshot_point():` waits until no step is in flight and the last result has
        been taken in by the loop's consumer (monitor, loss log, probes), and keeps the next batch from
        starting meanwhile (no step runs ahead while one is asked for). For callers outside the
        consumer (a rebalance callback); the consumer, between two results, must not use it (it would
        wait forever)."""
        self._snapshot_asked += 1
        try:
            async with self._between_results:
                yield
        finally:
            self._snapshot_asked -= 1

    async def peek(self) -> ReadyBatch | None:
        """The next batch to learn, with its truth, once the fetch side has cut it (it stays next);
        None when the loop stops first. Probes at a switch ask for it before the batch is learned."""
        self._peeking += 1
        try:
            while True:
                self._check_stop()
                if self.stop_reason is not None:
                    return None
                if self._queue:
                    self.waiting_since = None
                    return self._queue[0]
                self._changed.clear()
                await self._changed_within(0.5)
                if self._fetcher is not None and self._fetcher.done():
                    self._fetcher.result()  # re-raise a failure of the fetch side
        finally:
            self._peeking -= 1

    @property
    def at_rest(self) -> bool:
        """A snapshot point that lasts until the next batch comes: no step in flight, the last result taken in,
        and the loop's consumer waiting for the next batch, in the loop or in a probe's peek (which holds the
        point: snapshot_point would wait for it). A snapshot copied now, on the event loop, is one of "after the
        last result" (the idle checkpoint, streamer.learner)."""
        return not self._running and (not self._between_results.locked() or self._peeking > 0)

    async def _agreed(self) -> ReadyBatch | None:
        """The next batch once every rank has its own (all step), None once any rank stops (all stop). The
        time since the last step counts as the step's (busy_s) only where no rank waited for records: each
        says in the agreement whether it had to (its queue empty when it came here, or a round without a
        step), as a rank that waits for its records before it agrees holds the others in the all-gather."""
        lockstep = bool(self._queue)
        while True:
            await self._ready_or_stopped(self.agree_every_s)
            has_batch = bool(self._queue)
            votes = json.dumps(self._queue[0].votes).encode() if has_batch else b""
            stalled = distributed.stalled_s()
            agreed = await self.in_worker(self.ranks.agree, has_batch, self.stop_reason,
                                          self.checkpoint_wanted(), self._records_read(),
                                          has_batch or self._more(), self.total_records,
                                          time.monotonic() - self._reported_at >= self.lag_every_s,
                                          self._idle(), votes, not (lockstep and has_batch))
            others_wait = has_batch and not agreed.go and agreed.stop_reason is None
            lockstep = (lockstep and has_batch and not others_wait and not agreed.waited
                        and distributed.stalled_s() == stalled)  # (a rank held it: no step's time)
            waited = self._others_waiting  # (a wait that outlasted its freshness, a hang, starts anew)
            self._others_waited_at = time.monotonic() if others_wait else None
            if not others_wait:
                self._others_waiting_since = None
            elif not waited:
                self._others_waiting_since = time.time()
            if agreed.stop_reason is not None:
                await self._read_lag(now=True)  # the last records taken, for the stop's report
                await self._report()
                self.stop_reason = self.stop_reason or agreed.stop_reason
                return None
            if agreed.report:
                await self._report()
            if agreed.go:
                self.checkpoint_agreed, self.waiting_since = agreed.checkpoint, None
                if not lockstep or self._checkpoint_between:  # (a checkpoint's time is the clock's own activity)
                    self._lockstep_from = None
                self._checkpoint_between = agreed.checkpoint  # taken after this step, before the next agreement
                if agreed.votes is not None:  # rank 0: the global batch's truth (_global_truth)
                    self._queue[0] = dataclasses.replace(self._queue[0], truth=_global_truth(agreed.votes))
                return self._queue[0]

    async def _report(self) -> None:
        """This rank's records, lag, dead letters and records read again to rank 0 (a gather in the worker
        thread, where every rank runs its collectives in the same order), kept there as the other ranks' reports."""
        own = {"records": self.records, "lag": self.lag, "dead_letters": self.dead_letters,  # (JSON: keys as text)
               "read_again": self.read_again, "waiting_for": self.waiting_for}
        parts = await self.in_worker(self.ranks.gather_bytes, json.dumps(own).encode())
        self._reported_at = time.monotonic()
        if parts is not None:
            self._reports = {rank: _report_from(part) for rank, part in enumerate(parts) if rank != self.ranks.rank}

    def checkpointed_parts(self, parts: list[RankPart]) -> None:
        """Rank 0, from the worker thread that gathered a checkpoint's `parts` (every rank's, in rank order):
        the other ranks' records, dead letters and records read again as that checkpoint holds them, their
        lag as last reported.
        The checkpoint after the stop holds what the ranks read after the stop's report: the run's last
        figures count it. Never raises (a checkpoint is not failed for a figure shown)."""
        counts = {rank: (part.loop["records"], dict(part.loop["dead_letters"]), part.loop.get("read_again", 0))
                  for rank, part in enumerate(parts) if rank != self.ranks.rank}  # not the parts' tensors

        def take() -> None:
            for rank, (records, dead_letters, read_again) in counts.items():
                reported = self._reports.get(rank, {})
                self._reports[rank] = {"records": records, "lag": reported.get("lag", {}), "dead_letters": dead_letters,
                                       "read_again": read_again, "waiting_for": reported.get("waiting_for", ())}
        with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile: nobody left to show them
            self._event_loop.call_soon_threadsafe(take)

    async def _ready_or_stopped(self, wait_s: float) -> None:
        """Until this rank has a batch, a stop condition holds, or `wait_s` has passed (ranks: the end of
        the stream, total_records, is agreed, the records being spread over them)."""
        deadline = time.monotonic() + wait_s
        while True:
            self._check_stop()
            remaining = deadline - time.monotonic()
            if self.stop_reason is not None or self._queue or remaining <= 0:
                return
            self._changed.clear()
            await self._changed_within(min(remaining, 0.5))
            if self._fetcher is not None and self._fetcher.done():
                self._fetcher.result()  # re-raise a failure of the fetch side

    def submit(self, function, *args) -> asyncio.Future:
        """`function(*args)` queued in the model's worker thread now (collectives keep their order on
        every rank); await the returned future for its result."""
        return asyncio.wrap_future(self._submit(function, *args))

    async def in_worker(self, function, *args):
        """Run `function(*args)` in the model's worker thread, after any step in flight."""
        return await self.submit(function, *args)

    def _submit(self, function, *args) -> concurrent.futures.Future:
        """Everything the worker runs goes through here (on the event loop's thread), so that the stop
        knows what is still in flight."""
        future = self._worker.submit(function, *args)
        self._submitted = [*(f for f in self._submitted if not f.done()), future]
        return future

    def stop(self, reason: str = "signal") -> None:
        """Stop after the step in flight (a signal handler on the event loop calls it): the loop then
        yields no further result; the fetch side is cancelled when the `async with` block ends."""
        self.stop_reason = self.stop_reason or reason
        self._halting = True  # steps handed to the worker and not yet begun learn nothing (_put_back)
        self._changed.set()

    async def commit(self, offsets: dict) -> bool:
        """Commit `offsets` ({(topic, partition): next offset}) to Kafka; call it only with offsets a
        written checkpoint covers (state_dict()["offsets"]); False when Kafka refused them, and at once
        while the broker is lost (the checkpoint holds them; the next one commits them)."""
        if self.broker_lost_since is not None:
            return False
        return await self.source.commit(offsets)

    def _count_failed_sends(self) -> None:
        """Dead-letter sends that failed (the source counts them since it started): counted, never raised,
        with those before a resume."""
        failed = getattr(self.source, "dead_letter_failures", 0)
        if failed:
            self.dead_letters["dead_letter_failed"] = self._failed_before + failed

    def state_dict(self) -> dict:
        """The loop's side of a snapshot, read at a snapshot point on the event loop: the batcher's
        carry-over, the batches cut but not yet learned, and per partition the offset before which every
        record is learned or carried over (OffsetTracker.kept_positions: Kafka may have them committed)."""
        self._count_failed_sends()
        return {
            "step": self.step, "tokens": self.tokens, "records": self.records, "skipped": self.skipped,
            "last_loss": self.last_loss,
            "dead_letters": dict(self.dead_letters), "read_again": self.read_again,
            "truth": None if self.truth is None else (self.truth.class_name, self.truth.fragment),
            "batcher": self.batcher.state_dict(),
            "waiting": [_ready_to_plain(ready) for ready in self._queue],
            "offsets": self.batcher.offsets.kept_positions(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after a snapshot (call before `async with`; the source seeks to the batcher's next positions)."""
        self.step, self.tokens, self.records = state["step"], state["tokens"], state["records"]
        self.skipped, self.last_loss = state.get("skipped", 0), state.get("last_loss", float("nan"))
        self._stepped_loss = self.last_loss
        self.dead_letters = Counter(state.get("dead_letters", {}))
        self._failed_before = self.dead_letters["dead_letter_failed"]
        self.read_again = state.get("read_again", 0)  # (none in a checkpoint of an earlier build)
        self.truth = None if state["truth"] is None else BatchTruth(*state["truth"])
        self.batcher.load_state_dict(state["batcher"])
        self._queue = deque(_ready_from_plain(saved, self.batcher) for saved in state["waiting"])

    def _check_stop(self) -> None:
        now = time.monotonic()
        if self.max_batches and self.step >= self.max_batches:
            self.stop_reason = self.stop_reason or "max_batches"
        if self.total_batches and self.step >= self.total_batches:
            self.stop_reason = self.stop_reason or "end_of_stream"
        if (self.ranks is None  # ranks: agreed (their records add up to it)
                and self.total_records and self._records_read() >= self.total_records and not self._queue
                and not self._more()):  # every record read and batched: what remains is less than a batch
            self.stop_reason = self.stop_reason or "end_of_stream"  # (before idle: a word model's end, whose
            # records were all read more than idle_timeout_s before its learning ended, said idle)
        if self.max_seconds and now - self._started >= self.max_seconds:
            self.stop_reason = self.stop_reason or "time_limit"
        if self.ranks is None and not self._queue and self._idle(now):  # ranks: agreed (every rank idle)
            self.stop_reason = self.stop_reason or "idle"

    def _idle(self, now: float | None = None) -> bool:
        """No record read for `idle_timeout_s` (this process's own partitions)."""
        now = time.monotonic() if now is None else now
        return bool(self.idle_timeout_s) and now - self._last_record >= self.idle_timeout_s

    async def _changed_within(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the fetch side to say something changed (asyncio.timeout, not
        wait_for: a cancel landing as the event is set must not be lost, see _ended)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()

    async def _fetch(self) -> None:
        """The Kafka side: read, decode, dead-letter, batch; waits while the queue is full."""
        batcher = self.batcher
        hold = getattr(self.source, "hold", None)  # a Kafka source; an in-memory one has all it will have
        self._cut_at, self._cut_wall = time.monotonic(), time.time()
        while not self._closing:
            held, sought = set(), set()
            self._log_changes()
            await self._cut_ready()  # (a checkpoint taken while the queue was full holds a batch ready to cut)
            if self._skips:
                for tp, offset in batcher.rewinds(self.keep_windows).items():
                    self.source.seek(tp, offset)
            if hold is not None:  # a held partition may have records: not caught up while one is held
                held = hold(self._partitions_ahead())
            again = self._skips and batcher.offsets.reading_again(besides=held)  # (a held one is not fetched)
            got = False  # records this fetch returned: taken, or passed over, skipped or dropped by a seek
            async for fetched in self.source.fetch(max_records=self.reread_records if again else None):
                self._last_record, got = time.monotonic(), True
                if fetched.tp in sought:  # a jump's seek (_admitted) passes it over: read before (a source that
                    # says its fetch's last offset seeks only past it), or, from one that does not, read again later
                    self.read_again += 1
                    continue
                if self._skips and not self._admitted(fetched, sought):
                    continue
                rejected = None if fetched.record is None else _rejected(batcher, fetched, self.ranks)
                if fetched.record is None or rejected:  # the offset advances; the record never reaches the model
                    reason, detail = rejected or (fetched.dead_reason, "")
                    # sent before it counts as taken: a stop that cancels the send reads it again (at least once)
                    await self.source.send_dead_letter(fetched, reason, detail)
                    self.records += 1
                    batcher.offsets.seen(fetched.tp, fetched.offset)
                    batcher.offsets.finish(fetched.tp, fetched.offset)
                    self.dead_letters[reason] += 1
                    continue
                self.records += 1
                batcher.add(fetched.record, fetched.tp, fetched.offset)
                await self._cut_ready()
            self._count_failed_sends()
            self._log_changes()
            await self._read_lag(now=not got)  # a fetch with nothing: caught up, say so at once
            self.waiting_for = self._streams_waited_for()
            if self.waiting_for:  # waiting for records, of these streams, since the last batch
                self.waiting_since = self._cut_wall
            elif self._starved():  # records come, too few for a batch: caught up all the same
                self.waiting_since = self.waiting_since or max(self._cut_wall, self._learned_wall)
            elif self._queue or got:  # (a rereading's fetch may take none of its records, and it is not caught up)
                self.waiting_since = None
            elif self.waiting_since is None and not held:  # caught up: nothing to learn, nothing arrived
                self.waiting_since = time.time()
            self._changed.set()  # a fetch ended: stop conditions may hold now

    def _log_changes(self) -> None:
        """What the source found changed in its topic's logs (a Kafka source's take_gaps and refusal): records
        deleted before they were read are counted as dead letters (deleted_before_read) and the offsets read on
        past them; a log that is not the learner's any more (re-created or truncated) stops the loop
        ("log_changed": the learner checkpoints what it learned, and says the source's line)."""
        take_gaps = getattr(self.source, "take_gaps", None)
        for tp, beginning, lost in take_gaps() if take_gaps is not None else ():
            self.batcher.offsets.deleted_before(tp, beginning)
            self.dead_letters["deleted_before_read"] += lost
        if getattr(self.source, "refusal", None) is not None and self.stop_reason is None:
            self.stop("log_changed")

    async def _cut_ready(self) -> None:
        """Cut every batch the batcher has ready into the queue, waiting for room (backpressure: the worker is
        behind)."""
        while self.batcher.ready():
            if len(self._queue) >= self._queue_size:
                await self._room()
            self._queue.append(self.batcher.pop())
            self._cut()
            self.waiting_since = None
            self._changed.set()

    def _admitted(self, fetched, sought: set) -> bool:
        """Whether to take a record read (Batcher.admit): not one skipped (its stream holds too much) nor
        one taken already. A jump past the fetch's last record of its partition seeks it on, and the fetch's
        further records of it, which lie before the jump's end, are passed over (`sought`); one to an offset
        the fetch holds reads on to it (Batcher.admit passes over or skips what lies between)."""
        stream = None if fetched.record is None else fetched.record.stream
        self.read_again += self.batcher.offsets.read_before(fetched.tp, fetched.offset)
        admitted = self.batcher.admit(fetched.tp, fetched.offset, stream, self.keep_windows)
        if admitted == "take":
            return True
        onward = self.batcher.offsets.next_positions()[fetched.tp] if admitted == "jump" else None
        if onward is not None and (fetched.last is None or onward > fetched.last + 1):  # else read on to it
            self.source.seek(fetched.tp, onward)  # (a seek drops the fetch's further records: fetched again)
            sought.add(fetched.tp)
        if (admitted != "pass" and fetched.tp not in self._skips_said  # (a jump passes a record over, or skips it)
                and (skipped := self.batcher.skipped_streams(fetched.tp))):
            self._skips_said.add(fetched.tp)
            streams = (f"stream {skipped[0]} holds" if len(skipped) == 1
                       else f"streams {', '.join(map(str, skipped))} hold")
            self._log(f"partition {fetched.tp[1]}: {streams} more than {self.keep_windows} windows while the learning "
                      f"waits for another; further records stay in Kafka, read again from offset {fetched.offset} "
                      "once there is room (said once a partition)")
        return False

    def _cut(self) -> None:
        """A batch was cut: the quiet time (_quiet) starts anew, and the learning waits for no stream."""
        self._cut_at, self._cut_wall = time.monotonic(), time.time()
        self.waiting_for = ()

    def _quiet(self) -> bool:
        """No batch waits in the queue, and none has been cut for `hold_quiet_s`."""
        return not self._queue and time.monotonic() - self._cut_at >= self.hold_quiet_s

    def _starved(self) -> bool:
        """The learning waits for records while some arrive: nothing to learn or being learned (_quiet, no
        step in flight), nothing left unread in Kafka (the lag), yet the records read since the last cut
        make no batch (a stream far slower than the others, or late, before any holds `ahead_windows`
        windows more: then _streams_waited_for names it). It showed as consuming, counted as compute."""
        return self._quiet() and not self._running and bool(self.lag) and not any(self.lag.values())

    def _streams_waited_for(self) -> tuple[int, ...]:
        """The streams the learning waits for now: no batch has been cut for `hold_quiet_s`, records were
        read after that or the others' are left in Kafka (Batcher.admit) (the others go on sending: not a
        pause of every stream), and the next batch needs a window of these (Batcher.short_streams) while
        another stream holds more than `ahead_windows` windows (Batcher.far_ahead): a stream that stopped
        sending, one far slower than the others, or one whose records lie further on in the topic. ()
        again from the next cut. (A backlog read past within `hold_quiet_s` of the last cut, after which
        nothing arrives, left the lag above 0 with no stream named: StreamerLearnerStalled said stuck.)"""
        if (not self._quiet() or not self.batcher.far_ahead(self._ahead_at)
                or (self._last_record < self._cut_at + self.hold_quiet_s
                    and not self._left_in_kafka())):
            return ()
        return self.batcher.short_streams()

    @property
    def streams_waited_for(self) -> tuple[int, ...]:
        """`waiting_for` of the whole learner: this rank's and, on rank 0 of ranks, the other ranks'
        as of their last report."""
        streams = set(self.waiting_for)
        for report in self._reports.values():
            streams.update(report.get("waiting_for", ()))
        return tuple(sorted(streams))

    def _partitions_ahead(self) -> set:
        """The partitions to leave unread for the next fetch (Batcher.ahead): none once no batch has been
        cut for `hold_quiet_s`, until the next one is, so that a short stream whose records are behind
        another's in a held partition (fewer partitions than streams, a stream that starts late, records
        of a stream moved to another partition) is read at full speed, as before there were holds."""
        if time.monotonic() - self._cut_at >= self.hold_quiet_s:
            return set()
        return self.batcher.ahead(self._ahead_at)

    async def _room(self) -> None:
        """With the queue full: wait until the worker has taken it down to `_refill_at` batches, which
        the fetch side then cuts in one burst (`_stepping` wakes it only then). The lag is read on
        meanwhile: a fetch's records can hold the fetch side here for as long as the model takes to
        learn them (a backlog after a restart), and a lag read only between fetches stood still."""
        ends = await self._arrived(None)
        while len(self._queue) > self._refill_at:
            self._changed.clear()
            await self._changed_within(self.lag_every_s)
            await self._read_lag()
            ends = await self._arrived(ends)

    async def _arrived(self, before: dict | None) -> dict | None:
        """Ranks with an idle timeout, while this rank's fetch side waits for room (its batches wait for
        another rank's): records written to its partitions since `before` (their log ends as last asked)
        count as read (_idle), as one process, which has no batch to learn while a stream is waited for
        and reads on, would have read them. Returns the log ends now (None: not asked)."""
        log_ends = getattr(self.source, "log_ends", None)
        if self.ranks is None or not self.idle_timeout_s or log_ends is None:
            return None
        ends = await log_ends()
        if before is not None and any(end > before.get(tp, end) for tp, end in ends.items()):
            self._last_record = time.monotonic()
        return ends or before

    async def _read_lag(self, *, now: bool = False) -> None:
        """`lag` anew (`now`, else at most every `lag_every_s`): per partition, the records not yet taken
        into the batcher (read, decoded, dead-lettered or batched): those beyond the furthest one read,
        and those read past (Batcher.admit) and not yet read again. A read that takes longer than
        `lag_every_s` (a lost broker) leaves the last one."""
        if now or time.monotonic() - self._lag_read_at >= self.lag_every_s:
            self._lag_read_at = time.monotonic()
            offsets = self.batcher.offsets
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lag_every_s):
                    lag = await self.source.lag(offsets.next_positions(), offsets.read_positions())
                for (_, partition), unread in offsets.unread_in().items():
                    if partition in lag:  # (an assigned partition)
                        lag[partition] += unread
                self.lag = lag

    async def _watch_ranks(self, every_s: float = 0.5) -> None:
        """Ranks: a collective held past distributed.STALL_S by another rank (stopped, hung or far slower) is
        said, and again when it ends: the other ranks waited in it without a word, their console 'consuming'."""
        said = None
        while not self._closing:
            await asyncio.sleep(every_s)
            since = distributed.in_collective_since()
            if said is None and since is not None and time.monotonic() - since >= distributed.STALL_S:
                said = since  # (a rank's lines say its rank: rank_process)
                self._log(f"the other ranks have not come to a collective for {distributed.STALL_S:g} s (a rank "
                          "stopped, stuck, far slower or writing a checkpoint); waiting for them")
            elif said is not None and since != said:
                self._log(f"the ranks meet again after {time.monotonic() - said:.0f} s")
                said = None

    async def _watch(self) -> None:
        """Lost, back, or away too long: see the module's docstring."""
        reachable = getattr(self.source, "reachable", None)
        if reachable is None:
            return
        where = getattr(self.source, "bootstrap_servers", "the broker")
        answered = time.monotonic()
        while True:
            await asyncio.sleep(self.probe_every_s)
            if self._closing:
                return
            ok = await reachable()
            if self._closing:
                return
            self._log_changes()
            now = time.monotonic()
            if ok:
                if self.broker_lost_since is not None:
                    back = f"topic {self.source.topic} exists again at {where}" if self.topic_gone else \
                        f"Kafka at {where} is back"
                    self._log(f"{back} after {time.time() - self.broker_lost_since:.0f} s; rejoining the group, "
                              "reading on from the learner's own offsets")
                    self.broker_lost_since, self.topic_gone = None, False
                answered = now
                continue
            away = now - answered
            if self.broker_lost_since is None and away >= self.lost_after_s:
                self.broker_lost_since = time.time() - away
                self.topic_gone = getattr(self.source, "topic_gone", False)  # (deleted: the broker answers)
                timeout = f"{self.broker_timeout_s:g} s" if self.broker_timeout_s else "ever"
                lost = f"topic {self.source.topic} is gone from {where} (deleted {away:.0f} s ago)" \
                    if self.topic_gone else f"Kafka at {where} is lost (no answer for {away:.0f} s)"
                self._log(f"{lost}; keeping the model, waiting for it up to {timeout} (--broker-timeout)")
            if self.broker_timeout_s and away >= self.broker_timeout_s:
                self.stop("broker_lost")
                return


async def _ended(tasks: list[asyncio.Task], log, again_after_s: float = 1.0, say_after_s: float = 10.0) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again each `again_after_s` one
    that is still running (said in one line once `say_after_s` have passed). A task can lose its
    cancellation: on Python 3.11 `asyncio.wait_for` returns its inner result instead of raising when
    the cancel lands just as that result arrives (CPython gh-86296, fixed in 3.12), and the watch task
    awaited one every second (the broker probe), so a learner at its stop waited for that task for good
    (seen after `--max-batches`, "stopping" 14 minutes). This package's own waits use asyncio.timeout,
    which keeps a cancel; a library's may not."""
    pending, started, said = {task for task in tasks if not task.done()}, time.monotonic(), False
    try:
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=again_after_s)
            if pending and not said and time.monotonic() - started >= say_after_s:
                said = True
                log(f"still stopping: {', '.join(sorted(task.get_coro().__qualname__ for task in pending))} "
                    f"did not end when cancelled; cancelling again every {again_after_s:g} s")
    finally:  # retrieved, as gather(return_exceptions=True) did: a failure here is not the run's
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()


def _rejected(batcher, fetched, ranks=None) -> tuple[str, str] | None:
    """(reason, detail) when a record cannot reach the model; classifiers also reject unlabelled records.
    Under ranks a stream id of another rank's, on a partition this rank reads, says so (it said "more than 2
    stream ids" of a --streams 4 run whose producer hashed its keys to partitions, as Kafka's default does)."""
    record = fetched.record
    if not batcher.accepts(record.stream):
        streams = getattr(batcher, "streams", "?")
        if ranks is None:
            return "extra_stream", f"more than {streams} stream ids"
        every = streams * ranks.world
        known = stream_id(record.stream)
        if known is None or known >= every:  # an id past --streams, not another rank's: as one process says it
            return "extra_stream", f"more than {every} stream ids"
        first = getattr(batcher, "first_stream", 0)
        return "extra_stream", (
            f"stream id {record.stream!r} came on partition {fetched.tp[1]}, which rank {ranks.rank} reads for its "
            f"streams {first} to {first + streams - 1} of {every}: under ranks stream i must be on "
            "partition i % partitions (streamer produce sends it there; Kafka's default partitioner hashes the key)")
    rejects = getattr(batcher, "rejects", None)
    return rejects(record) if rejects else None


def _global_truth(parts: list[bytes]) -> BatchTruth | None:
    """Rank 0's truth of the global batch, voted from every rank's votes for its part (Ranks.agree). Its
    own rows' alone gave rank 0's streams' class and fragment, which differ from the others' where the
    streams switch apart (the `independent` schedule): the loss log, the CALM metrics and the report
    then differed from one process's. The other ranks keep their own (they write none of those)."""
    votes: Counter = Counter()
    for part in parts:
        for class_name, fragment, tokens in json.loads(part):
            votes[class_name, fragment] += tokens
    return vote(votes)


def _ready_to_plain(ready: ReadyBatch) -> dict:
    truth = None if ready.truth is None else (ready.truth.class_name, ready.truth.fragment)
    return {"inputs": ready.batch.inputs.cpu(), "targets": ready.batch.targets.cpu(),
            "labels_known": ready.batch.labels_known, "truth": truth,
            "commit": [(list(tp), offset) for tp, offset in ready.commit.items()],
            "votes": [list(each) for each in ready.votes]}


def _ready_from_plain(saved: dict, batcher) -> ReadyBatch:
    batch = Batch(saved["inputs"].to(batcher.device), saved["targets"].to(batcher.device), saved["labels_known"])
    truth = None if saved["truth"] is None else BatchTruth(*saved["truth"])
    votes = tuple(tuple(each) for each in saved.get("votes", ()))
    if not votes and truth is not None:  # a checkpoint from before 2026-11-29: its truth as the batch's one vote
        votes = ((truth.class_name, truth.fragment, batch.tokens),)
    return ReadyBatch(batch, truth, {tuple(tp): offset for tp, offset in saved["commit"]}, votes)


class Counts(NamedTuple):
    """What the learner has read (PrequentialLoop.across_ranks)."""

    records: int  # read: learned, carried over or dead-lettered
    lag: dict  # partition -> records not yet taken
    dead_letters: Counter  # reason -> records
    read_again: int  # records read again after a rewind (--keep-windows)


def _report_from(part: bytes) -> dict:
    """A rank's report (_report), its partitions back to ints."""
    report = json.loads(part)
    report["lag"] = {int(partition): lag for partition, lag in report["lag"].items()}
    return report
