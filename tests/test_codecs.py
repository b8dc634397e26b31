"""Topics whose producer compressed its batches (a Java client's compression.type, kcat -z) through the real
broker: gzip, lz4, snappy and zstd are read as any record (aiokafka's lz4, snappy and zstd need cramjam, a
dependency through aiokafka's extras). An installation without cramjam used to end the learner in
UnsupportedCodecError's traceback, exit status 1 and no checkpoint, and again at every restart; it refuses the
topic in one line (KafkaSource.refusal), which stops the learner with its checkpoint and exit status 2 as a
log that is not its own does (streamer.cli.learn). The records are good, so none is dead-lettered."""

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer, codec

from producers.kafka import ensure_topic
from streamer.kafka.consumer import KafkaSource

CODECS = ("gzip", "lz4", "snappy", "zstd")


async def produce_compressed(bootstrap: str, topic: str, compression: str, count: int) -> None:
    await ensure_topic(bootstrap, topic)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=compression, linger_ms=50)
    await producer.start()
    try:
        sent = [await producer.send(topic, (f"record {i} of {compression} " * 8).encode(), key=str(i % 2).encode())
                for i in range(count)]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


def read(bootstrap: str, topic: str, count: int):
    """((stream, text) of each record read, the source's refusal, its lines, its gaps) of a KafkaSource on
    `topic` from its start."""
    async def go():
        lines = []
        source = KafkaSource(bootstrap, topic, f"{topic}-g", dead_letter=False, log=lines.append)
        source.seek_on_assign(dict)
        await source.start()
        values, deadline = [], time.monotonic() + 30
        try:
            while len(values) < count and source.refusal is None and time.monotonic() < deadline:
                values += [(fetched.record.stream, fetched.record.text) async for fetched in source.fetch()]
            return values, source.refusal, lines, source.take_gaps()
        finally:
            await source.stop()
    return asyncio.run(go())


@pytest.mark.parametrize("compression", CODECS)
def test_a_topic_compressed_with_any_kafka_codec_is_read_whole(broker, compression):
    topic = f"codec-{compression}"
    asyncio.run(produce_compressed(broker.bootstrap_servers, topic, compression, 40))
    values, refusal, lines, gaps = read(broker.bootstrap_servers, topic, 40)
    assert refusal is None and lines == [] and gaps == []
    assert values == [(str(i % 2), f"record {i} of {compression} " * 8) for i in range(40)]


def test_a_codec_this_installation_lacks_is_refused_in_one_line_with_nothing_dead_lettered(broker, monkeypatch):
    """aiokafka without cramjam (as aiokafka installed alone is): its lz4 batches cannot be decompressed."""
    topic = "codec-lz4-missing"
    asyncio.run(produce_compressed(broker.bootstrap_servers, topic, "lz4", 10))
    monkeypatch.setattr(codec, "cramjam", None)  # what `import cramjam` failing leaves aiokafka with
    values, refusal, lines, gaps = read(broker.bootstrap_servers, topic, 10)
    assert values == []  # raised out of the fetch before: the learner's traceback, exit status 1
    assert refusal == (
        f"topic {topic} holds records compressed with a codec this installation cannot decompress "
        "(UnsupportedCodecError: Libraries for lz4 compression codec not found); install aiokafka's codecs where "
        "the learner runs (pip install cramjam), or produce with compression gzip or none: the same command then "
        "continues the run")
    assert lines == [] and gaps == []  # nothing dead-lettered or counted as lost
