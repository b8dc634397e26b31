"""Steps that run ahead of the prequential loop's consumer (streamer.loop), and the snapshot points left.

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
4 and 0.20-0.25 with bursts of 16-32 (benchmarks/throughput.py)."""

from __future__ import annotations

import asyncio
import contextlib

from monitor.results import BatchTruth

__all__ = ["RunAhead"]


class RunAhead:
    """The hand-over of the batches in `intake`'s queue to the `worker` (streamer.step_worker.StepWorker),
    ahead of the loop's consumer where `snapshot_wanted` lets them; `limits` are the loop's
    StopConditions, `one_process` False for ranks (which agree before each step, so never run ahead),
    and `stopping()` checks the loop's stop conditions and says whether it stops."""

    def __init__(self, intake, worker, limits, *, one_process: bool, stopping):
        self.intake, self.worker, self.limits = intake, worker, limits
        self._one_process, self._stopping = one_process, stopping
        # Held from taking a batch until the consumer of its result asks for the next one with no
        # step in flight (none runs ahead): whoever holds it sees a snapshot point. The loop's own
        # consumer (between two results) is at one already and must not wait on it; others (a
        # rebalance callback) use `snapshot_point()`.
        self.between_results = asyncio.Lock()
        self._snapshot_asked = 0  # snapshot_point() callers waiting
        # Set by the consumer to let a step run ahead of its consumer: snapshot_wanted(index, upcoming, previous
        # truth) is asked before batch `index` (a ReadyBatch) is queued behind the step in flight, whose result
        # is then not yet taken in; True keeps it until then. None: every result is a snapshot point.
        self.snapshot_wanted = None

    @property
    def at_snapshot(self) -> bool:
        """No step in flight: the strategy, the carry-over and the offsets describe "after the last
        result". Always so between two results unless `snapshot_wanted` let the next step run ahead."""
        return not self.worker.running

    def hand_over(self, step: int) -> None:
        """The next queued batch to the worker thread, behind any step in flight (`step`: the loop's
        batches learned, so the next result's index)."""
        self.worker.hand_over(self.intake.queue.popleft(), step + len(self.worker.running))

    def queue_behind(self, step: int, truth: BatchTruth | None) -> None:
        """While a step runs and its result is not yet taken in, queue the next batch behind it, so that
        the worker goes on without waiting for the consumer (the loss log, the metrics, the hand-over's
        two thread wake-ups: 0.6 ms a batch of the default LSTM, 4% of its step) unless anything needs
        the state after a step in flight: `snapshot_wanted` (a checkpoint due, a probe before the next
        batch), a snapshot_point() asked for (a rebalance), a stop; never for ranks, which agree first.
        While steps are short, a burst of batches goes behind it (results then come in bursts), each
        asked for in turn. `truth`: the loop's, after its last result taken in."""
        if self.snapshot_wanted is None or not self._one_process or not self.worker.running:
            return
        self._queue_ahead(self.worker.burst_size + 1 if self.worker.bursting else 2, step, truth)
        if self.worker.bursting and len(self.intake.queue) <= self.intake.refill_at:
            self.intake.changed.set()  # the fetch side refills at this wake-up, not at one of its own (the worker's)

    def _queue_ahead(self, ahead: int, step: int, truth: BatchTruth | None) -> None:
        """Hand over batches until `ahead` steps are in flight, asking for each as queue_behind says."""
        while len(self.worker.running) < ahead and self.intake.queue:
            index = step + len(self.worker.running)
            if self._stopping() or self._snapshot_asked or self.limits.past_last_batch(index):
                return
            previous = next((ready.truth for ready, _ in reversed(self.worker.running) if ready.truth), truth)
            if self.snapshot_wanted(index, self.intake.queue[0], previous):
                return
            self.hand_over(step)

    @contextlib.asynccontextmanager
    async def snapshot_point(self):
        """`async with loop.run_ahead.snapshot_point():` waits until no step is in flight and the last result
        has been taken in by the loop's consumer (monitor, loss log, probes), and keeps the next batch from
        starting meanwhile (no step runs ahead while one is asked for). For callers outside the
        consumer (a rebalance callback); the consumer, between two results, must not use it (it would
        wait forever)."""
        self._snapshot_asked += 1
        try:
            async with self.between_results:
                yield
        finally:
            self._snapshot_asked -= 1
