"""The model's side of the prequential loop (streamer.loop): one worker thread where the steps run one after
another (predict -> record -> learn, streamer.step), and the steps handed to it, oldest first.

Everything the worker runs (steps, and the collectives of ranks) is submitted on the event loop's thread,
so that the loop's end knows what is still in flight. The worker wakes the event loop for results; while
results come in bursts (`bursting`), only when one step is left behind the one it finished."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from monitor.results import StepResult
from streamer import distributed
from streamer.batching import ReadyBatch
from streamer.spin import outlast
from streamer.step import prequential_step

__all__ = ["StepWorker"]


class StepWorker:
    """The worker thread of streamer.loop.PrequentialLoop, stepping `strategy` on the batches handed to it.
    `intake` is the loop's streamer.intake.Intake (told there is room in its queue); `agreement` its
    streamer.rank_agreement.RankAgreement (None: one process); `runs_ahead()` says whether steps may run
    ahead of the loop's consumer (one process, a consumer that set snapshot_wanted)."""

    def __init__(self, strategy, intake, agreement, *, burst: int, burst_span_s: float, runs_ahead):
        self.strategy, self.intake, self.agreement, self._runs_ahead = strategy, intake, agreement, runs_ahead
        self._executor: ThreadPoolExecutor | None = None
        self._submitted: list[concurrent.futures.Future] = []  # to the worker, those not done when last seen
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the one the loop runs on (start)
        # Steps handed to the worker, oldest first: (batch, future of its StepResult); up to burst + 1 ahead
        self.running: deque[tuple[ReadyBatch, concurrent.futures.Future]] = deque()
        # Results in bursts: while steps are short (`burst_span_s` holds two or more of the worker's last),
        # a burst (`burst_span_s` of steps, at most `burst`) runs ahead of the consumer, plus one, and the
        # worker wakes the event loop once one step is left behind the one it finished, not after each
        # (_stepped)
        self.burst, self.burst_span_s = max(1, burst), burst_span_s
        self._step_s = math.inf  # the worker's last step, wall seconds (none yet: no burst)
        self.busy_s = 0.0  # the worker's seconds in steps in this process (the console's compute time)
        self._results = asyncio.Event()  # the worker's wake-up: results are waiting
        self._handed = -1  # the index of the last step handed to the worker
        self.halting = False  # the loop was stopped: the worker begins no further step (one process)
        self.stepped_loss = float("nan")  # the worker's last recorded loss (a step's stand-in for a non-finite one)

    def start(self) -> None:
        """The worker thread, on the running event loop."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step")
        self._event_loop = asyncio.get_running_loop()

    def shutdown(self) -> None:
        """Begin no further work, and wait for the step in flight (not cut short by an interrupt)."""
        self._executor.shutdown(wait=False, cancel_futures=True)  # a step queued ahead never starts
        # the step in flight ends first, on a wait that an interrupt cannot cut short (Thread.join, in
        # shutdown's wait, on Python 3.11: then the exit aborted while the step was inside torch's C++);
        # not on those cancelled, which concurrent.futures.wait never counts as done (it hung on them)
        in_flight = [future for future in self._submitted if not future.done()]
        outlast(lambda: concurrent.futures.wait(in_flight))

    def abandon(self) -> None:
        """Let the worker thread go without waiting (nothing was handed to it: the loop did not start)."""
        self._executor.shutdown(wait=False)

    def submit(self, function, *args) -> concurrent.futures.Future:
        """Everything the worker runs goes through here (on the event loop's thread), so that the stop
        knows what is still in flight."""
        future = self._executor.submit(function, *args)
        self._submitted = [*(f for f in self._submitted if not f.done()), future]
        return future

    def hand_over(self, ready: ReadyBatch, index: int) -> None:
        """Batch `ready` to the worker thread as step `index`, behind any step in flight."""
        self._handed = index  # before the submit: the worker reads it when the step is done
        stepped = self.submit(self._stepping, ready, index)
        stepped.add_done_callback(functools.partial(self._stepped, index))
        self.running.append((ready, stepped))

    @property
    def bursting(self) -> bool:
        """Results come in bursts: steps run ahead (one process, a consumer that set snapshot_wanted) and
        burst_span_s holds two or more of the last one (none before the first step)."""
        return self.burst_size >= 2 and self._runs_ahead()

    @property
    def burst_size(self) -> int:
        """Steps in a burst: `burst_span_s` of them at the last step's pace, 1 to `burst`."""
        return min(self.burst, max(1, int(self.burst_span_s / max(self._step_s, 1e-6))))

    async def take_back(self) -> list[ReadyBatch]:
        """The batches handed to the worker but not begun before a stop, in their order (to go back to the
        front of the queue: a checkpoint then holds them as waiting)."""
        for _, stepped in self.running:
            await self.result_of(stepped)  # each returns at once: the stop came before it began
        batches = [ready for ready, _ in self.running]
        self.running.clear()
        return batches

    def _stepped(self, index: int, stepped: concurrent.futures.Future) -> None:
        """In the worker, once step `index` is done: wake the event loop for its result, unless results
        come in bursts and more than one step was handed over behind this one. The wake-up at the
        next to last leaves the worker the last one to learn while the consumer takes in the burst
        and hands over the next."""
        if (not self.bursting or index >= self._handed - 1
                or stepped.cancelled() or stepped.exception() is not None):
            with contextlib.suppress(RuntimeError):  # the event loop closed under an abort: nobody waits
                self._event_loop.call_soon_threadsafe(self._results.set)

    async def result_of(self, stepped: concurrent.futures.Future) -> StepResult | None:
        """The step's result once the worker has woken the event loop for it (or for a later one)."""
        while not stepped.done():
            self._results.clear()
            if stepped.done():
                break
            await self._results.wait()
        return stepped.result()

    def _stepping(self, ready: ReadyBatch, index: int) -> StepResult | None:
        """Step `index`, in the worker thread, where the steps run one after another: the last loss it
        stands in for a non-finite one is the worker's own; None, learning nothing, when the loop's `stop()`
        came before it began (one process only: ranks agreed to step). Only once the step runs is the fetch
        side told there is room in the queue: refilled on the event loop before, the refill's Python held
        the GIL the worker needed to start (0.4 ms a batch of the default LSTM); now it runs beside the
        step's torch kernels. And only once the queue is down to `refill_at` batches (a stale length
        read here only moves the wake-up to the next step): the fetch side then cuts them in one burst,
        where a wake-up a batch found its Python and data cold in the caches the step had just used.
        While results come in bursts the event loop is awake for them anyway: RunAhead.queue_behind asks then."""
        if self.halting and self.agreement is None:
            return None
        if len(self.intake.queue) <= self.intake.refill_at and not self.bursting:  # in bursts: queue_behind asks
            self._event_loop.call_soon_threadsafe(self.intake.changed.set)
        started = time.perf_counter()
        lockstep_from = None if self.agreement is None else self.agreement.lockstep_from
        if lockstep_from is not None:  # ranks, every one with its batch: the agreement and hand-over
            self.busy_s += started - lockstep_from  # are the price of stepping together, not idle
        stalled = distributed.stalled_s()
        result = prequential_step(self.strategy, ready.batch, ready.truth, index, self.stepped_loss)
        self.stepped_loss = result.loss
        # the worker's own time for it, not the step's timings: whatever holds the worker delays the results
        ended = time.perf_counter()
        self._step_s = ended - started
        self.busy_s += self._step_s - (distributed.stalled_s() - stalled)  # (a rank that held its all-reduce)
        if self.agreement is not None:
            self.agreement.lockstep_from = ended
        return result
