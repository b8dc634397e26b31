"""A partition's log that no longer holds the learner's offsets: the decision (streamer.kafka.assignment.where_to_read),
the Kafka side's answer to an out-of-range fetch and to an assignment, and the offset tracker's jump.

Retention deleting records before the learner read them cannot be made on the embedded broker (Tansu has
no DeleteRecords, and a fetch past a log's end just returns nothing), so these tests model real Kafka by
its answers: a consumer whose getmany raises OffsetOutOfRangeError (auto_offset_reset "none") and whose
beginning and end offsets say where the log is. The re-created topic goes through the real broker in
tests/test_broker_faults.py."""

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import OffsetOutOfRangeError

from streamer.kafka.assignment import SeekOnAssign, where_to_read
from streamer.kafka.consumer import KafkaSource
from streamer.offsets import OffsetTracker
from streamer.source import SourceError

TP = TopicPartition("t", 0)


def test_where_to_read_places_the_learners_offset_in_the_log():
    assert where_to_read(("t", 0), 300, 0, 400) == (300, 0)  # in the log: read on
    assert where_to_read(("t", 0), 400, 0, 400) == (400, 0)  # at its end: caught up
    assert where_to_read(("t", 0), None, 500, 800) == (500, 0)  # nothing read yet: from the beginning, none lost
    assert where_to_read(("t", 0), 300, 500, 800) == (500, 200)  # retention deleted 300..499 unread
    # the edges (own < beginning - 1 for a loss passed the cases above): one record lost, and none
    assert where_to_read(("t", 0), 499, 500, 800) == (500, 1) and where_to_read(("t", 0), 500, 500, 800) == (500, 0)
    with pytest.raises(SourceError, match=r"^t:0 ends at offset 100, before this learner's offset 300 there .*"
                                          r"re-created or truncated.*--fresh"):
        where_to_read(("t", 0), 300, 0, 100)  # another log: a re-created or truncated topic


class Consumer:
    """The part of AIOKafkaConsumer the source uses, for one partition of a log from `beginning` to `end`."""

    def __init__(self, beginning, end, position=0):
        self.beginning, self.end, self.position_now, self.sought = beginning, end, position, []

    def assignment(self):
        return {TP}

    async def topics(self):
        return {TP.topic}

    async def position(self, tp):
        return self.position_now

    async def getmany(self, *partitions, timeout_ms=0, max_records=None):
        if not self.beginning <= self.position_now <= self.end:
            raise OffsetOutOfRangeError({TP: self.position_now})
        return {}

    async def beginning_offsets(self, tps):
        return {tp: self.beginning for tp in tps}

    async def end_offsets(self, tps):
        return {tp: self.end for tp in tps}

    def seek(self, tp, offset):
        self.sought.append(offset)
        self.position_now = offset


def fetched(source):
    async def fetch():
        return [record async for record in source.fetch(timeout_s=0.01)]
    return asyncio.run(fetch())


def test_an_out_of_range_fetch_counts_records_deleted_unread_and_reads_on_from_the_logs_beginning():
    """Real Kafka, a checkpoint at 300, the log now 500..800: the earliest reset skipped 300..499 silently."""
    lines = []
    source = KafkaSource("kafka:9092", "t", "g", log=lines.append)
    source._consumer = Consumer(500, 800, position=300)
    assert fetched(source) == []
    assert source._consumer.sought == [500] and source.take_gaps() == [(("t", 0), 500, 200)]
    assert source.take_gaps() == [] and source.refusal is None
    assert lines == ["records 300..499 of t:0 were deleted by retention before they were learned (200 records, "
                     "counted as dead letters: deleted_before_read); reading on from offset 500"]


def test_an_out_of_range_fetch_past_the_logs_end_is_refused_not_reset():
    """Real Kafka, a checkpoint at 300, the topic re-created with 100 records: an earliest reset read from 0,
    the tracker passed over offsets below 300 and jumped back to 300, which was reset again (a livelock)."""
    source = KafkaSource("kafka:9092", "t", "g", log=print)
    source._consumer = Consumer(0, 100, position=300)
    assert fetched(source) == [] and source._consumer.sought == []
    assert source.refusal.startswith("t:0 ends at offset 100, before this learner's offset 300 there")
    assert fetched(source) == []  # nothing more is read: the loop stops on `refusal`


