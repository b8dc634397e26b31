"""The fetch side of the prequential loop (streamer.loop): a task on the event loop that reads the source,
decodes, dead-letters and batches, and cuts whole batches into a bounded queue the loop's worker learns from.

A full queue pauses fetching (backpressure, `room`). The intake also keeps what the loop's readers see of
the reading between two results: records, dead letters, records read again, lag, the streams the learning
waits for and since when it waits. It knows nothing of the model: the loop owns it, calls it, and tells
it of a result taken in (`learned_wall`) and of its end (`closing`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque

from monitor.results import BatchTruth
from monitor.view import streams_text
from producers.wire import stream_id
from streamer.batching import ReadyBatch
from streamer.strategies.base import Batch

NOT_READ = ("dead_letter_failed", "deleted_before_read")  # dead-letter counts of no record read (records_batched)

__all__ = ["Intake", "NOT_READ", "ready_from_plain", "ready_to_plain", "rejected_record"]


class Intake:
    """Read `source` into `batcher` and cut its batches into `queue` (see PrequentialLoop for the arguments).
    `stop(reason)` stops the loop unless it is stopping (a log changed under it); `in_flight()` says whether
    a step is in flight."""

    def __init__(self, batcher, source, *, queue_size: int, lag_every_s: float, ahead_windows: int,
                 hold_quiet_s: float, keep_windows: int, reread_records: int, idle_timeout_s: float | None,
                 ranks, log, stop, in_flight):
        self.batcher, self.source, self.ranks = batcher, source, ranks
        self.idle_timeout_s = idle_timeout_s
        self._log, self._stop, self._in_flight = log, stop, in_flight
        self.records = 0  # records read: learned, carried over or dead-lettered
        self.dead_letters: Counter = Counter()  # reason -> records
        self.read_again = 0  # records read more than once (each read after the first): rewinds and jumps (_admitted)
        self.failed_before = 0  # dead-letter sends that failed before the resume (the source counts its own)
        self.lag: dict[int, int] = {}  # partition -> records in the log not yet taken into the batcher (read_lag)
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
        self._silence_said = False  # whether the log has said the streams that never sent (_say_silent_streams)
        self._cut_at = time.monotonic()  # when the last batch was cut (or the fetch side began)
        self._cut_wall = time.time()  # then, as wall time
        self.learned_wall = self._cut_wall  # when the last result was taken in (wall time; the loop sets it)
        # the streams the learning waits for (_streams_waited_for): a stream that stopped sending; () otherwise
        self.waiting_for: tuple[int, ...] = ()
        self.waiting_since: float | None = None  # wall time since when it is caught up and waits for records
        self.queue: deque[ReadyBatch] = deque()  # bounded by queue_size; [0] is the next batch to learn
        self._queue_size = queue_size
        self.refill_at = queue_size // 2  # a full queue is refilled once this few batches are left in it
        self.changed = asyncio.Event()  # something changed: a batch cut, a fetch ended, a stop
        self.last_record = time.monotonic()  # when a record was last read (idle)
        self.closing = False  # set on leaving the loop's `async with`: the fetch task's loop ends

    @property
    def records_batched(self) -> int:
        """Records that reached the batcher: read, less those dead-lettered (the manifest counts only these)."""
        return self.records - sum(count for reason, count in self.dead_letters.items() if reason not in NOT_READ)

    def records_read(self) -> int:
        """Records read: those that reached the batcher and those it left in Kafka (Batcher.admit) meanwhile."""
        return self.records_batched + self._left_in_kafka()

    def _left_in_kafka(self) -> int:
        """Records read past and not yet read again (Batcher.admit; 0 for a batcher or source without it)."""
        return self.batcher.offsets.unread if self._skips else 0

    def more(self) -> bool:
        """Whether the batcher has a batch to cut, or records to read again that may make one: a partition
        being read again, or one to rewind (Batcher.rewinds)."""
        if self.batcher.ready():
            return True
        return self._skips and (self.batcher.offsets.reading_again()
                                or bool(self.batcher.rewinds(self.keep_windows, apply=False)))

    def idle(self, now: float | None = None) -> bool:
        """No record read for `idle_timeout_s` (this process's own partitions)."""
        now = time.monotonic() if now is None else now
        return bool(self.idle_timeout_s) and now - self.last_record >= self.idle_timeout_s

    async def changed_within(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the fetch side to say something changed (asyncio.timeout, not
        wait_for: a cancel landing as the event is set must not be lost, see streamer.cancellation)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.changed.wait()

    def count_failed_sends(self) -> None:
        """Dead-letter sends that failed (the source counts them since it started): counted, never raised,
        with those before a resume."""
        failed = getattr(self.source, "dead_letter_failures", 0)
        if failed:
            self.dead_letters["dead_letter_failed"] = self.failed_before + failed

    async def settle_dead_letters(self) -> None:
        """The source's dead-letter copies in flight delivered or counted as failed, then counted here: the
        learner's last checkpoint and metrics hold every copy that was not sent (see count_failed_sends)."""
        settle = getattr(self.source, "settle_dead_letters", None)
        if settle is not None:
            await settle()
        self.count_failed_sends()

    async def fetch(self) -> None:
        """The Kafka side: read, decode, dead-letter, batch; waits while the queue is full."""
        batcher = self.batcher
        hold = getattr(self.source, "hold", None)  # a Kafka source; an in-memory one has all it will have
        self._cut_at, self._cut_wall = time.monotonic(), time.time()
        while not self.closing:
            held, sought = set(), set()
            self.log_changes()
            await self._cut_ready()  # (a checkpoint taken while the queue was full holds a batch ready to cut)
            if self._skips:
                for tp, offset in batcher.rewinds(self.keep_windows).items():
                    self.source.seek(tp, offset)
            if hold is not None:  # a held partition may have records: not caught up while one is held
                held = hold(self._partitions_ahead())
            again = self._skips and batcher.offsets.reading_again(besides=held)  # (a held one is not fetched)
            got = False  # records this fetch returned: taken, or passed over, skipped or dropped by a seek
            async for fetched in self.source.fetch(max_records=self.reread_records if again else None):
                self.last_record, got = time.monotonic(), True
                if fetched.tp in sought:  # a jump's seek (_admitted) passes it over: read before (a source that
                    # says its fetch's last offset seeks only past it), or, from one that does not, read again later
                    self.read_again += 1
                    continue
                if self._skips and not self._admitted(fetched, sought):
                    continue
                rejected = None if fetched.record is None else rejected_record(batcher, fetched, self.ranks)
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
            self.count_failed_sends()
            self.log_changes()
            await self.read_lag(now=not got)  # a fetch with nothing: caught up, say so at once
            self.waiting_for = self._streams_waited_for()
            self._say_silent_streams()
            if self.waiting_for:  # waiting for records, of these streams, since the last batch
                self.waiting_since = self._cut_wall
            elif self._starved():  # records come, too few for a batch: caught up all the same
                self.waiting_since = self.waiting_since or max(self._cut_wall, self.learned_wall)
            elif self.queue or got:  # (a rereading's fetch may take none of its records, and it is not caught up)
                self.waiting_since = None
            elif self.waiting_since is None and not held:  # caught up: nothing to learn, nothing arrived
                self.waiting_since = time.time()
            self.changed.set()  # a fetch ended: stop conditions may hold now

    def log_changes(self) -> None:
        """What the source found changed in its topic's logs (a Kafka source's take_gaps and refusal): records
        deleted before they were read are counted as dead letters (deleted_before_read) and the offsets read on
        past them; a log that is not the learner's any more (re-created or truncated) stops the loop
        ("log_changed": the learner checkpoints what it learned, and says the source's line), as do records
        compressed with a codec this installation lacks (the source's refusal_reason, "codec_missing")."""
        take_gaps = getattr(self.source, "take_gaps", None)
        for tp, beginning, lost in take_gaps() if take_gaps is not None else ():
            self.batcher.offsets.deleted_before(tp, beginning)
            self.dead_letters["deleted_before_read"] += lost
        if getattr(self.source, "refusal", None) is not None:
            self._stop(getattr(self.source, "refusal_reason", "log_changed"))

    async def _cut_ready(self) -> None:
        """Cut every batch the batcher has ready into the queue, waiting for room (backpressure: the worker is
        behind)."""
        while self.batcher.ready():
            if len(self.queue) >= self._queue_size:
                await self._room()
            self.queue.append(self.batcher.pop())
            self._cut()
            self.waiting_since = None
            self.changed.set()

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
        return not self.queue and time.monotonic() - self._cut_at >= self.hold_quiet_s

    def _starved(self) -> bool:
        """The learning waits for records while some arrive: nothing to learn or being learned (_quiet, no
        step in flight), nothing left unread in Kafka (the lag), yet the records read since the last cut
        make no batch (a stream far slower than the others, or late, before any holds `ahead_windows`
        windows more: then _streams_waited_for names it). It showed as consuming, counted as compute."""
        return self._quiet() and not self._in_flight() and bool(self.lag) and not any(self.lag.values())

    def _streams_waited_for(self) -> tuple[int, ...]:
        """The streams the learning waits for now: no batch has been cut for `hold_quiet_s`, records were
        read after that or the others' are left in Kafka (Batcher.admit) (the others go on sending: not a
        pause of every stream), and the next batch needs a window of these (Batcher.short_streams) while
        another stream holds more than `ahead_windows` windows (Batcher.far_ahead): a stream that stopped
        sending, one far slower than the others, or one whose records lie further on in the topic. ()
        again from the next cut. (A backlog read past within `hold_quiet_s` of the last cut, after which
        nothing arrives, left the lag above 0 with no stream named: StreamerLearnerStalled said stuck.)"""
        if (not self._quiet() or not self.batcher.far_ahead(self._ahead_at)
                or (self.last_record < self._cut_at + self.hold_quiet_s
                    and not self._left_in_kafka())):
            return ()
        return self.batcher.short_streams()

    def _say_silent_streams(self) -> None:
        """Once a run: caught up, no batch cut for `hold_quiet_s`, and the next batch waits for streams that have
        sent nothing since the start while another holds more than a window. A producer that keys all its
        records "0" read 80 of them, learned nothing and showed only "caught up, waiting for records"."""
        silent = getattr(self.batcher, "silent_streams", None)
        if (self._silence_said or silent is None or not self._quiet() or not self.lag or any(self.lag.values())
                or not (streams := silent())):
            return
        self._silence_said = True
        first, count = self.batcher.first_stream, self.batcher.streams
        self._log(f"the next batch waits for {streams_text(streams)}, which sent no record since the start: a batch "
                  f"takes a window of each of the streams {first} to {first + count - 1} (--streams), so a producer "
                  "of fewer streams needs --streams that many (said once)")

    def _partitions_ahead(self) -> set:
        """The partitions to leave unread for the next fetch (Batcher.ahead): none once no batch has been
        cut for `hold_quiet_s`, until the next one is, so that a short stream whose records are behind
        another's in a held partition (fewer partitions than streams, a stream that starts late, records
        of a stream moved to another partition) is read at full speed, as before there were holds."""
        if time.monotonic() - self._cut_at >= self.hold_quiet_s:
            return set()
        return self.batcher.ahead(self._ahead_at)

    async def _room(self) -> None:
        """With the queue full: wait until the worker has taken it down to `refill_at` batches, which
        the fetch side then cuts in one burst (the loop's worker wakes it only then). The lag is read on
        meanwhile: a fetch's records can hold the fetch side here for as long as the model takes to
        learn them (a backlog after a restart), and a lag read only between fetches stood still."""
        ends = await self._arrived(None)
        while len(self.queue) > self.refill_at:
            self.changed.clear()
            await self.changed_within(self.lag_every_s)
            await self.read_lag()
            ends = await self._arrived(ends)

    async def _arrived(self, before: dict | None) -> dict | None:
        """Ranks with an idle timeout, while this rank's fetch side waits for room (its batches wait for
        another rank's): records written to its partitions since `before` (their log ends as last asked)
        count as read (idle), as one process, which has no batch to learn while a stream is waited for
        and reads on, would have read them. Returns the log ends now (None: not asked)."""
        log_ends = getattr(self.source, "log_ends", None)
        if self.ranks is None or not self.idle_timeout_s or log_ends is None:
            return None
        ends = await log_ends()
        if before is not None and any(end > before.get(tp, end) for tp, end in ends.items()):
            self.last_record = time.monotonic()
        return ends or before

    async def read_lag(self, *, now: bool = False) -> None:
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


def rejected_record(batcher, fetched, ranks=None) -> tuple[str, str] | None:
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


def ready_to_plain(ready: ReadyBatch) -> dict:
    """A batch waiting in the queue as a checkpoint holds it (plain values and tensors on the CPU)."""
    truth = None if ready.truth is None else (ready.truth.class_name, ready.truth.fragment)
    return {"inputs": ready.batch.inputs.cpu(), "targets": ready.batch.targets.cpu(),
            "labels_known": ready.batch.labels_known, "truth": truth,
            "commit": [(list(tp), offset) for tp, offset in ready.commit.items()],
            "votes": [list(each) for each in ready.votes]}


def ready_from_plain(saved: dict, batcher) -> ReadyBatch:
    """A waiting batch back from a checkpoint (ready_to_plain), its tensors on the batcher's device."""
    batch = Batch(saved["inputs"].to(batcher.device), saved["targets"].to(batcher.device), saved["labels_known"])
    truth = None if saved["truth"] is None else BatchTruth(*saved["truth"])
    votes = tuple(tuple(each) for each in saved.get("votes", ()))
    if not votes and truth is not None:  # a checkpoint from before 2026-11-29: its truth as the batch's one vote
        votes = ((truth.class_name, truth.fragment, batch.tokens),)
    return ReadyBatch(batch, truth, {tuple(tp): offset for tp, offset in saved["commit"]}, votes)
