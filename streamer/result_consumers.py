"""The consumers of a learning run's results (streamer.learner composes them): the monitor, the loss log, the
checkpointer and the probes take each result in order; the loop's plain state is read into the monitor and
shown (view, status.json) a few times a second; an idle learner's due checkpoint is written while it waits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from monitor.console import STATUS_FILE, LoopReading, write_status
from monitor.live import LiveMonitor
from monitor.losslog import LossLogWriter
from monitor.view import learning_on_line, many_classes_line, waiting_for_line
from streamer.checkpointer import Checkpointer
from streamer.loop import PrequentialLoop
from streamer.resume import trim_logs

__all__ = ["consume_results", "sync_monitor", "WaitsSaid"]


async def consume_results(loop: PrequentialLoop, monitor: LiveMonitor, checkpointer, probes, run_dir: Path | None, view,
                   final_probe: bool, resumed: bool = False, log=None) -> None:
    """The consumers of the loop's results, in order: monitor, loss log, checkpointer, probes. The run's
    logs are cut back to the loop's step (a resumed run's checkpoint; 0 otherwise) once the source has
    started, then appended to. `run_dir` None (a rank other than 0): no log, no status file."""
    # from the start: the consumer group's JoinGroup (in the source's start) shows as joining
    publisher = asyncio.create_task(_publish(loop, monitor, view, checkpointer, probes, run_dir, log))
    try:
        async with loop:
            if run_dir is not None and (kept := trim_logs(run_dir, loop.step)[0]) < loop.step:
                (log or print)(f"losses.jsonl holds {kept} of the checkpoint's {loop.step} batches: batches {kept} "
                               f"to {loop.step - 1} are missing from the loss log (cut, or lost in a crash of the "
                               "machine), so a report from it leaves them out; the model learned them")
            loss_log = _NoLossLog() if run_dir is None else LossLogWriter(run_dir / "losses.jsonl", append=resumed)
            with loss_log as losses:
                if probes and (row := await probes.before_next(loop)):  # "start": the untrained model
                    monitor.probed(row)
                idle = asyncio.create_task(_checkpoint_while_idle(loop, checkpointer, losses))
                many_said = run_dir is None  # (rank 0 says it)
                try:
                    async for result in loop:
                        losses.write(monitor.observe(result))
                        if not many_said and (first := monitor.run_tracker.past_limit) is not None:
                            many_said = True
                            (log or print)(many_classes_line(first, monitor.run_tracker.class_limit))
                        if checkpointer.due():
                            losses.sync()  # on disk before a checkpoint past its lines (a power cut keeps both)
                            checkpointer.start()  # copied here, written in the background
                        if probes and (row := await probes.before_next(loop)):
                            monitor.probed(row)
                finally:
                    idle.cancel()
                    failed = (await asyncio.gather(idle, return_exceptions=True))[0]
                if isinstance(failed, Exception):  # its checkpoint's write failed (a full disk): the run's error
                    raise failed
            if probes and final_probe and loop.step:  # the model after the whole stream: the last task's stage
                monitor.probed(await probes.score(loop, "end"))
            await loop.end_fetching()  # (the last checkpoint holds every dead letter)
            sync_monitor(loop, monitor, checkpointer, probes)
            await checkpointer.write()  # one at the end, always
    except BaseException:
        checkpointer.abandon()  # the run's own error is the one reported
        raise
    finally:
        publisher.cancel()
        await asyncio.gather(publisher, return_exceptions=True)


async def _checkpoint_while_idle(loop: PrequentialLoop, checkpointer: Checkpointer, losses, every_s: float = 0.5):
    """A learner caught up with its topic takes no result until records come, so the checkpoint due at the
    next result waited: the batches learned since the last one stayed out of it (their offsets uncommitted)
    for as long as the topic was quiet, hours for a daemon, and a kill -9 then cost them. Once a checkpoint
    is due and the loop waits for records, at rest, one is written here. One process only: the ranks
    checkpoint where they agree, at a step."""
    if checkpointer.ranks is not None:
        return
    started = loop.step  # (a resumed run's checkpoint holds its batches)
    while True:
        await asyncio.sleep(every_s)
        try:
            checkpointer.raise_failure()  # a write that failed (a full disk) ends the run, quiet topic or not
            if loop.step > max(started, checkpointer.step_written or 0) and loop.intake.waiting_since is not None \
                    and checkpointer.time_due() and loop.at_rest:  # (not snapshot_point: a probe's peek holds it)
                losses.sync()
                checkpointer.start()
        except Exception:
            loop.stop("checkpoint_failed")  # the consumer ends and raises it
            raise


class _NoLossLog:
    """The loss log of a rank other than 0: rank 0 writes the global one."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, line) -> None:
        pass

    def sync(self) -> None:
        pass


