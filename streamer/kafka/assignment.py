"""Where each assigned partition is read from: the learner's own offsets against the log as the broker
has it now (a Kafka-side module of the learner: streamer.kafka.consumer's KafkaSource seeks by these).

Every partition is read from the learner's own offset (a checkpoint's, then what it has read), or from
the log's beginning: never from the group's committed offset. An own offset below the beginning lost the
records between to retention (said, deleted_unread, and counted by the learner); one past the log's end
belongs to another log, a re-created or truncated topic (refused, not_this_log). A rebalance hands the
learner's state over and seeks to its own offsets (SeekOnAssign); it never raises.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from streamer.source import SourceError

__all__ = ["not_this_log", "deleted_unread", "where_to_read", "seek_to_own", "place_out_of_range",
           "SeekOnAssign"]


def not_this_log(tp: tuple[str, int], own: int, end: int) -> str:
    """The one line of a partition whose log ends before the learner's own next offset."""
    return (f"{tp[0]}:{tp[1]} ends at offset {end}, before this learner's offset {own} there (its checkpoint's, "
            "or read so far): the topic was re-created or truncated, so the checkpoint's offsets are not this "
            "log's; start a new model with --fresh (from the topic's beginning), or give another --run-dir or "
            "--group")


def deleted_unread(tp: tuple[str, int], own: int, beginning: int) -> str:
    """The one line of records retention deleted before the learner read them."""
    return (f"records {own}..{beginning - 1} of {tp[0]}:{tp[1]} were deleted by retention before they were learned "
            f"({beginning - own} records, counted as dead letters: deleted_before_read); reading on from offset "
            f"{beginning}")


def where_to_read(tp: tuple[str, int], own: int | None, beginning: int, end: int | None = None) -> tuple[int, int]:
    """(the offset to read partition `tp` from, the records lost before it) given the learner's own next offset
    there (None: it has read nothing of it) and the log's beginning and end. None reads from the beginning
    (a log trimmed by retention starts past 0: nothing of this run's is lost); an own offset below the
    beginning lost the records between to retention; one past the end belongs to another log (the topic was
    re-created or truncated): SourceError (not_this_log). `end` None: not known (not checked)."""
    if own is None:
        return beginning, 0
    if end is not None and own > end:
        raise SourceError(not_this_log(tp, own, end))
    if own < beginning:
        return beginning, beginning - own
    return own, 0


async def seek_to_own(consumer: AIOKafkaConsumer, assigned, known: dict, deleted) -> None:
    """Seek each assigned partition to the learner's own next offset in `known` ({(topic, partition):
    offset}) as where_to_read places it in the log (asked of the broker: its beginning offset);
    one it has none for goes to the log's beginning: this run has read nothing of it (it started
    from the beginning or from a checkpoint, Membership.refuse_if_elsewhere), so whatever the group
    committed there is not this run's. Records deleted before they were read are `deleted(tp, own,
    beginning)`. An own offset past the log's end is found by the first fetch (real Kafka: OffsetOutOfRange,
    place_out_of_range; Tansu: an end below it, KafkaSource.lag), not here: Tansu answers ListOffsets
    "latest" with no log end (1 for a partition of 324 records). The consumer resets no offset
    (auto_offset_reset "none": an earliest reset skipped a retention gap, and looped on a re-created topic).
    A seek sets the position at once; with seek_to_beginning, whose reset completes later, some records of
    a new group's partitions were read twice (tests/test_kafka_path.py's dead letters counted twice)."""
    assigned = list(assigned)
    if not assigned:
        return
    beginnings = await consumer.beginning_offsets(assigned)
    for tp in assigned:
        own = known.get((tp.topic, tp.partition))
        offset, lost = where_to_read((tp.topic, tp.partition), own, beginnings[tp])
        if lost:
            deleted((tp.topic, tp.partition), own, offset)
        consumer.seek(tp, offset)


