"""`streamer produce` onto a topic that exists: its partition count, the records it already holds
(refused, resumed or appended to), and --loop's open-ended manifest. Through the embedded broker."""

import asyncio
import json

from producers.kafka import ensure_topic
from streamer.cli import main


def produce_args(broker, corpus, topic, manifest, *extra) -> list[str]:
    return ["produce", "--corpus", str(corpus), "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic,
            "--fragments", "4", "--lambda", "600", "--streams", "3", "--window", "10", "--probe-tokens", "0",
            "--manifest", str(manifest), *extra]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_topic_with_another_partition_count_is_refused_before_anything_is_written(broker, tiny_corpus, tmp_path,
                                                                                   capsys):
    for existing, asked, topic in ((3, 2, "parts-fewer"), (1, 3, "parts-more")):
        asyncio.run(ensure_topic(broker.bootstrap_servers, topic, partitions=existing))
        manifest = tmp_path / f"{topic}.json"
        assert main(produce_args(broker, tiny_corpus, topic, manifest, "--partitions", str(asked))) == 2
        line = one_error_line(capsys)
        assert f"topic {topic} exists with {existing} partition" in line and f"--partitions is {asked}" in line
        assert not manifest.exists() and topic_contents(broker, topic) == {}


def topic_contents(broker, topic) -> dict[str, list[tuple[int, str]]]:
    """Per stream (key), the (position, text) of its records in order, as read back."""
    from producers.held import read_topic
    from producers.wire import decode

    got: dict[str, list[tuple[int, str]]] = {}

    def each(message):
        record = decode(message.key, message.value, message.headers)
        got.setdefault(record.stream, []).append((record.truth.position, record.text))
    asyncio.run(read_topic(broker.bootstrap_servers, topic, each))
    return got


def announcements(broker, topic) -> dict[str, list[int]]:
    """Per stream, the fragments announced on the truth topic, in order."""
    from producers.held import read_topic

    got: dict[str, list[int]] = {}

    def each(message):
        said = json.loads(message.value)
        got.setdefault(said["stream"], []).append(said["fragment"])
    asyncio.run(read_topic(broker.bootstrap_servers, topic, each))
    return got


def test_producing_again_onto_a_topic_that_holds_records_is_refused_in_one_line(broker, tiny_corpus, tmp_path,
                                                                                capsys):
    assert main(produce_args(broker, tiny_corpus, "again", tmp_path / "first.json")) == 0
    before = topic_contents(broker, "again")
    count = sum(map(len, before.values()))
    capsys.readouterr()
    assert main(produce_args(broker, tiny_corpus, "again", tmp_path / "second.json", "--probe-tokens", "200")) == 2
    said = capsys.readouterr()
    assert len(said.err.strip().splitlines()) == 1 and "Traceback" not in said.err, said.err
    line = said.err.strip()
    assert f"topic again holds {count} records" in line and "--resume" in line and "--append" in line
    assert "held out" not in said.out, said.out  # (the probe split's line said a split of a refused production)
    assert not (tmp_path / "second.json").exists()
    assert topic_contents(broker, "again") == before
    assert all(len(set(fragments)) == len(fragments) for fragments in announcements(broker, "again.truth").values())


def test_resume_sends_what_an_interrupted_production_lacks_and_the_topic_equals_an_uninterrupted_one(
        broker, tiny_corpus, tmp_path, capsys):
    """The first records of a production (and their announcements) on the topic, as a producer stopped
    midway leaves it; `--resume` with the same flags ends with what one uninterrupted run writes."""
    from producers.kafka import produce
    from producers.stream import prepare_stream
    from streamer.cli.configs import schedule, stream_options
    from streamer.cli.main import parse

    flags = ("--partitions", "3")
    assert main(produce_args(broker, tiny_corpus, "whole", tmp_path / "whole.json", *flags)) == 0
    args = parse(produce_args(broker, tiny_corpus, "cut", tmp_path / "cut.json", *flags))
    records, _ = prepare_stream(tiny_corpus, schedule(args), **stream_options(args))
    asyncio.run(produce(records[:len(records) * 2 // 5], broker.bootstrap_servers, "cut", partitions=3,
                        truth_topic="cut.truth"))
    assert main(produce_args(broker, tiny_corpus, "cut", tmp_path / "cut.json", *flags)) == 2  # not without --resume
    capsys.readouterr()
    assert main(produce_args(broker, tiny_corpus, "cut", tmp_path / "cut.json", *flags, "--resume")) == 0
    assert "resuming: topic cut holds" in capsys.readouterr().out
    assert topic_contents(broker, "cut") == topic_contents(broker, "whole")
    assert announcements(broker, "cut.truth") == announcements(broker, "whole.truth")
    whole, cut = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("whole", "cut"))
    assert cut == whole

    assert main(produce_args(broker, tiny_corpus, "cut", tmp_path / "cut.json", *flags, "--resume")) == 0
    assert "(the whole stream): nothing left to send" in capsys.readouterr().out
    assert topic_contents(broker, "cut") == topic_contents(broker, "whole")