async def _publish(loop: PrequentialLoop, monitor: LiveMonitor, view, checkpointer=None, probes=None,
                   run_dir: Path | None = None, log=None, every_s: float = 0.25, status_every_s: float = 5.0) -> None:
    """Read the loop's plain state into the monitor and refresh the view a few times a second; write
    the console's snapshot to <run_dir>/status.json (for `streamer status`) every `status_every_s`,
    whenever the activity changes and once the first checkpoint is on disk (a restart without
    checkpoint.pt reads there whether the run had one: streamer.resume.old_run_without_checkpoint); with a
    run directory (one process, rank 0), `say` in `log` when the learning begins to wait for streams and
    when it learns on."""
    written_at, written_activity, written_checkpointed = None, None, False
    say = WaitsSaid(loop, log) if run_dir is not None and log is not None else None
    while True:
        sync_monitor(loop, monitor, checkpointer, probes)
        if say is not None:
            say()
        snapshot = monitor.console_snapshot()
        view.update(snapshot)
        now = time.monotonic()
        checkpointed = snapshot.checkpoint_age_s is not None
        if run_dir is not None and (written_at is None or now - written_at >= status_every_s
                                    or snapshot.activity != written_activity or checkpointed != written_checkpointed):
            written_at, written_activity, written_checkpointed = now, snapshot.activity, checkpointed
            write_status(run_dir / STATUS_FILE, snapshot)
        await asyncio.sleep(every_s)


class WaitsSaid:
    """The learner's log lines about the streams the learning waits for (loop.streams_waited_for): a wait
    once it has lasted `after_s` since the last batch (a stream far slower than the others is waited for
    at each of its windows, briefly), the streams it adds later, and its end when a batch is cut again."""

    def __init__(self, loop: PrequentialLoop, log, after_s: float = 60.0):
        self.loop, self.log, self.after_s = loop, log, after_s
        self._said: tuple = ()  # the streams of the wait said so far (() when none is)
        self._since = None  # the wait's start (wall: the last batch)

    def __call__(self) -> None:
        streams, now = self.loop.streams_waited_for, time.time()
        if not streams:
            if self._said:
                self.log(learning_on_line(self._said, now - self._since))
                self._said = ()
            return
        since = self.loop.waiting_for_records_since or now
        if not self._said and now - since < self.after_s:
            return
        if not set(streams) <= set(self._said):
            self._since = since if not self._said else self._since
            self._said = tuple(sorted(set(self._said) | set(streams)))
            self.log(waiting_for_line(self._said, self.loop.intake.ahead_windows, now - self._since))


def sync_monitor(loop: PrequentialLoop, monitor: LiveMonitor, checkpointer: Checkpointer, probes,
                 finished: bool = False) -> None:
    """The loop's, the checkpointer's and the probes' plain state into the monitor (the source's
    topic-missing time where it has one: an in-memory source has none)."""
    counts = loop.across_ranks()  # (ranks, on rank 0: every rank's)
    counted = monitor.dead_letters
    for reason, count in counts.dead_letters.items():
        if count > counted.get(reason, 0):
            monitor.dead_letter(reason, count - counted.get(reason, 0))
    monitor.read(LoopReading(
        step=loop.step, records=counts.records, lag=counts.lag, read_again=counts.read_again,
        queue_depth=loop.queue_depth,
        waiting_since=loop.waiting_for_records_since, waiting_reported=True,
        broker_lost_since=loop.broker_watch.lost_since, topic_gone=loop.broker_watch.topic_gone,
        checkpointing=checkpointer.writing, checkpoint_at=checkpointer.last_written,
        probe_seconds=probes.seconds if probes else 0.0, stop_reason=loop.stop_reason, finished=finished,
        topic_missing_since=getattr(loop.source, "topic_missing_since", None),
        waiting_for=() if finished else loop.streams_waited_for, busy_s=loop.worker.busy_s))
