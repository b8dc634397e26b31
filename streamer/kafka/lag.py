"""Consumer lag: the records in each assigned partition's log that the learner has not yet taken (a Kafka-side
module of the learner, with streamer.kafka.consumer, whose KafkaSource.lag reads it), and the ends of held
partitions, which no fetch answers, asked of the broker in the background (HeldEnds).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiokafka.errors import IllegalStateError, KafkaError

from streamer.kafka.assignment import not_this_log

__all__ = ["HeldEnds", "records_behind"]


class HeldEnds:
    """The ends of held partitions (KafkaSource.hold: not fetched, so no fetch answers their end), asked of
    the broker (a ListOffsets request, aiokafka's end_offsets) in a task of its own, one at a time, and not
    while the broker does not answer (KafkaSource.reachable): a lag read waited up to the request's timeout
    (15 s) for a broker that was away, and the loop's limit on a read (streamer.loop, lag_every_s) then
    dropped every partition's figure. An end asked stands until a fetch of its partition has seen as far."""

    def __init__(self):
        self._asked: dict = {}  # {TopicPartition: its end as the broker said} while held, until fetched as far
        self._asking: asyncio.Task | None = None  # the request for them in flight

    def ask(self, consumer, answering: bool) -> None:
        """Ask for the ends of `consumer`'s held partitions, unless the broker is not `answering` or a request
        is in flight."""
        held = consumer.paused() & consumer.assignment()
        if not held or not answering or (self._asking is not None and not self._asking.done()):
            return
        self._asking = asyncio.get_running_loop().create_task(self._ends(consumer, held))

    async def _ends(self, consumer, held: set) -> None:
        try:
            ends = await consumer.end_offsets(list(held))
        except (KafkaError, asyncio.TimeoutError):  # the last ends stand
            return
        for tp, end in ends.items():
            self._asked[tp] = max(end, self._asked.get(tp, end))  # a log's end only grows

    def ends(self, consumer, tp) -> tuple[int | None, int | None]:
        """(partition `tp`'s end as a fetch of it answered, its end for the lag: the one asked until a fetch
        has seen as far); None: not known."""
        highwater, asked = consumer.highwater(tp), self._asked.get(tp)
        fetched = highwater  # the end a fetch of it answered (not asked: Tansu's ListOffsets is no end)
        if asked is not None:
            if highwater is not None and highwater >= asked:
                del self._asked[tp]  # a fetch has seen as far
            else:
                highwater = asked
        return fetched, highwater

    def forget_revoked(self, assigned: set) -> None:
        for tp in set(self._asked) - assigned:
            del self._asked[tp]

    async def stop(self) -> None:
        """Cancel the request in flight."""
        if self._asking is not None:
            self._asking.cancel()
            await asyncio.gather(self._asking, return_exceptions=True)
            self._asking = None


async def records_behind(consumer, held_ends: HeldEnds, taking_from: Callable[[], dict | None],
                         taken: dict | None, read: dict | None, ends_before: Callable[[str], None]) -> dict[int, int]:
    """{partition: records in its log not yet taken} for `consumer`'s assigned partitions, as KafkaSource.lag
    says: beyond the position, or while a fetch's records are being taken (`taking_from()`, asked for each
    partition: the positions before that fetch, None between fetches) beyond `taken`'s next offset or that
    position; never before `read`'s. A log that a fetch answered ends before that offset is not the
    learner's: its line (not_this_log) goes to `ends_before`."""
    lags = {}
    assigned = consumer.assignment()
    held_ends.forget_revoked(assigned)
    for tp in assigned:
        fetched, end = held_ends.ends(consumer, tp)
        if end is None:
            continue
        following = None
        before = taking_from()
        if before is not None:  # the position is past records not yet taken
            offsets = ((taken or {}).get((tp.topic, tp.partition)), before.get(tp))
            following = max((offset for offset in offsets if offset is not None), default=None)
        if following is None:
            try:
                following = await consumer.position(tp)
            except IllegalStateError:  # revoked meanwhile
                continue
        following = max(following, (read or {}).get((tp.topic, tp.partition), following))
        if fetched is not None and fetched < following:  # a log that ends before what the learner read
            ends_before(not_this_log((tp.topic, tp.partition), following, fetched))
        lags[tp.partition] = max(0, end - following)  # (Kafka's fetch: OffsetOutOfRange, place_out_of_range)
    return lags
