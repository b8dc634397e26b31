"""When the prequential loop (streamer.loop) stops of itself: `max_batches` learned, `max_seconds` elapsed,
`idle_timeout_s` without a record, or the end of the stream: `total_batches` learned, or every one of
`total_records` read and no whole batch left (both from the producer's manifest)."""

from __future__ import annotations

import time

__all__ = ["StopConditions"]


class StopConditions:
    """The loop's limits, from its start (`started`, monotonic); each check says the first that holds (None:
    none). A signal, a lost broker or a changed log stop the loop otherwise (PrequentialLoop.stop)."""

    def __init__(self, *, max_batches: int | None, total_batches: int | None, total_records: int | None,
                 max_seconds: float | None, idle_timeout_s: float | None):
        self.max_batches, self.total_batches, self.total_records = max_batches, total_batches, total_records
        self.max_seconds, self.idle_timeout_s = max_seconds, idle_timeout_s
        self.started = time.monotonic()  # --minutes counts from the loop's start

    def reached(self, step: int, intake, one_process: bool) -> str | None:
        """After `step` batches learned, with the records read and the queue of `intake` (streamer.intake.Intake).
        Ranks agree on the end of the records (theirs add up to it) and on idleness (every rank idle): those
        two are checked here for `one_process` only."""
        now = time.monotonic()
        reason = None
        if self.max_batches and step >= self.max_batches:
            reason = reason or "max_batches"
        if self.total_batches and step >= self.total_batches:
            reason = reason or "end_of_stream"
        if (one_process  # ranks: agreed (their records add up to it)
                and self.total_records and intake.records_read() >= self.total_records and not intake.queue
                and not intake.more()):  # every record read and batched: what remains is less than a batch
            reason = reason or "end_of_stream"  # (before idle: a word model's end, whose records were all
            # read more than idle_timeout_s before its learning ended, said idle)
        if self.max_seconds and now - self.started >= self.max_seconds:
            reason = reason or "time_limit"
        if one_process and not intake.queue and intake.idle(now):  # ranks: agreed (every rank idle)
            reason = reason or "idle"
        return reason

    def past_last_batch(self, index: int) -> bool:
        """Batch `index` (counted from 0) is beyond `max_batches` or `total_batches`: it is never learned."""
        return bool((self.max_batches and index >= self.max_batches)
                    or (self.total_batches and index >= self.total_batches))

    def while_starting(self, topic_missing_since: float) -> str | None:
        """While the broker has answered and the topic does not exist: `max_seconds` from the loop's start,
        and `idle_timeout_s` from when the topic was found missing (no record can come before it exists)."""
        if self.max_seconds and time.monotonic() - self.started >= self.max_seconds:
            return "time_limit"
        if self.idle_timeout_s and time.time() - topic_missing_since >= self.idle_timeout_s:
            return "idle"
        return None
