"""Turn decoded records into b x w byte windows, per stream, in arrival order.

Each of the b streams (stream ids 0..b-1, producers.wire.stream_id) keeps a token buffer (UTF-8 bytes by
default; a model's tokenizer otherwise); a batch is emitted when every stream
holds w + 1 unconsumed tokens (w inputs and the next token as the last target). Evaluation truth rides beside the batch, never inside it.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from monitor.results import BatchTruth
from streamer.strategies.base import Batch
from producers.wire import Record, Truth, stream_id

__all__ = ["ReadyBatch", "Batcher", "OffsetTracker", "vote", "truth_to_plain", "truth_from_plain"]


def vote(votes: Mapping[tuple[str, int], int]) -> BatchTruth | None:
    """From {(class, fragment): votes}: the class with most votes (independent streams mix
    classes), then its largest fragment; ties go to the earlier fragment."""
    if not votes:
        return None
    if len(votes) == 1:  # the common batch: every row in one fragment
        return BatchTruth(*next(iter(votes)))
    by_class: Counter = Counter()
    for (class_name, _), count in votes.items():
        by_class[class_name] += count
    winner = max(by_class.items(), key=lambda kv: (kv[1], -min(f for c, f in votes if c == kv[0])))[0]
    fragment = max((f for c, f in votes if c == winner), key=lambda f: (votes[(winner, f)], -f))
    return BatchTruth(winner, fragment)


@dataclass(frozen=True)
class ReadyBatch:
    batch: Batch
    truth: BatchTruth | None
    commit: dict  # {(topic, partition): next offset to commit} once this batch is learned
    # ((class, fragment, tokens), ...): what `truth` was voted from (Batcher._votes); ranks add up every
    # rank's for the global batch's truth (PrequentialLoop._global_truth)
    votes: tuple = ()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8")


def truth_to_plain(truth: Truth | None) -> tuple | None:
    """A wire Truth as a tuple of plain values (checkpoints hold no Python objects)."""
    if truth is None:
        return None
    return (truth.class_name, truth.fragment, truth.position, truth.produced, truth.label)


def truth_from_plain(values) -> Truth | None:
    return None if values is None else Truth(*values)


@dataclass
class _Stream:
    data: bytearray | list = field(default_factory=bytearray)  # bytes, or token ids from a tokenizer
    # (end position in `data` coordinates, truth or None, offset handle) per record
    spans: deque = field(default_factory=deque)
    base: int = 0  # absolute position of data[0]


class OffsetTracker:
    """Per partition: the records read, those learned, and those skipped to be read again.

    A record read is taken (`seen`, then `finish`ed once learned) or, while its stream holds more than
    the loop lets it keep (`admit`), skipped: it stays in Kafka, and so does every further record of that
    stream, until the partition is read again from the first one skipped once the stream has room
    (`rewinds`). What is taken is known per stream, by its first untaken offset: its records before it
    are taken, those from it to the furthest offset read are not. A record read again that is taken is
    passed over. A stream read again is caught up at its furthest record read, and a rereading with
    nothing to take before a later offset jumps on to it: the first untaken record of a stream read
    again and not skipped again, else the furthest offset read (a stream waited for long leaves others
    with backlogs far apart in the partition; reading through from one to the next read each again
    at every rewind). A stream's records are thus taken in their order in the partition, however often
    it is skipped, and what the tracker keeps grows with the streams, not with the records left in Kafka."""

    def __init__(self):
        self._lanes: dict = {}  # tp -> {row: its offsets taken and not yet learned, in order (learned so)}
        self._pending: dict = {}  # tp -> heap of the others taken and not yet learned (dead letters)
        self._done: dict = {}  # tp -> set of learned offsets above the heap's lowest
        self._next: dict = {}  # tp -> the next offset to read (a restart reads from it)
        self._furthest: dict = {}  # tp -> the furthest offset read + 1
        self._untaken: dict = {}  # tp -> {row: its first untaken offset} for the rows with records skipped
        self._skipping: dict = {}  # tp -> the rows skipped since the last rewind (so are all their further records)
        self._unread: dict = {}  # tp -> {row: its records skipped and not taken since} (-1: an earlier checkpoint's)
        self._passed: dict = {}  # tp -> offsets taken that an earlier checkpoint says to pass over (_from_list)
        self._last: dict = {}  # tp -> {row: the offset of its furthest record read}
        self._onwards: dict = {}  # tp -> heap of (first untaken offset or less, row), rows read again (_onward)

    def _read(self, tp, offset: int) -> None:
        self._next[tp] = offset + 1
        if offset + 1 < self._furthest.get(tp, 0):
            return
        self._furthest[tp] = offset + 1
        untaken, skipping = self._untaken.get(tp), self._skipping.get(tp, ())
        if untaken and len(untaken) > len(skipping):  # a rereading's end: the rows not skipped again are taken
            self._caught_up(tp, set(untaken) - set(skipping))

    def _caught_up(self, tp, rows) -> None:
        """`rows`, read again up to their furthest record read, have none untaken now."""
        untaken, unread = self._untaken[tp], self._unread[tp]
        for row in rows:  # none is unread: more were counted if the topic deleted some
            del untaken[row]
            unread[-1] = unread.get(-1, 0) + min(unread.pop(row, 0), 0)  # (fewer: counted in an earlier -1)
        if not untaken:
            unread.clear()
        if tp in self._passed:
            self._passed[tp] = {offset for offset in self._passed[tp] if offset >= self._kept(tp)}

    def seen(self, tp, offset: int, row: int | None = None) -> None:
        """The record at `offset` is taken: batched in `row` (its records are learned in the order taken), or
        not (dead-lettered; an utterance batcher's)."""
        if row is None:
            heapq.heappush(self._pending.setdefault(tp, []), offset)
        else:
            self._lanes.setdefault(tp, {}).setdefault(row, deque()).append(offset)
        self._read(tp, offset)

    def finish(self, tp, offset: int, row: int | None = None) -> None:
        """The record at `offset`, `seen` in `row`, is learned."""
        lane = self._lanes.get(tp, {}).get(row)
        if lane and lane[0] == offset:
            lane.popleft()
            return
        pending, done = self._pending[tp], self._done.setdefault(tp, set())  # (or one a checkpoint's heap held)
        done.add(offset)
        while pending and pending[0] in done:
            done.discard(heapq.heappop(pending))

    def admit(self, tp, offset: int, row: int | None, over: bool) -> str:
        """What to do with the record read at `offset` of `tp`, of batcher row `row` (None: no row), whose
        stream holds more than it may keep when `over`: "take" it; "skip" it (it is read again later);
        "pass" it (taken before a rewind); "jump": skip or pass it and read on from next_positions (_onward),
        since every record up to it is taken or of a stream skipped now."""
        untaken = self._untaken.get(tp, {})
        again = offset < self._furthest.get(tp, 0)  # read again: taken, unless of a row from its first untaken on
        if not again and row is not None:
            self._last.setdefault(tp, {})[row] = offset
        if again and (row not in untaken or offset < untaken[row] or offset in self._passed.get(tp, ())):
            self._read(tp, offset)
            return self._onward(tp, offset, "pass")
        if row is None or not (over or row in self._skipping.get(tp, ())):
            if again:
                unread = self._unread[tp]
                unread[row] = unread.get(row, 0) - 1  # (below 0 for records an earlier checkpoint counted)
                untaken[row] = offset + 1  # (no record of the row lies between: they were read in order)
                if offset >= self._last.get(tp, {}).get(row, self._furthest[tp]):  # its last record read: caught up
                    self._caught_up(tp, (row,))
            return "take"
        if not again:
            unread = self._unread.setdefault(tp, {})
            unread[row] = unread.get(row, 0) + 1
        skipping = self._skipping.setdefault(tp, set())
        if row not in skipping:
            self._untaken.setdefault(tp, {})[row] = offset
            skipping.add(row)
        self._read(tp, offset)
        return self._onward(tp, offset, "skip")

    def _onward(self, tp, offset: int, admitted: str) -> str:
        """`admitted`, or "jump" when a rereading at `offset` has no record to take before a later offset:
        the first untaken offset of the rows read again and not skipped again (each lies at or after it;
        the others' records before it are passed over or skipped again), else the furthest offset read."""
        following = self._next[tp]
        if following >= self._furthest[tp]:
            return admitted
        untaken, skipping = self._untaken.get(tp, {}), self._skipping.get(tp, ())
        heap = self._onwards.get(tp)
        if heap is None:  # (since the last rewind: every row with an untaken offset is read again)
            heap = self._onwards[tp] = [(first, row) for row, first in untaken.items() if row not in skipping]
            heapq.heapify(heap)
        # (a row's first untaken offset only grows until the next rewind: an entry is a bound, refreshed here)
        while heap and (heap[0][1] in skipping or untaken.get(heap[0][1]) != heap[0][0]):
            row = heap[0][1]
            if row in skipping or row not in untaken:
                heapq.heappop(heap)  # (skipped again, or caught up)
            else:
                heapq.heapreplace(heap, (untaken[row], row))  # (taken on since)
        onward = heap[0][0] if heap else self._furthest[tp]
        if onward <= following:
            return admitted
        self._next[tp] = onward
        return "jump"

    def deleted_before(self, tp, beginning: int) -> None:
        """The log of `tp` begins at `beginning` now: the records before it that were not read (retention
        deleted them) are never read, so reading (and a restart) goes on from there, not from the offset
        before the gap (a checkpoint then would count the gap again), and no row waits for a record of it."""
        if beginning <= self._next.get(tp, 0):
            return
        self._next[tp] = beginning
        self._furthest[tp] = max(self._furthest.get(tp, 0), beginning)
        untaken = self._untaken.get(tp, {})
        for row, first in untaken.items():
            untaken[row] = max(first, beginning)
        self._onwards.pop(tp, None)
        if tp in self._passed:
            self._passed[tp] = {offset for offset in self._passed[tp] if offset >= beginning}

    def skipping(self, tp) -> frozenset:
        """The rows whose records in `tp` are skipped now."""
        return frozenset(self._skipping.get(tp, ()))

    @property
    def unread(self) -> int:
        """Records skipped and not yet taken: with those taken, every record read."""
        return sum(self.unread_in().values())

    def unread_in(self) -> dict:
        """Per partition with any, the records skipped and not yet taken (they wait in Kafka)."""
        return {tp: count for tp, unread in self._unread.items() if (count := sum(unread.values()))}

    def read_positions(self) -> dict:
        """Per partition, the offset after the furthest record read: each before it is taken or skipped."""
        return dict(self._furthest)

    def read_before(self, tp, offset: int) -> bool:
        """Whether the record at `offset` of `tp` was read before (it lies before the furthest offset read)."""
        return offset < self._furthest.get(tp, 0)

    def reading_again(self, besides=frozenset()) -> bool:
        """Whether a partition (other than those in `besides`) is being read again (from a rewind up to the
        furthest offset read): records counted as unread come yet."""
        return any(following < self._furthest.get(tp, following) for tp, following in self._next.items()
                   if tp not in besides)

    def rewinds(self, has_room, apply: bool = True) -> dict:
        """{tp: offset to read from again} for the partitions that skipped a row `has_room(row)` says has
        room now; they read on from their first untaken record (not with `apply`: only which)."""
        rewound = {}
        for tp in [tp for tp, rows in self._skipping.items() if any(has_room(row) for row in rows)]:
            rewound[tp] = min(self._untaken[tp].values())
            if apply:
                self._next[tp] = rewound[tp]
                del self._skipping[tp]
                self._onwards.pop(tp, None)
        return rewound

    def commit_positions(self) -> dict:
        """Per partition, the offset before which every record is learned: kept_positions, less those taken
        and not yet learned."""
        positions = self.kept_positions()
        for tp, pending in self._pending.items():
            if pending and pending[0] < positions[tp]:
                positions[tp] = pending[0]
        for tp, lanes in self._lanes.items():
            kept = positions[tp]
            positions[tp] = min(kept, min((lane[0] for lane in lanes.values() if lane), default=kept))
        return positions

    def next_positions(self) -> dict:
        """Per partition, the next offset to read: a restart reads on from it (the records skipped before it
        are read again, those taken passed over, as this tracker's state says)."""
        return dict(self._next)

    def kept_positions(self) -> dict:
        """Per partition, the offset before which every record is learned or carried over (in the batcher
        or taken and passed over later): a checkpoint covers them, Kafka may have them committed."""
        return {tp: self._kept(tp) for tp in self._next}

    def _kept(self, tp) -> int:
        following = self._next[tp]
        return min(following, min(self._untaken.get(tp, {}).values(), default=following))

    def state_dict(self) -> list:
        return [{"partition": list(tp),
                 "lanes": sorted([row, list(lane)] for row, lane in self._lanes.get(tp, {}).items() if lane),
                 "pending": sorted(self._pending.get(tp, ())), "done": sorted(self._done.get(tp, ())),
                 "next": self._next[tp], "furthest": self._furthest.get(tp, self._next[tp]),
                 "untaken": sorted([row, offset] for row, offset in self._untaken.get(tp, {}).items()),
                 "skipping": sorted(self._skipping.get(tp, ())),
                 "unread": sorted([row, count] for row, count in self._unread.get(tp, {}).items() if count),
                 "passed": sorted(self._passed.get(tp, ())),
                 "last": sorted([row, offset] for row, offset in self._last.get(tp, {}).items())}
                for tp in self._next]

    def load_state_dict(self, state: list) -> None:
        """A state_dict's, or an earlier checkpoint's list a partition (_from_list)."""
        self.__init__()
        for part in state:
            part = part if isinstance(part, Mapping) else _from_list(part)
            tp = tuple(part["partition"])
            self._pending[tp], self._done[tp] = sorted(part["pending"]), set(part["done"])
            self._lanes[tp] = {row: deque(lane) for row, lane in part["lanes"]}
            self._next[tp], self._furthest[tp] = part["next"], part["furthest"]
            self._unread[tp] = {row: count for row, count in part["unread"]}
            if part["untaken"]:
                self._untaken[tp] = {row: offset for row, offset in part["untaken"]}
            if part["skipping"]:
                self._skipping[tp] = set(part["skipping"])
            if part["passed"]:
                self._passed[tp] = set(part["passed"])
            self._last[tp] = {row: offset for row, offset in part.get("last", ())}  # (none: caught up at the furthest)


def _from_list(part: list) -> dict:
    """A partition's state as checkpoints held it before `untaken`: 4 fields (before skipping), or 10, whose
    offsets taken after the first skipped one are passed over when read again. The rows skipped since then
    are untaken from it, those read again and not skipped yet from the next offset (their records between
    the two are taken or were passed over)."""
    tp, pending, done, following, *skips = part
    state = {"partition": tp, "lanes": [], "pending": pending, "done": done, "next": following,
             "furthest": following, "untaken": [], "skipping": [], "unread": [], "passed": []}
    if skips:
        furthest, skip_from, skipping, taken_after, rereading, unread = skips
        untaken = dict.fromkeys(rereading, following) | dict.fromkeys(skipping, skip_from)
        state.update(furthest=furthest, untaken=list(untaken.items()), skipping=skipping, unread=[[-1, unread]],
                     passed=taken_after)
    return state


class Batcher:
    """Cuts b x w batches; stream id first_stream + n owns row n for the run's life."""

    def __init__(self, streams: int, window: int, device: torch.device | str = "cpu", encode=None,
                 first_stream: int = 0):
        """`encode(text)` gives a record's token ids (bytes or a list of ints); UTF-8 bytes by default.
        `first_stream`: the stream id of row 0 (a distributed learner's rank owns ids first_stream ..
        first_stream + streams - 1; streamer.distributed)."""
        self.first_stream = first_stream
        self.streams = streams
        self.window = window
        self.device = torch.device(device)
        self.encode = encode or _utf8
        self._bytes = isinstance(self.encode("a"), (bytes, bytearray))
        self._rows: dict[str, int] = {}
        self._buffers = [_Stream(bytearray() if self._bytes else []) for _ in range(streams)]
        self._short = streams  # rows holding fewer than window + 1 tokens (ready() is asked after every record)
        self.offsets = OffsetTracker()
        self._carried: dict = {}  # partition -> the rows whose records it has carried (since this start)

    def _row(self, stream: str) -> int | None:
        """Stream id first_stream + n (producers.wire.stream_id: "0", "1", ...) owns row n; None for an
        id outside them and for a key that is not a stream id (never a row taken from another stream)."""
        known = self._rows.get(stream)  # the ids seen so far (checked once, when first seen)
        if known is not None:
            return known
        row = stream_id(stream)
        if row is None:
            return None
        row -= self.first_stream
        return row if 0 <= row < self.streams else None

    def accepts(self, stream: str) -> bool:
        return self._row(stream) is not None

    def add(self, record: Record, tp=None, offset: int | None = None) -> None:
        """Append a record's bytes to its stream; caller checks `accepts` first (else ValueError)."""
        row = self._row(record.stream)
        if row is None:
            raise ValueError(f"stream {record.stream[:40]!r} has no row: not a stream id below {self.streams}")
        self._rows[record.stream] = row
        buf = self._buffers[row]
        short = len(buf.data) <= self.window
        buf.data += self.encode(record.text)
        self._short -= short and len(buf.data) > self.window
        handle = None if tp is None else (tp, offset)
        if handle is not None:
            self.offsets.seen(tp, offset, row)
            self._carried.setdefault(tp, set()).add(row)
        buf.spans.append((buf.base + len(buf.data), record.truth, handle))

    def admit(self, tp, offset: int, stream: str | None, keep_windows: int) -> str:
        """Whether to take the record read at `offset` of partition `tp`, of `stream` (None: undecodable):
        OffsetTracker.admit, a stream being over when it holds more than `keep_windows` windows (at least
        2): its further records are left in Kafka until `rewinds` finds it room."""
        row = None if stream is None else self._row(stream)
        over = row is not None and len(self._buffers[row].data) > self._kept(keep_windows)
        return self.offsets.admit(tp, offset, row, over)

    def rewinds(self, keep_windows: int, apply: bool = True) -> dict:
        """{partition: offset} to read again from: those that skipped a stream now holding half of
        `keep_windows` windows or less (OffsetTracker.rewinds; not with `apply`: only which)."""
        room = self._kept(keep_windows) // 2
        return self.offsets.rewinds(lambda row: len(self._buffers[row].data) <= room, apply)

    def _kept(self, keep_windows: int) -> int:
        """The most tokens a stream keeps while a batch waits for another: `keep_windows` windows, at least 2."""
        return max(keep_windows, 2) * self.window

    def skipped_streams(self, tp) -> tuple[int, ...]:
        """The stream ids whose records in partition `tp` are left in Kafka now (admit)."""
        return tuple(sorted(self.first_stream + row for row in self.offsets.skipping(tp)))

    def ready(self) -> bool:
        return not self._short and len(self._rows) == self.streams

    def short_streams(self) -> tuple[int, ...]:
        """The stream ids the next batch waits for: those holding a window or less (() while one can be cut)."""
        if self.ready():
            return ()
        return tuple(self.first_stream + row for row, buf in enumerate(self._buffers) if len(buf.data) <= self.window)

    def far_ahead(self, windows: int) -> bool:
        """Whether a stream holds more than `windows` windows (at least 1): the others' fall behind."""
        enough = max(windows, 1) * self.window
        return any(len(buf.data) > enough for buf in self._buffers)

    def ahead(self, windows: int) -> set:
        """The partitions not worth reading now: while the next batch waits for a stream that is short
        (a window or less, or not seen yet), those that have carried records (since this start) only of
        streams holding more than `windows` windows (at least 1: a short stream is never one of them).
        Without it a backlog's partitions were read whole, one after another, into their streams'
        buffers (and the checkpoint) before the first batch could be cut (aiokafka returns one
        partition's records, then the next's). None while a batch can be cut."""
        if self.ready():
            return set()
        enough = max(windows, 1) * self.window
        full = {row for row, buf in enumerate(self._buffers) if len(buf.data) > enough}
        return {tp for tp, rows in self._carried.items() if rows <= full}

    def _count_short(self) -> None:
        self._short = sum(len(b.data) <= self.window for b in self._buffers)

    def pop(self) -> ReadyBatch:
        """Cut one b x w batch; call only when `ready()`. The grid is cut with numpy: on the fetch side,
        every torch call hands the GIL to the step thread and waits to get it back."""
        w = self.window
        if self._bytes:
            grid = np.frombuffer(b"".join([b.data[: w + 1] for b in self._buffers]), dtype=np.uint8)
        else:
            grid = np.array([b.data[: w + 1] for b in self._buffers], dtype=np.int64)
        grid = grid.reshape(self.streams, w + 1)
        votes = self._votes()
        for row, buf in enumerate(self._buffers):
            del buf.data[:w]
            buf.base += w
            self._release(buf, row)
        self._count_short()
        inputs, targets = torch.from_numpy(grid[:, :w].astype(np.int64)), torch.from_numpy(grid[:, 1:].astype(np.int64))
        if self.device.type != "cpu":
            inputs, targets = inputs.to(self.device), targets.to(self.device)
        batch = Batch(inputs=inputs, targets=targets)
        return ReadyBatch(batch=batch, truth=vote(votes), commit=self.offsets.commit_positions(),
                          votes=tuple((*key, tokens) for key, tokens in votes.items()))

    def state_dict(self) -> dict:
        """The carry-over: each row's unconsumed tokens and record spans, the key-to-row map, the offsets.
        A copy: the fetch side goes on adding while a checkpoint is written."""
        return {
            "rows": dict(self._rows),
            "buffers": [{"data": bytes(b.data) if self._bytes else list(b.data), "base": b.base,
                         "spans": [(end, truth_to_plain(truth), None if handle is None else (list(handle[0]), handle[1]))
                                   for end, truth, handle in b.spans]} for b in self._buffers],
            "offsets": self.offsets.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._rows = dict(state["rows"])
        self._buffers = []
        for saved in state["buffers"]:
            spans = deque((end, truth_from_plain(truth), None if handle is None else (tuple(handle[0]), handle[1]))
                          for end, truth, handle in saved["spans"])
            data = bytearray(saved["data"]) if self._bytes else list(saved["data"])
            self._buffers.append(_Stream(data, spans, saved["base"]))
        self._count_short()
        self.offsets.load_state_dict(state["offsets"])

    def _votes(self) -> dict:
        """{(class, fragment): tokens of this batch's rows that carry it}, for `vote`."""
        votes: dict = {}
        window = self.window
        for buf in self._buffers:
            start = buf.base
            end = start + window
            span_start = start  # the oldest span may begin before `base`
            for span_end, truth, _ in buf.spans:
                if truth is not None:
                    overlap = (span_end if span_end < end else end) - (span_start if span_start > start else start)
                    if overlap > 0:
                        key = (truth.class_name, truth.fragment)
                        votes[key] = votes.get(key, 0) + overlap
                if span_end >= end:
                    break
                span_start = span_end
        return votes

    def _release(self, buf: _Stream, row: int) -> None:
        """Forget records whose bytes are all consumed (position <= base)."""
        while buf.spans and buf.spans[0][0] <= buf.base:
            _, _, handle = buf.spans.popleft()
            if handle is not None:
                self.offsets.finish(*handle, row)