def test_resume_refuses_a_topic_of_another_production(broker, tiny_corpus, tmp_path, capsys):
    assert main(produce_args(broker, tiny_corpus, "other", tmp_path / "m.json", "--seed", "1")) == 0
    capsys.readouterr()
    assert main(produce_args(broker, tiny_corpus, "other", tmp_path / "m2.json", "--resume")) == 2
    assert "cannot resume: topic other" in one_error_line(capsys)


def test_append_writes_a_second_copy_after_what_the_topic_holds(broker, tiny_corpus, tmp_path):
    assert main(produce_args(broker, tiny_corpus, "twice", tmp_path / "m.json")) == 0
    once = topic_contents(broker, "twice")
    assert main(produce_args(broker, tiny_corpus, "twice", tmp_path / "m.json", "--append")) == 0
    assert topic_contents(broker, "twice") == {stream: held * 2 for stream, held in once.items()}


def test_a_looped_production_says_so_and_learn_goes_on_past_one_lap(broker, tiny_corpus, tmp_path):
    """`produce --loop`'s manifest says "loop": a learner given it learns on past the lap's total_batches
    until it is stopped (it stopped at the end of one lap: `[stopped: end_of_stream]` with lag left). Its
    fragments number on past the lap's N: the run has no N (the whole stream is scored), and a report from
    a fragment of the second lap is not refused as past the stream's last."""
    import os
    import signal
    import subprocess
    import time

    from tests.learners import STREAMER

    manifest, losses = tmp_path / "loop.json", tmp_path / "run" / "losses.jsonl"
    producer = subprocess.Popen([*STREAMER, *produce_args(broker, tiny_corpus, "looped", manifest, "--loop",
                                                          "--fragments", "2", "--rate", "3000")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    learner = None
    try:
        deadline = time.monotonic() + 60
        while not manifest.exists() and producer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        written = json.loads(manifest.read_text())
        assert written["loop"] is True and written["total_batches"] > 0  # a lap's figures stay
        lap = written["total_batches"]
        learner = subprocess.Popen(
            [*STREAMER, "learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", "looped",
             "--manifest", str(manifest), "--hidden", "16", "--embedding", "8", "--no-view", "--no-probe",
             "--run-dir", str(tmp_path / "run")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 240
        while learner.poll() is None and time.monotonic() < deadline:
            if losses.exists() and len(losses.read_text().splitlines()) > lap + 10:
                break
            time.sleep(0.2)
        assert learner.poll() is None, learner.communicate()[0][-2000:]  # still learning, past one lap
        learner.send_signal(signal.SIGTERM)
        output = learner.communicate(timeout=120)[0]
        assert learner.returncode == 0 and "[stopped: signal]" in output, output[-2000:]
        assert "CALM metrics over fragments >= 0 of" in output and "(the whole stream)" in output, output[-2000:]
        assert json.loads((tmp_path / "run" / "config.json").read_text())["n_fragments"] is None
        second_lap = max(json.loads(line)["sequence"] for line in losses.read_text().splitlines())
        assert second_lap >= written["n_fragments"]
        assert main(["report", str(tmp_path / "run"), "--from-fragment", str(second_lap)]) == 0
    finally:
        for process in (learner, producer):
            if process is not None and process.poll() is None:
                process.kill()
                process.communicate()


def test_a_recycled_utterance_is_one_payload_shared_by_its_records():
    """An utterance read again to fill the stream is the same string in each record, built once (a new
    string per recycled record took 21 GB for one 3 MB utterance)."""
    from producers.schedule import Schedule
    from producers.utterance_stream import build_utterance_stream

    examples = {"a": [("first line\nof a", "x"), ("another a", "y")], "b": [("only b", None), ("b too", None)]}
    records, _ = build_utterance_stream(examples, Schedule(n_fragments=4, mean_tokens=40, streams=2))
    by_text: dict[str, set[int]] = {}
    for record in records:
        by_text.setdefault(record.text, set()).add(id(record.text))
    assert set(by_text) == {"first line of a\n", "another a\n", "only b\n", "b too\n"}
    assert all(len(ids) == 1 for ids in by_text.values()) and len(records) > 8


def test_a_record_kafka_refuses_is_said_as_refused_not_as_a_timeout(broker):
    """A non-retriable error (a record over Kafka's size limit) is its own line at once, not 'took no records
    for N s (--broker-timeout)'."""
    import pytest

    from producers.kafka import ProduceError, produce
    from producers.wire import Record, Truth

    records = [Record("0", "small\n", Truth("a", 0, 0, 0.0)), Record("0", "x" * 2_000_000, Truth("a", 0, 6, 0.0))]
    with pytest.raises(ProduceError) as caught:
        asyncio.run(produce(records, broker.bootstrap_servers, "too-large", broker_timeout_s=30))
    message = str(caught.value)
    assert "refused a record (MessageSizeTooLargeError" in message and "took no records" not in message, message
    assert "stopped after 1 records" in message


def test_a_given_order_that_misses_a_class_names_the_flag(tiny_corpus, tmp_path, capsys):
    """--given-order is the flag that lists the classes (the message named --order, which picks 'given')."""
    args = ["produce", "--corpus", str(tiny_corpus), "--bootstrap-servers", "127.0.0.1:9", "--schedule", "sequence",
            "--given-order", "en,fr", "--manifest", str(tmp_path / "m.json")]
    assert main(args) == 2
    line = one_error_line(capsys)
    assert "--given-order must name each class once (cs, en, fr); got en, fr" in line, line


def test_a_loop_without_a_pace_is_refused_before_anything_is_written(broker, tiny_corpus, tmp_path, capsys):
    """`produce --loop` without --rate or --token-rate sent as fast as the broker took records, for ever (175k
    records in its first 6 s on the embedded broker), until the broker's disk was full."""
    assert main(produce_args(broker, tiny_corpus, "unpaced", tmp_path / "m.json", "--loop")) == 2
    assert one_error_line(capsys) == (
        "streamer produce: error: --loop replays forever: give it a pace, --rate (records/s) or --token-rate "
        "(bytes/s); unpaced it sends as fast as the broker takes records until the broker's disk is full")
    assert not (tmp_path / "m.json").exists()


def test_sigterm_stops_produce_like_ctrl_c_and_says_how_many_records_were_sent(broker, tiny_corpus, tmp_path):
    """A paced producer stopped by SIGTERM: one line on stderr, exit 130 as for Ctrl-C, and how many records
    it sent; --resume then completes the topic (before, SIGTERM killed it without a word)."""
    import os
    import re
    import signal
    import subprocess
    import time

    from tests.learners import STREAMER

    manifest = tmp_path / "paced.json"
    process = subprocess.Popen([*STREAMER, *produce_args(broker, tiny_corpus, "paced", manifest, "--rate", "100")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while not manifest.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # about 150 records sent
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, (out, err)
    assert err.strip() == "streamer: interrupted", err
    sent = int(re.search(r"stopped: sent (\d+) records to paced", out).group(1))
    total = json.loads(manifest.read_text())["total_records"]
    assert 0 < sent < total
    assert main(produce_args(broker, tiny_corpus, "paced", manifest, "--resume")) == 0
    assert sum(map(len, topic_contents(broker, "paced").values())) == total


def test_a_looped_production_resumes_in_its_second_lap_with_neither_a_gap_nor_a_repeat(broker, tiny_corpus, tmp_path):
    """`produce --loop --resume` onto a topic that holds one lap and a half continues each stream's replay
    where it stopped: what the topic then holds is, stream by stream, the start of one uninterrupted
    looped production (positions continued from lap to lap)."""
    import itertools
    import signal
    import subprocess
    import time

    from producers.kafka import produce
    from producers.stream import looped, prepare_stream
    from streamer.cli.configs import schedule, stream_options
    from streamer.cli.main import parse
    from tests.learners import STREAMER

    argv = produce_args(broker, tiny_corpus, "laps", tmp_path / "laps.json", "--partitions", "3", "--loop")
    records, manifest = prepare_stream(tiny_corpus, schedule(parse(argv)), **stream_options(parse(argv)))
    asyncio.run(produce(list(itertools.islice(looped(records, manifest), len(records) * 3 // 2)),
                        broker.bootstrap_servers, "laps", partitions=3, truth_topic="laps.truth"))
    before = sum(map(len, topic_contents(broker, "laps").values()))
    resumed = subprocess.Popen([*STREAMER, *argv, "--resume", "--rate", "200"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while sum(map(len, topic_contents(broker, "laps").values())) < len(records) * 5 // 2:
            assert resumed.poll() is None and time.monotonic() < deadline, resumed.communicate()[0][-2000:]
            time.sleep(0.5)
        resumed.send_signal(signal.SIGTERM)
        output = resumed.communicate(timeout=60)[0]
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert "resuming: topic laps holds" in output and "Traceback" not in output, output[-2000:]
    assert "the same command with --resume continues the loop where it stopped" in output, output[-2000:]
    held = topic_contents(broker, "laps")
    assert sum(map(len, held.values())) >= len(records) * 5 // 2 > before
    # the uninterrupted production, as far as every stream held goes (on a loaded host the SIGTERM came
    # laps after the count was reached: a fixed 4 laps of it was shorter than what a stream held)
    uninterrupted: dict[str, list[tuple[int, str]]] = {}
    laps = 2 + sum(map(len, held.values())) // len(records)  # enough for all that was held on one stream
    for record in itertools.islice(looped(records, manifest), len(records) * laps):
        uninterrupted.setdefault(record.stream, []).append((record.truth.position, record.text))
        if all(len(uninterrupted.get(stream, ())) >= len(got) for stream, got in held.items()):
            break
    assert set(held) <= set(uninterrupted)  # (no stream the production never writes)
    for stream, got in held.items():
        assert got == uninterrupted[stream][:len(got)], stream


def test_stream_i_goes_to_partition_i_mod_partitions_stamped_when_sent_and_the_truth_topic_is_one_partition(broker):
    """A distributed learner's rank reads the partitions of its own streams: stream i must be on partition
    i % partitions. Each record's produced header is the time it was sent (not the 0.0 it was built with),
    and the truth sidecar keeps one partition, whatever the topic's count, so its events stay in order."""
    import time

    from aiokafka import AIOKafkaConsumer

    from producers.kafka import produce
    from producers.wire import Record, Truth, decode

    topic = "by-stream"
    records = [Record(str(s), f"stream {s}\n", Truth("a", 0, 0, 0.0)) for s in range(7)]
    before = time.time()
    assert asyncio.run(produce(records, broker.bootstrap_servers, topic, partitions=3,
                               truth_topic=f"{topic}.truth")) == 7
    after = time.time()

    async def read():
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap_servers, auto_offset_reset="earliest",
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            got = []
            while len(got) < 7:
                batch = await consumer.getmany(timeout_ms=5000)
                assert batch, got
                got += [(m.partition, decode(m.key, m.value, m.headers)) for ms in batch.values() for m in ms]
            return got
        finally:
            await consumer.stop()
    got = asyncio.run(read())
    assert sorted((record.stream, partition) for partition, record in got) == [
        (str(s), s % 3) for s in range(7)]
    assert all(before <= record.truth.produced <= after for _, record in got)
    assert asyncio.run(ensure_topic(broker.bootstrap_servers, f"{topic}.truth", 3)) == 1


def test_progress_is_said_every_thousand_records_with_the_bytes_sent_and_once_at_the_end(broker):
    """`streamer produce` prints what the callback gets: records and value bytes sent (the bytes --token-rate
    paces), each 1,000 records and at the end."""
    from producers.kafka import produce
    from producers.wire import Record, Truth

    records = [Record(str(k % 2), "ab\n" if k % 3 else "čd\n", Truth("a", 0, k, 0.0)) for k in range(2500)]
    size = [len(r.text.encode()) for r in records]  # 3 bytes, or 4 with the č
    said = []
    asyncio.run(produce(records, broker.bootstrap_servers, "progress", progress=lambda n, b: said.append((n, b))))
    assert said == [(1000, sum(size[:1000])), (2000, sum(size[:2000])), (2500, sum(size))]
