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


def test_the_learner_without_the_codec_stops_with_its_checkpoint_exit_2_and_one_line(broker, tmp_path):
    """A learner process without cramjam learns the topic's plain records, then stops at its first lz4 batch:
    exit status 2, the codec's one line on stderr, a checkpoint of every batch it logged, and status.json's
    stop says codec_missing (it said log_changed, a log not the learner's: another cause, another cure)."""
    import json
    import subprocess
    import sys

    from streamer import checkpoint
    from tests.learners import ENV, SMALL, error_lines, wait_for_lines

    topic, run_dir = "codec-learner", tmp_path / "run"

    async def send(compression: str | None, first: int) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, compression_type=compression)
        await producer.start()
        try:
            for i in range(first, first + 60):
                await producer.send_and_wait(topic, f"text {i:05d}".encode(), key=str(i % 3).encode())
        finally:
            await producer.stop()

    asyncio.run(ensure_topic(broker.bootstrap_servers, topic))
    asyncio.run(send(None, 0))
    without_cramjam = ("import sys; import aiokafka.codec as codec; codec.cramjam = None; "
                       "from streamer.cli.main import main; sys.exit(main(sys.argv[1:]))")
    learner = subprocess.Popen(
        [sys.executable, "-c", without_cramjam, "learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
         topic, *SMALL, "--hidden", "24", "--embedding", "8", "--no-view", "--no-probe", "--run-dir", str(run_dir)],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lines(run_dir / "losses.jsonl", learner, 1)  # learning the plain records (a daemon: it waits)
        asyncio.run(send("lz4", 60))
        out, err = learner.communicate(timeout=180)
    finally:
        learner.kill()
    assert learner.returncode == 2, out[-3000:] + err[-3000:]
    assert error_lines(err) == [
        f"streamer learn: error: topic {topic} holds records compressed with a codec this installation cannot "
        "decompress (UnsupportedCodecError: Libraries for lz4 compression codec not found); install aiokafka's "
        "codecs where the learner runs (pip install cramjam), or produce with compression gzip or none: the same "
        "command then continues the run"], err[-3000:]
    logged = len((run_dir / "losses.jsonl").read_text().splitlines())
    assert logged > 0 and checkpoint.load(run_dir / "checkpoint.pt")["step"] == logged
    assert json.loads((run_dir / "status.json").read_text())["stop_reason"] == "codec_missing"


def test_a_ranks_own_refusal_is_said_only_for_the_stop_it_caused():
    """Ranks agree on one stop reason (the later in STOP_REASONS). Rank 0 whose own source refused the log
    (log_changed) while another rank lacked the codec (codec_missing, the agreed stop) said its own line,
    naming another cause than status.json's (helper-119): its line is kept only for the stop it caused."""
    from types import SimpleNamespace

    from streamer.learner import _refusal_of

    source = SimpleNamespace(refusal="t:0 ends at offset 100, before this learner's offset 300 there",
                             refusal_reason="log_changed")
    assert _refusal_of(SimpleNamespace(source=source, stop_reason="log_changed")) == source.refusal
    assert _refusal_of(SimpleNamespace(source=source, stop_reason="codec_missing")) == ""
    assert _refusal_of(SimpleNamespace(source=SimpleNamespace(), stop_reason="max_batches")) == ""
