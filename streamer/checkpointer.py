"""`Checkpointer`: when and how a run's state is written (streamer.checkpoint's format) and the offsets
it holds committed.

A run copies its state at a snapshot point (streamer.checkpoint.copied: every tensor cloned, on the event
loop) and writes the copy from a background thread while the next steps run; once it is on disk, and only
then, the Kafka offsets it holds are committed.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from streamer.checkpoint import CheckpointView, RankPart, copied, rng_state, run_checkpoint, save, save_gathered
from streamer.spin import in_passing

__all__ = ["Checkpointer"]


class Checkpointer:
    """checkpoint.pt every `every_s` seconds, at a revoke, and at the end; then the offsets it covers.

    The state is copied on the event loop at a snapshot point (no step in flight, the last result
    taken in by the monitor and loss log; tensors cloned, so the next steps cannot change it) and
    written by a background thread of its own (not the model's worker), so steps go on meanwhile.
    The written checkpoint covers every record read (learned, or carried over in the loop's state),
    so once it is on disk, and only then, the Kafka offsets it holds are committed: Kafka never runs
    ahead of it. At most one write is in flight: one due meanwhile waits for the next snapshot point.
    `writing`, `last_written` (wall time of the last write on disk, or None) and `step_written` are plain
    state."""

    def __init__(self, path: str | os.PathLike, every_s: float, *, config, loop, monitor, labels=None):
        """`config`: the run's LearnConfig; `loop`: its streamer.loop.PrequentialLoop; `monitor`: its
        monitor.live.LiveMonitor (the tracker's state, and told of each write); `labels`: classifiers'
        head-row label names (a callable)."""
        self.path, self.every_s = Path(path), every_s
        self.config, self.loop, self.monitor, self.labels = config, loop, monitor, labels
        self.written_at = time.monotonic()
        self.last_written: float | None = None
        self.step_written: int | None = None  # the batch count the last checkpoint on disk holds
        self.copy_s = self.write_s = 0.0  # the last snapshot copy (event loop) and write (background thread)
        self._in_flight: asyncio.Task | None = None
        self._one_at_a_time = asyncio.Lock()  # the periodic write never waits on it (it starts none while one runs)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-checkpoint")
        self.ranks = getattr(loop, "ranks", None)  # distributed: rank 0 decides, every rank takes part
        if self.ranks is not None:
            loop.checkpoint_wanted = self.time_due

    @property
    def writing(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def due(self) -> bool:
        """Time for the next checkpoint (ranks: rank 0's decision, agreed before this step); never while
        a step runs ahead of its result (the loop asked `snapshot_wanted` before it, and the checkpoint
        was not due then: it is taken after that step)."""
        if self.ranks is not None:
            agreed, self.loop.checkpoint_agreed = self.loop.checkpoint_agreed, False
            return agreed
        return self.loop.run_ahead.at_snapshot and self.time_due()

    def time_due(self) -> bool:
        """Whether the time for the next checkpoint has come (and none is being written)."""
        return not self.writing and time.monotonic() - self.written_at >= self.every_s

    def state(self) -> dict:
        """A copy of the run after batch `loop.step`; call at a snapshot point (between two results).
        Gathered and copied in a passing thread: the strategies' own clones (poe's hidden states) and
        the copy are parallel torch ops, and this thread's would leave an OpenMP team behind
        (streamer.spin); the event loop waits for it, so nothing changes the originals meanwhile."""
        started = time.perf_counter()
        state = in_passing(self._copy)
        self.copy_s = time.perf_counter() - started
        return state

    def _copy(self) -> dict:
        loop = self.loop
        looped = loop.state_dict()
        state = run_checkpoint(self.config, model=loop.strategy.model.state_dict(), strategy=loop.strategy.state_dict(),
                               rng=rng_state(), loop=looped, step=loop.step, tracker=self.monitor.state_dict(),
                               labels=None if self.labels is None else self.labels())
        return copied(state)  # the next steps and the event loop go on changing the originals

    def start(self) -> None:
        """Copy the state now (the caller is at a snapshot point) and write it in the background, then
        commit its offsets; nothing when a write is in flight. The consumer of the loop's results calls
        it between two results. Ranks: every rank at the same step (Checkpointer.due agreed); the gather
        and rank 0's write run in the worker thread in the step's place, then each rank commits its own
        offsets."""
        if self.ranks is not None:
            self.raise_failure()
            state = self.state()
            self._in_flight = asyncio.create_task(self._commit_gathered(self._in_flight, state, self._gathered(state)))
            return
        if self.writing:
            return
        self.raise_failure()
        self._in_flight = asyncio.create_task(self._write_and_commit(self.state()))

    async def write(self) -> None:
        """Wait for the write in flight, then write the state now and commit; returns once both are
        done. At a snapshot point: the end of the run (the loop has stopped) or inside on_revoke."""
        async with self._one_at_a_time:
            await self.wait()
            if self.ranks is not None:
                state = self.state()
                await self._commit_gathered(None, state, self._gathered(state))
                return
            await self._write_and_commit(self.state())

    async def wait(self) -> None:
        """Until the write in flight (if any) is on disk and its offsets committed."""
        if self._in_flight is not None:
            await asyncio.shield(self._in_flight)
            self.raise_failure()

    async def on_revoke(self, *_partitions) -> None:
        """The rebalance listener's on_partitions_revoked: at the next snapshot point (never with a step
        in flight, nor between a step and its result being taken in), write a checkpoint and commit its
        offsets while the partitions are still ours; the next batch waits until then."""
        async with self.loop.run_ahead.snapshot_point():
            await self.write()

    async def _write_and_commit(self, state: dict) -> None:
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._writer, save, self.path, state)
        self.write_s = time.perf_counter() - started
        self.written_at, self.last_written = time.monotonic(), time.time()
        self.step_written = CheckpointView(state).step
        self.monitor.checkpointed(self.last_written)
        await self.loop.commit(RankPart(state).loop_offsets)  # refused (a rebalance): the checkpoint holds them

    def _gathered(self, state: dict) -> asyncio.Future:
        """save_gathered queued in the loop's worker now, before the next step's collectives."""
        return self.loop.submit(save_gathered, self.path, state, self.ranks, self.loop.checkpointed_parts)

    async def _commit_gathered(self, previous, state: dict, gathered: asyncio.Future) -> None:
        try:
            if previous is not None:
                await previous
        except BaseException:  # the previous write's error is this one's; the gather's own is the same cause
            gathered.add_done_callback(_taken_in)
            raise
        if not await gathered:
            return
        if self.ranks.leader:
            self.written_at, self.last_written = time.monotonic(), time.time()
            self.monitor.checkpointed(self.last_written)
        await self.loop.commit(RankPart(state).loop_offsets)  # this rank's partitions

    def abandon(self) -> None:
        """The run ends with an error of its own: the write in flight (if any) is not waited for, and its
        failure, most often of the same cause (a dead peer breaks the step's collectives and the gather's,
        a full disk), is not reported again by asyncio with a traceback ('Task exception was never
        retrieved') once the task is gone."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            task.add_done_callback(_taken_in)

    def raise_failure(self) -> None:
        """A failed background write (a full disk) ends the run like a failed step: raised once; nothing while
        it runs or after a success."""
        task = self._in_flight
        if task is not None and task.done():
            self._in_flight = None
            task.result()


def _taken_in(future: asyncio.Future) -> None:
    """A done callback that takes in a task's or future's outcome: asyncio does not log it as unretrieved."""
    if not future.cancelled():
        future.exception()