async def place_out_of_range(consumer: AIOKafkaConsumer, topic: str, positions: dict, timeout_s: float,
                             deleted, refuse) -> None:
    """Seek each assigned partition of {TopicPartition: offset} (where a fetch found its offset out of
    range) as where_to_read places that offset in its log, asked of the broker within `timeout_s`: on from
    the log's beginning past records deleted unread (`deleted(tp, own, beginning)`), or refused past its end
    (`refuse(line)`, KafkaSource.refusal). A broker that does not answer leaves it to the next fetch, which
    fails again."""
    tps = [tp for tp in positions if tp in consumer.assignment()]
    try:
        async with asyncio.timeout(timeout_s):
            if topic not in await consumer.topics():  # deleted: the watch's (KafkaSource.reachable)
                return
            beginnings = await consumer.beginning_offsets(tps)
            ends = await consumer.end_offsets(tps)
    except (KafkaError, asyncio.TimeoutError, OSError):
        return
    for tp in tps:
        try:
            offset, lost = where_to_read((tp.topic, tp.partition), positions[tp], beginnings[tp], ends[tp])
        except SourceError as exc:
            refuse(str(exc))
            continue
        if lost:
            deleted((tp.topic, tp.partition), positions[tp], offset)
        if tp in consumer.assignment():
            consumer.seek(tp, offset)


class SeekOnAssign(ConsumerRebalanceListener):
    """The learner's offsets, not the group's, decide where each assigned partition is read from
    (aiokafka's local-state consumer example). Never raises: a rebalance must not crash a learner."""

    def __init__(self, consumer: AIOKafkaConsumer, positions, log, on_revoke=None, deleted=None, refuse=None):
        self.consumer, self.positions, self.log = consumer, positions, log
        self.on_revoke = on_revoke  # set once the learner has started: a refused joiner hands nothing over
        self.deleted = deleted or (lambda tp, own, beginning: None)  # records retention deleted unread
        self.refuse = refuse or log  # the line of a partition whose log is not the learner's (not_this_log)
        self._elsewhere: tuple = ()  # the topic's partitions another member of the group holds, as last said

    async def on_partitions_revoked(self, revoked) -> None:
        """What was read stays in the learner's state; `on_revoke` (a checkpoint and its commit) runs
        while the partitions are still ours."""
        if not revoked or self.on_revoke is None:
            return
        try:
            await self.on_revoke()
        except Exception as exc:  # noqa: BLE001 - the boundary: a rebalance never crashes a learner
            self.log(f"handing over at a rebalance failed ({type(exc).__name__}: {str(exc)[:200]}); "
                     "the next checkpoint covers it")

    async def on_partitions_assigned(self, assigned) -> None:
        known = {}
        try:
            known = self.positions()
            for tp in assigned:  # at once, before asking the broker: a fetch meanwhile found a partition with no
                self.consumer.seek(tp, known.get((tp.topic, tp.partition), 0))  # position, and raised (reset: none)
            await seek_to_own(self.consumer, assigned, known, self.deleted)
        except SourceError as exc:  # a log that is not the learner's: the learner stops (KafkaSource.refusal)
            self.refuse(str(exc))
        except Exception as exc:  # noqa: BLE001 - the boundary: a rebalance never crashes a learner
            self.log(f"seek after a rebalance failed ({type(exc).__name__}: {str(exc)[:200]}); "
                     "reading from the learner's own offsets unchecked")
            for tp in assigned:  # (every partition sought: the consumer resets none, auto_offset_reset "none")
                with contextlib.suppress(Exception):
                    self.consumer.seek(tp, known.get((tp.topic, tp.partition), 0))
        if self.on_revoke is not None:  # started (a joiner refused at its start says its own line)
            self._say_elsewhere(assigned)

    def _say_elsewhere(self, assigned) -> None:
        """One line when a rebalance leaves partitions of the topic to another member of the group (a consumer
        that is not a streamer learner joined it: their records wait in Kafka, unlearned, and the lag leaves
        them out), and one when they come back. A rebalance took them without a word."""
        topics = {tp.topic for tp in assigned} | {topic for topic, _ in self.positions()}
        mine = {(tp.topic, tp.partition) for tp in assigned}
        every = {(topic, partition) for topic in topics
                 for partition in self.consumer.partitions_for_topic(topic) or ()}
        elsewhere = tuple(sorted(every - mine))
        if elsewhere == self._elsewhere:
            return
        if elsewhere:
            listed = ", ".join(f"{topic}:{partition}" for topic, partition in elsewhere)
            self.log(f"a rebalance gave partition(s) {listed} to another member of this learner's consumer group "
                     "(not a streamer learner): their records wait in Kafka, unlearned, until it leaves the group")
        else:
            self.log("a rebalance gave every partition back to this learner: it reads on from its own offsets")
        self._elsewhere = elsewhere
