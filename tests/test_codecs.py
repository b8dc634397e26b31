"""A topic whose producer compressed its batches with lz4, snappy or zstd (a Java client's compression.type,
kcat -z) reaches a learner whose aiokafka has no codec for it (they need cramjam, not a dependency): its
getmany raises UnsupportedCodecError. The learner used to end in that traceback, exit status 1 and no
checkpoint, and again at every restart; now it refuses the topic in one line (KafkaSource.refusal), which stops
it with its checkpoint and exit status 2 as a log that is not its own does (streamer.cli.learn). The records
are good, so none is dead-lettered. gzip, which aiokafka decodes without cramjam, goes through the real broker
like any record."""

import asyncio

from aiokafka import TopicPartition
from aiokafka.errors import UnsupportedCodecError

from streamer.kafka.consumer import KafkaSource

TP = TopicPartition("t", 0)


class Lz4Consumer:
    """The part of AIOKafkaConsumer the fetch uses, for a partition whose next batch is lz4 without the codec."""

    def __init__(self):
        self.fetches = 0

    def assignment(self):
        return {TP}

    async def position(self, tp):
        return 12

    async def getmany(self, *partitions, timeout_ms=0, max_records=None):
        self.fetches += 1
        raise UnsupportedCodecError("Libraries for lz4 compression codec not found")


def fetched(source):
    async def fetch():
        return [record async for record in source.fetch(timeout_s=0.01)]
    return asyncio.run(fetch())


def test_a_batch_compressed_with_a_codec_not_installed_is_refused_in_one_line():
    lines = []
    source = KafkaSource("kafka:9092", "t", "g", log=lines.append)
    source._consumer = Lz4Consumer()
    assert fetched(source) == []  # raised out of the fetch before: the learner's traceback, exit status 1
    assert source.refusal == (
        "topic t holds records compressed with a codec this installation cannot decompress "
        "(UnsupportedCodecError: Libraries for lz4 compression codec not found); install aiokafka's codecs where "
        "the learner runs (pip install cramjam), or produce with compression gzip or none: the same command then "
        "continues the run")
    assert fetched(source) == [] and source._consumer.fetches == 1  # nothing more is read: the loop stops
    assert lines == [] and source.take_gaps() == []  # nothing dead-lettered or counted as lost
