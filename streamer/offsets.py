"""Which records of each partition a learner has read, learned, and skipped to read again: the offsets a
checkpoint holds and Kafka may have committed (`OffsetTracker`, one a batcher: streamer.batching,
streamer.utterance_batching)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping

__all__ = ["OffsetTracker"]


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
