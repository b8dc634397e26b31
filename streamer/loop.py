"""The prequential loop over a topic: an async generator of one StepResult per learned batch, in order.

    asyncio loop (Kafka side)                               single worker thread (model side)
    fetch -> decode -> dead-letter -> batch  ==bounded queue==>  predict -> record -> learn

The fetch side (streamer.intake.Intake) is a task on the event loop (the consumer's heartbeat runs there
too); the step runs in one worker thread, so a slow step never starves the heartbeat, and a full queue
pauses fetching (backpressure). The loop owns no monitor, exporter, view or file: whoever iterates it
reads the results and, between two results, the plain state below (step, queue_depth, ...) and its
rooms' (loop.intake: records, dead_letters, read_again, lag, waiting_since; loop.broker_watch:
lost_since). A watch task (streamer.broker_watch.BrokerWatch) says when the broker is lost and back,
and stops the loop ("broker_lost") once it is away for `broker_timeout_s`. Ranks of a distributed
learner start, step and stop together (streamer.rank_agreement.RankAgreement).

A consumer that sets `loop.run_ahead.snapshot_wanted` lets the next steps run ahead of it, in bursts
while steps are short (streamer.run_ahead.RunAhead); a result is then a snapshot point only where
`loop.run_ahead.at_snapshot` says so. `stop()` lets the running step finish; the steps queued behind it
learn nothing and their batches go back to the queue.

    async with PrequentialLoop(strategy, batcher, source, max_batches=...) as loop:
        async for result in loop:
            ...  # at a result where loop.run_ahead.at_snapshot (every one without snapshot_wanted): strategy,
                 # batcher carry-over and offsets describe "after batch result.index"
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from typing import AsyncIterator

from monitor.results import BatchTruth, StepResult
from streamer.batching import ReadyBatch
from streamer.broker_watch import BrokerWatch
from streamer.cancellation import tasks_ended
from streamer.checkpoint import RankPart
from streamer.intake import Intake, ready_from_plain, ready_to_plain
from streamer.rank_agreement import Counts, RankAgreement, counts_of
from streamer.run_ahead import RunAhead
from streamer.source import Source
from streamer.step_worker import StepWorker
from streamer.stop_conditions import StopConditions

__all__ = ["PrequentialLoop"]


class PrequentialLoop:
    """Learn batches from `source` (a streamer.source.Source: streamer.kafka.consumer.KafkaSource) until
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
        self.ranks = ranks  # streamer.distributed.Ranks; None: one process
        self.checkpoint_wanted = lambda: False  # rank 0's Checkpointer sets it: asked at each agreement
        self.checkpoint_agreed = False  # the last agreement asks for a checkpoint after its step
        self._log = log or (lambda line: None)
        self.limits = StopConditions(max_batches=max_batches, total_batches=total_batches, total_records=total_records,
                                     max_seconds=max_seconds, idle_timeout_s=idle_timeout_s)
        # the fetch side: reads, batches and keeps records, dead_letters, read_again, lag, waiting_for and
        # waiting_since (read on it: loop.intake.records)
        self.intake = Intake(batcher, source, queue_size=queue_size, lag_every_s=lag_every_s,
                             ahead_windows=ahead_windows, hold_quiet_s=hold_quiet_s, keep_windows=keep_windows,
                             reread_records=reread_records, idle_timeout_s=idle_timeout_s, ranks=ranks,
                             log=self._log, stop=self._stop_unless_stopping,
                             in_flight=lambda: bool(self.worker.running))
        # the broker watch: keeps lost_since and topic_gone
        self.broker_watch = BrokerWatch(source, probe_every_s=probe_every_s, lost_after_s=lost_after_s,
                                        broker_timeout_s=broker_timeout_s, log=self._log,
                                        each_probe=self.intake.log_changes, stop=self.stop)
        # ranks: what they agree on and report to each other; None: one process
        self.agreement = None if ranks is None else RankAgreement(
            ranks, self.intake, self.in_worker, self._ready_or_stopped, agree_every_s=agree_every_s,
            lag_every_s=lag_every_s, total_records=total_records, log=self._log)
        # the model's side: the worker thread where the steps run, and the steps handed to it (busy_s)
        self.worker = StepWorker(strategy, self.intake, self.agreement, burst=burst, burst_span_s=burst_span_s,
                                 runs_ahead=lambda: self.run_ahead.snapshot_wanted is not None and self.ranks is None)
        # the steps handed to the worker ahead of the consumer (snapshot_wanted), and the snapshot points left
        self.run_ahead = RunAhead(self.intake, self.worker, self.limits, one_process=ranks is None,
                                  stopping=self._stopping)
        # plain state, read between results
        self.step = 0  # batches learned; the next result's index
        self.tokens = 0
        self.skipped = 0  # batches whose update was skipped (non-finite loss or gradients)
        self.last_loss = float("nan")  # the last recorded loss; stands in for a non-finite one
        self.truth: BatchTruth | None = None  # the latest truth of a learned batch
        self.labels_known: int | None = None  # classifiers: labels known when the last batch was cut
        self.stop_reason: str | None = None
        self._peeking = 0  # peek()s waiting (at_rest)
        self._fetcher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._rank_watcher: asyncio.Task | None = None  # ranks: says a collective another rank holds

    # Limits, pacing and the log held by the rooms built in __init__ (StopConditions, Intake, BrokerWatch, StepWorker,
    # RankAgreement): set once there. An assignment on the loop would make a new attribute that nothing reads, so
    # it is refused.
    _CONSTRUCTOR_ONLY = frozenset({
        "max_batches", "total_batches", "total_records", "max_seconds", "idle_timeout_s", "queue_size",
        "broker_timeout_s", "probe_every_s", "lost_after_s", "burst", "burst_span_s", "lag_every_s",
        "ahead_windows", "hold_quiet_s", "keep_windows", "reread_records", "log", "agree_every_s"})
    # What the rooms keep, read and set on them (loop.intake.records): one set on the loop would go unread too.
    _KEPT_BY_ROOMS = frozenset({
        "records", "records_batched", "dead_letters", "read_again", "lag", "waiting_for", "waiting_since",
        "busy_s", "broker_lost_since", "topic_gone", "snapshot_wanted"})

    def __setattr__(self, name, value):
        if name in self._CONSTRUCTOR_ONLY:
            raise AttributeError(f"PrequentialLoop.{name} is set only by its constructor: its rooms hold it")
        if name in self._KEPT_BY_ROOMS:
            raise AttributeError(f"PrequentialLoop.{name} is kept by its rooms: set it on loop.intake, "
                                 "loop.worker, loop.broker_watch or loop.run_ahead")
        super().__setattr__(name, value)

    # The loop's live facts that combine its rooms; each room's own are read on it: loop.intake (records,
    # records_batched, dead_letters, read_again, lag, waiting_for, waiting_since, ahead_windows),
    # loop.worker (busy_s) and loop.broker_watch (lost_since, topic_gone)

    @property
    def consuming(self) -> bool:
        """Started, fetching, the broker answering, and not stopped: what /readyz reports."""
        return (self._fetcher is not None and not self._fetcher.done() and self.stop_reason is None
                and self.broker_watch.lost_since is None)

    @property
    def queue_depth(self) -> int:
        """Batches cut whose results are not yet taken in: those queued, and those handed to the worker (the
        step in flight among them; up to a burst of them). 0 only when the worker has nothing it can learn:
        a stuck step with nothing behind it shows 1, where the queue alone would show 0; a rank's queued
        batches while another rank has none of its own (the run waits for records, as one process whose
        streams are not all there to cut a batch) show 0, as long as the ranks' agreements keep coming (an
        agreement that hangs, a rank stuck, shows them)."""
        if self.agreement is not None and self.agreement.others_waiting and not self.worker.running:
            return 0
        return len(self.intake.queue) + len(self.worker.running)

    @property
    def waiting_for_records_since(self) -> float | None:
        """Wall time since when the learner waits for records (None: it does not): this process caught up
        (`waiting_since`), or (ranks) this rank has its next batch and another rank not, as long as the
        agreements keep coming (the learner as a whole cannot cut its next global batch)."""
        if self.intake.waiting_since is not None:
            return self.intake.waiting_since
        return None if self.agreement is None else self.agreement.others_waiting_since

    @property
    def streams_waited_for(self) -> tuple[int, ...]:
        """`waiting_for` of the whole learner: this rank's and, on rank 0 of ranks, the other ranks'
        as of their last report."""
        if self.agreement is None:
            return tuple(sorted(set(self.intake.waiting_for)))
        return self.agreement.streams_waited_for()

    def across_ranks(self) -> Counts:
        """Counts of the whole learner: this process's own and, on rank 0 of ranks, the other ranks' as of
        their last report (every `lag_every_s`, and at the stop)."""
        return counts_of(self.intake, {}) if self.agreement is None else self.agreement.across_ranks()

    def checkpointed_parts(self, parts: list[RankPart]) -> None:
        """Rank 0: the other ranks' figures as a checkpoint's `parts` hold them (RankAgreement.checkpointed_parts)."""
        self.agreement.checkpointed_parts(parts)

    async def __aenter__(self) -> PrequentialLoop:
        self.worker.start()
        try:
            try:
                started = await self._start_source()
            except Exception as exc:
                if self.ranks is not None:
                    await self.agreement.after_every_start(exc, self.source.stop)
                raise
            if self.ranks is not None:
                await self.agreement.after_every_start(None, self.source.stop)
        except BaseException:  # no __aexit__ follows
            self.worker.abandon()
            raise
        if not started:
            return self  # stopped while starting (a signal, --minutes or --idle-timeout while it waited)
        self.intake.last_record = time.monotonic()  # (--minutes counts from the loop's start: StopConditions)
        self._fetcher = asyncio.create_task(self._fetch())
        self._watcher = asyncio.create_task(self._watch())
        if self.ranks is not None:
            self._rank_watcher = asyncio.create_task(self._watch_ranks())
        return self

    async def __aexit__(self, *exc) -> None:
        for room in (self.intake, self.broker_watch, self.agreement):  # the fetch and watch tasks end at their next
            if room is not None:  # turn even if a cancel is lost
                room.closing = True
        try:  # (an interrupt, or asyncio.run's cancel, landing while they end still stops the worker)
            await tasks_ended([task for task in (self._fetcher, self._watcher, self._rank_watcher)
                               if task is not None], self._log)
            self.intake.count_failed_sends()  # (a stop may end the fetch side before its first fetch ends)
        finally:
            try:  # (the step in flight ends first; one queued ahead never starts)
                self.worker.shutdown()
            finally:  # an interrupt the wait held back still leaves the group
                await self.source.stop()

    async def end_fetching(self) -> None:
        """Once the loop has stopped, before the last checkpoint: the fetch side ended (nothing more is read or
        dead-lettered) and the dead-letter copies in flight settled (Intake.settle_dead_letters), so that the
        checkpoint counts them all. Otherwise __aexit__ ends the fetch side."""
        self.intake.closing = True
        await tasks_ended([self._fetcher] if self._fetcher is not None else [], self._log)
        await self.intake.settle_dead_letters()

    # The loop's own tasks, as tasks_ended names them in its line ("still stopping: PrequentialLoop._fetch ...")

    async def _fetch(self) -> None:
        """The fetch side's task (Intake.fetch)."""
        await self.intake.fetch()

    async def _watch(self) -> None:
        """The broker's watch task (BrokerWatch.watch)."""
        await self.broker_watch.watch()

    async def _watch_ranks(self) -> None:
        """Ranks: the task that says a collective another rank holds (RankAgreement.watch)."""
        await self.agreement.watch()

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
                self.stop_reason = self.limits.while_starting(missing)
            if self.stop_reason is not None and not starting.done():
                await tasks_ended([starting], self._log)
                return False
        starting.result()  # re-raise: the broker unreachable, the group shared
        return True

    async def __aiter__(self) -> AsyncIterator[StepResult]:
        # holding run_ahead.between_results: from taking a batch until a result is taken in with none in flight
        holding = False
        try:
            while True:
                if not self.worker.running:
                    # fetch -> batch: the fetch task has cut it; None: a stop condition (of any rank)
                    ready = await (self.peek() if self.ranks is None else self._agreed())
                    if ready is None:
                        if self.ranks is None:  # (ranks: read before the stop's report, _agreed)
                            await self.intake.read_lag(now=True)  # the last records taken since the last read
                        return
                    await self.run_ahead.between_results.acquire()
                    holding = True
                    if self.ranks is None and (not self.intake.queue or self.intake.queue[0] is not ready
                                               or self.stop_reason is not None):
                        self.run_ahead.between_results.release()  # changed while a snapshot was taken: look again
                        holding = False  # (ranks: agreed, so step)
                        continue
                    self.run_ahead.hand_over(self.step)
                self.run_ahead.queue_behind(self.step, self.truth)
                ready, stepped = self.worker.running[0]
                # predict -> record -> learn happened in the worker, in this order
                result = await self.worker.result_of(stepped)
                if result is None:  # stop() came before this step began: it and those behind it are not learned
                    self.intake.queue.extendleft(reversed(await self.worker.take_back()))
                    continue
                self.worker.running.popleft()
                self.intake.learned_wall = time.time()
                self.step += 1
                self.tokens += result.tokens
                self.skipped += result.skipped
                self.last_loss = result.loss
                self.truth = result.truth or self.truth
                self.labels_known = ready.batch.labels_known
                # SNAPSHOT POINT where run_ahead.at_snapshot: strategy, carry-over and offsets describe
                # "after batch result.index"
                yield result
                if not self.worker.running:
                    self.run_ahead.between_results.release()
                    holding = False
        finally:
            if holding:
                self.run_ahead.between_results.release()

    async def peek(self) -> ReadyBatch | None:
        """The next batch to learn, with its truth, once the fetch side has cut it (it stays next);
        None when the loop stops first. Probes at a switch ask for it before the batch is learned."""
        self._peeking += 1
        try:
            await self._ready_or_stopped(math.inf)
        finally:
            self._peeking -= 1
        if self.stop_reason is not None:
            return None
        self.intake.waiting_since = None
        return self.intake.queue[0]

    @property
    def at_rest(self) -> bool:
        """A snapshot point that lasts until the next batch comes: no step in flight, the last result taken in,
        and the loop's consumer waiting for the next batch, in the loop or in a probe's peek (which holds the
        point: run_ahead.snapshot_point would wait for it). A snapshot copied now, on the event loop, is one of
        "after the last result" (the idle checkpoint, streamer.learner)."""
        return not self.worker.running and (not self.run_ahead.between_results.locked() or self._peeking > 0)

    async def _agreed(self) -> ReadyBatch | None:
        """Ranks: the next batch once every rank has its own (all step), None once any rank stops (all stop)
        (RankAgreement.agreed)."""
        agreed = await self.agreement.agreed(lambda: self.stop_reason, lambda: self.checkpoint_wanted())
        if agreed.stop_reason is not None:
            self.stop_reason = self.stop_reason or agreed.stop_reason
            return None
        self.checkpoint_agreed, self.intake.waiting_since = agreed.checkpoint, None
        return self.intake.queue[0]

    async def _ready_or_stopped(self, wait_s: float) -> None:
        """Until the fetch side has cut a batch, a stop condition holds, or `wait_s` has passed (peek waits
        without end; ranks wait a while: the end of the stream, total_records, is agreed, the records being
        spread over them)."""
        deadline = time.monotonic() + wait_s
        while True:
            self._check_stop()
            remaining = deadline - time.monotonic()
            if self.stop_reason is not None or self.intake.queue or remaining <= 0:
                return
            self.intake.changed.clear()
            await self.intake.changed_within(min(remaining, 0.5))
            if self._fetcher is not None and self._fetcher.done():
                self._fetcher.result()  # re-raise a failure of the fetch side

    def submit(self, function, *args) -> asyncio.Future:
        """`function(*args)` queued in the model's worker thread now (collectives keep their order on
        every rank); await the returned future for its result."""
        return asyncio.wrap_future(self.worker.submit(function, *args))

    async def in_worker(self, function, *args):
        """Run `function(*args)` in the model's worker thread, after any step in flight."""
        return await self.submit(function, *args)

    def stop(self, reason: str = "signal") -> None:
        """Stop after the step in flight (a signal handler on the event loop calls it): the loop then
        yields no further result; the fetch side is cancelled when the `async with` block ends."""
        self.stop_reason = self.stop_reason or reason
        self.worker.halting = True  # steps handed to the worker and not yet begun learn nothing (take_back)
        self.intake.changed.set()

    def _stop_unless_stopping(self, reason: str) -> None:
        """stop(reason), unless a stop condition or a stop came first."""
        if self.stop_reason is None:
            self.stop(reason)

    async def commit(self, offsets: dict) -> bool:
        """Commit `offsets` ({(topic, partition): next offset}) to Kafka; call it only with offsets a
        written checkpoint covers (state_dict()["offsets"]); False when Kafka refused them, and at once
        while the broker is lost (the checkpoint holds them; the next one commits them)."""
        if self.broker_watch.lost_since is not None:
            return False
        return await self.source.commit(offsets)

    def state_dict(self) -> dict:
        """The loop's side of a snapshot, read at a snapshot point on the event loop: the batcher's
        carry-over, the batches cut but not yet learned, and per partition the offset before which every
        record is learned or carried over (OffsetTracker.kept_positions: Kafka may have them committed)."""
        self.intake.count_failed_sends()
        return {
            "step": self.step, "tokens": self.tokens, "records": self.intake.records, "skipped": self.skipped,
            "last_loss": self.last_loss,
            "dead_letters": dict(self.intake.dead_letters), "read_again": self.intake.read_again,
            "truth": None if self.truth is None else (self.truth.class_name, self.truth.fragment),
            "batcher": self.batcher.state_dict(),
            "waiting": [ready_to_plain(ready) for ready in self.intake.queue],
            "offsets": self.batcher.offsets.kept_positions(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after a snapshot (call before `async with`; the source seeks to the batcher's next positions)."""
        self.step, self.tokens, self.intake.records = state["step"], state["tokens"], state["records"]
        self.skipped, self.last_loss = state.get("skipped", 0), state.get("last_loss", float("nan"))
        self.worker.stepped_loss = self.last_loss
        self.intake.dead_letters = Counter(state.get("dead_letters", {}))
        self.intake.failed_before = self.intake.dead_letters["dead_letter_failed"]
        self.intake.read_again = state.get("read_again", 0)  # (none in a checkpoint of an earlier build)
        self.truth = None if state["truth"] is None else BatchTruth(*state["truth"])
        self.batcher.load_state_dict(state["batcher"])
        self.intake.queue = deque(ready_from_plain(saved, self.batcher) for saved in state["waiting"])

    def _stopping(self) -> bool:
        """Whether the loop stops, the stop conditions checked first (_check_stop)."""
        self._check_stop()
        return self.stop_reason is not None

    def _check_stop(self) -> None:
        """stop_reason, unless set, from the stop conditions that hold now (StopConditions.reached)."""
        reached = self.limits.reached(self.step, self.intake, self.ranks is None)
        self.stop_reason = self.stop_reason or reached