def test_an_assignment_places_each_partition_in_its_log():
    """Past its beginning, by the beginning offset asked; not by its end (Tansu's ListOffsets "latest" answers
    1 for a partition of 324 records, and refused a good resume): a fetch finds that (the tests below)."""
    said, refused, gaps = [], [], []
    for beginning, end, own, sought in ((0, 400, 300, [300]), (500, 800, None, [500]), (500, 800, 300, [500]),
                                        (0, 100, 300, [300])):
        consumer = Consumer(beginning, end)
        listener = SeekOnAssign(consumer, lambda: {} if own is None else {("t", 0): own}, said.append,
                                deleted=lambda *gap: gaps.append(gap), refuse=refused.append)
        asyncio.run(listener.on_partitions_assigned({TP}))
        assert consumer.sought == [own or 0, *sought]  # at once (a fetch meanwhile raised), then placed
    assert gaps == [(("t", 0), 300, 500)] and said == [] and refused == []


def test_a_fetch_that_answers_a_log_end_before_the_learners_offset_is_refused():
    """Tansu answers a fetch past a log's end with no record and the log's end (real Kafka: OffsetOutOfRange):
    the lag read saw the end below the learner's offset and said lag 0, caught up, for ever."""
    class Answered(Consumer):
        def highwater(self, tp):
            return self.end

        def paused(self):
            return set()

    source = KafkaSource("kafka:9092", "t", "g", log=print)
    source._consumer = Answered(0, 100, position=300)
    assert asyncio.run(source.lag()) == {0: 0}
    assert source.refusal.startswith("t:0 ends at offset 100, before this learner's offset 300 there")
    source = KafkaSource("kafka:9092", "t", "g", log=print)
    source._consumer = Answered(0, 400, position=300)
    assert asyncio.run(source.lag()) == {0: 100} and source.refusal is None


def test_the_tracker_reads_on_past_records_deleted_unread():
    """After the jump the next offset, and a checkpoint's, is the log's beginning: a restart does not count the
    gap again, and the records from there are taken (not passed over as read before)."""
    tracker = OffsetTracker()
    for offset in range(300):
        tracker.seen(("t", 0), offset, 0)
        tracker.finish(("t", 0), offset, 0)
    tracker.deleted_before(("t", 0), 500)
    assert tracker.next_positions() == tracker.kept_positions() == {("t", 0): 500}
    assert tracker.admit(("t", 0), 500, 0, over=False) == "take" and not tracker.read_before(("t", 0), 500)
    tracker.seen(("t", 0), 500, 0)
    tracker.deleted_before(("t", 0), 400)  # an older beginning changes nothing
    assert tracker.next_positions() == {("t", 0): 501}


def test_the_loop_counts_records_deleted_unread_as_dead_letters_and_reads_on(one_torch_thread):
    from producers.wire import Record
    from streamer.batching import Batcher
    from streamer.loop import PrequentialLoop
    from tests.helpers import naive
    from tests.test_loop import MemorySource, learn

    class Trimmed(MemorySource):  # the log begins at 20 now; the learner had read up to 5
        gaps = [(("t", 0), 20, 15)]

        def take_gaps(self):
            gaps, self.gaps = self.gaps, []
            return gaps

    records = [Record(str(i % 2), "abcdefghijk") for i in range(60)]
    loop = PrequentialLoop(naive(), Batcher(2, 10), Trimmed(records, start=20), idle_timeout_s=0.5)
    learn(loop)
    assert dict(loop.intake.dead_letters) == {"deleted_before_read": 15}
    assert loop.intake.records == loop.intake.records_batched == 40
    assert loop.batcher.offsets.next_positions() == {("t", 0): 60}


def test_a_rebalance_that_leaves_partitions_to_another_member_is_said_and_so_is_their_return():
    """A plain consumer that joined the learner's group took partition 1 without a word: the console said
    caught up, lag 0, while its records waited unlearned."""
    class Group(Consumer):
        def partitions_for_topic(self, topic):
            return {0, 1}

    said = []
    listener = SeekOnAssign(Group(0, 400), lambda: {("t", 0): 10, ("t", 1): 20}, said.append)
    asyncio.run(listener.on_partitions_assigned({TP, TopicPartition("t", 1)}))  # the start: not yet armed
    listener.on_revoke = lambda: None
    asyncio.run(listener.on_partitions_assigned({TP}))
    asyncio.run(listener.on_partitions_assigned({TP}))  # said once
    asyncio.run(listener.on_partitions_assigned({TP, TopicPartition("t", 1)}))
    assert said == ["a rebalance gave partition(s) t:1 to another member of this learner's consumer group (not a "
                    "streamer learner): their records wait in Kafka, unlearned, until it leaves the group",
                    "a rebalance gave every partition back to this learner: it reads on from its own offsets"]
