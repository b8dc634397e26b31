"""What the ranks of a distributed learner (`ranks`, streamer.distributed) agree on and report to each other,
for the prequential loop (streamer.loop).

Ranks start together: rank 0's failure to start (a refusal only it can make) ends every rank, and rank 0
alone says it. They step together: before each step every rank says, in one collective in the worker
thread, whether it has its next batch, whether it stops (and why) and (rank 0) whether a checkpoint is
due; all step when all have a batch, all stop when one stops, and all checkpoint after the step when rank
0 asks. A rank waiting for records says so every `agree_every_s`, so a stop reaches every rank within that
time. Every `lag_every_s`, and at the stop, rank 0 also asks each rank for its records, lag, dead letters
and records read again (a gather after the agreement), so that `across_ranks()` and
`waiting_for_records_since` describe the whole learner there."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import Counter
from typing import NamedTuple

from monitor.results import BatchTruth
from streamer import distributed
from streamer.batching import vote
from streamer.checkpoint import RankPart
from streamer.source import SourceError

__all__ = ["Counts", "RankAgreement", "counts_of", "global_truth"]


class Counts(NamedTuple):
    """What the learner has read (PrequentialLoop.across_ranks)."""

    records: int  # read: learned, carried over or dead-lettered
    lag: dict  # partition -> records not yet taken
    dead_letters: Counter  # reason -> records
    read_again: int  # records read again after a rewind (--keep-windows)


def counts_of(intake, reports: dict) -> Counts:
    """Counts of the whole learner: the `intake`'s own (streamer.intake.Intake) and the other ranks' `reports`."""
    records, lag, dead_letters = intake.records, dict(intake.lag), Counter(intake.dead_letters)
    read_again = intake.read_again
    for report in reports.values():
        records += report["records"]
        lag.update(report["lag"])
        dead_letters.update(report["dead_letters"])
        read_again += report.get("read_again", 0)
    return Counts(records, lag, dead_letters, read_again)


class RankAgreement:
    """This rank's side of the agreements and reports. `intake` is the loop's streamer.intake.Intake;
    `in_worker(function, *args)` runs a collective in the model's worker thread; `ready_or_stopped(wait_s)`
    waits until this rank has a batch, a stop condition holds or `wait_s` has passed."""

    def __init__(self, ranks, intake, in_worker, ready_or_stopped, *, agree_every_s: float, lag_every_s: float,
                 total_records: int | None, log):
        self.ranks, self.intake, self.agree_every_s = ranks, intake, agree_every_s
        self._in_worker, self._ready_or_stopped, self._log = in_worker, ready_or_stopped, log
        self.lag_every_s, self.total_records = lag_every_s, total_records
        # when an agreement last found another rank without its next batch while this one had its own (None
        # once they step), and since when (wall time); counted as waiting for records only while agreements
        # keep coming
        self._others_waited_at: float | None = None
        self._others_waiting_since: float | None = None
        # the other ranks' reports (rank -> records, lag, dead letters), on rank 0, as of the last gather (a
        # report's, or a checkpoint's: checkpointed_parts)
        self._reports: dict[int, dict] = {}
        self._reported_at = float("-inf")
        self._agreements_fresh_s = max(5.0, 10 * agree_every_s)
        # when the last step ended (perf_counter), while the time since counts as stepping together (the
        # loop's worker, busy_s): None once this rank or another waited for records, or a checkpoint came between
        self.lockstep_from: float | None = None
        self._checkpoint_between = False
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the one the loop runs on (after_every_start)
        self.closing = False  # set on leaving the loop's `async with`: the watch task's loop ends

    async def after_every_start(self, failure: Exception | None, stop_source) -> None:
        """Rank 0's failure to start is every rank's. A refusal only rank 0 can make (another learner
        in the group: only rank 0 is a member of the learner group, learner_group.Membership) left the
        other ranks waiting for it in their first agreement; its end then failed them as 'another rank is
        gone', a line of their own. One broadcast of rank 0's line, the loop's first collective, which every
        rank reaches whether its start went well, failed or was given up: a rank that started ends on rank 0's
        line as on a refusal every rank makes alike (SourceError, every_rank: rank 0 says it, it says nothing);
        a rank's own failure is still its own. `stop_source()` lets the source go (no __aexit__ follows)."""
        self._event_loop = asyncio.get_running_loop()
        line = None
        if failure is not None and self.ranks.rank == 0:
            line = (str(failure) or type(failure).__name__).encode()
        said = await self._in_worker(self.ranks.broadcast_bytes, line)
        if said is not None and failure is None and self.ranks.rank != 0:
            await stop_source()  # started: it leaves now, as no __aexit__ follows
            raise SourceError(said.decode(errors="replace"), every_rank=True)

    @property
    def others_waiting(self) -> bool:
        """The last agreement, recent enough, found another rank without its next batch while this one had
        its own."""
        return (self._others_waited_at is not None
                and time.monotonic() - self._others_waited_at < self._agreements_fresh_s)

    @property
    def others_waiting_since(self) -> float | None:
        """Wall time since when another rank waits for its next batch while this one has its own (None: none)."""
        return self._others_waiting_since if self.others_waiting else None

    def streams_waited_for(self) -> tuple[int, ...]:
        """The streams the learning waits for: this rank's and, on rank 0, the other ranks' as of their last
        report."""
        streams = set(self.intake.waiting_for)
        for report in self._reports.values():
            streams.update(report.get("waiting_for", ()))
        return tuple(sorted(streams))

    def across_ranks(self) -> Counts:
        """Counts of the whole learner (counts_of): this rank's own and, on rank 0, the other ranks'."""
        return counts_of(self.intake, self._reports)

    async def agreed(self, stop_reason, checkpoint_wanted) -> distributed.Agreement:
        """The agreement to step once every rank has its own batch (`go`), or to stop once any rank stops
        (`stop_reason`: this rank's is `stop_reason()`); rank 0 asks for a checkpoint where
        `checkpoint_wanted()`. The time since the last step counts as the step's (busy_s) only where no
        rank waited for records: each says in the agreement whether it had to (its queue empty when it came
        here, or a round without a step), as a rank that waits for its records before it agrees holds the
        others in the all-gather."""
        queue = self.intake.queue
        lockstep = bool(queue)
        while True:
            await self._ready_or_stopped(self.agree_every_s)
            has_batch = bool(queue)
            votes = json.dumps(queue[0].votes).encode() if has_batch else b""
            stalled = distributed.stalled_s()
            agreed = await self._in_worker(self.ranks.agree, has_batch, stop_reason(),
                                           checkpoint_wanted(), self.intake.records_read(),
                                           has_batch or self.intake.more(), self.total_records,
                                           time.monotonic() - self._reported_at >= self.lag_every_s,
                                           self.intake.idle(), votes, not (lockstep and has_batch))
            others_wait = has_batch and not agreed.go and agreed.stop_reason is None
            lockstep = (lockstep and has_batch and not others_wait and not agreed.waited
                        and distributed.stalled_s() == stalled)  # (a rank held it: no step's time)
            waited = self.others_waiting  # (a wait that outlasted its freshness, a hang, starts anew)
            self._others_waited_at = time.monotonic() if others_wait else None
            if not others_wait:
                self._others_waiting_since = None
            elif not waited:
                self._others_waiting_since = time.time()
            if agreed.stop_reason is not None:
                await self.intake.read_lag(now=True)  # the last records taken, for the stop's report
                await self._report()
                return agreed
            if agreed.report:
                await self._report()
            if agreed.go:
                if not lockstep or self._checkpoint_between:  # (a checkpoint's time is the clock's own activity)
                    self.lockstep_from = None
                self._checkpoint_between = agreed.checkpoint  # taken after this step, before the next agreement
                if agreed.votes is not None:  # rank 0: the global batch's truth (global_truth)
                    queue[0] = dataclasses.replace(queue[0], truth=global_truth(agreed.votes))
                return agreed

    async def _report(self) -> None:
        """This rank's records, lag, dead letters and records read again to rank 0 (a gather in the worker
        thread, where every rank runs its collectives in the same order), kept there as the other ranks' reports."""
        intake = self.intake
        own = {"records": intake.records, "lag": intake.lag,  # (JSON: keys as text)
               "dead_letters": intake.dead_letters, "read_again": intake.read_again, "waiting_for": intake.waiting_for}
        parts = await self._in_worker(self.ranks.gather_bytes, json.dumps(own).encode())
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

    async def watch(self, every_s: float = 0.5) -> None:
        """A collective held past distributed.STALL_S by another rank (stopped, hung or far slower) is said, and
        again when it ends: the other ranks waited in it without a word, their console 'consuming'. Its end
        is said at the watch's own end too: a run that ended within `every_s` of the meeting said only the wait."""
        said = None

        def met() -> None:
            self._log(f"the ranks meet again after {time.monotonic() - said:.0f} s")
        try:
            while not self.closing:
                await asyncio.sleep(every_s)
                since = distributed.in_collective_since()
                if said is None and since is not None and time.monotonic() - since >= distributed.STALL_S:
                    said = since  # (a rank's lines say its rank: rank_process)
                    self._log(f"the other ranks have not come to a collective for {distributed.STALL_S:g} s (a "
                              "rank stopped, stuck, far slower or writing a checkpoint); waiting for them")
                elif said is not None and since != said:
                    met()
                    said = None
        finally:
            if said is not None and distributed.in_collective_since() != said:
                met()


def global_truth(parts: list[bytes]) -> BatchTruth | None:
    """Rank 0's truth of the global batch, voted from every rank's votes for its part (Ranks.agree). Its
    own rows' alone gave rank 0's streams' class and fragment, which differ from the others' where the
    streams switch apart (the `independent` schedule): the loss log, the CALM metrics and the report
    then differed from one process's. The other ranks keep their own (they write none of those)."""
    votes: Counter = Counter()
    for part in parts:
        for class_name, fragment, tokens in json.loads(part):
            votes[class_name, fragment] += tokens
    return vote(votes)


def _report_from(part: bytes) -> dict:
    """A rank's report (_report), its partitions back to ints."""
    report = json.loads(part)
    report["lag"] = {int(partition): lag for partition, lag in report["lag"].items()}
    return report
