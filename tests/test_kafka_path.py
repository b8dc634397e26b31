"""The whole path through the real embedded broker: produce, consume, learn, commit, export.

That the model never reads class headers is checked on the memory path for every strategy
(test_strategy_conformance.py); the Kafka path gives the memory path's losses (below). Serving the
metrics to a real Prometheus during a run is test_prometheus_live.py."""

import asyncio
import dataclasses
import gc
import json
import math
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client import generate_latest

from monitor.calm import calm_metrics
from monitor.exporter import create_metrics
from monitor.live import LiveMonitor
from monitor.losslog import read_loss_log
from producers.kafka import produce
from producers.wire import Record, encode
from streamer.checkpoint import load
from streamer.config import LearnConfig
from streamer.broker import EmbeddedBroker
from streamer.kafka.consumer import KafkaSource
from streamer.learner import run as run_learner
from streamer.step import run
from tests.helpers import TINY, batches_from_records, naive, small_stream, until_stopped

CORPUS = {"en": "hello world, how are you today " * 300, "fr": "bonjour le monde, ça va bien " * 300,
          "cs": "ahoj světe, jak se dnes máš " * 300}


def _config(broker, topic, tmp_path, manifest, **kw):
    return LearnConfig(
        bootstrap_servers=broker.bootstrap_servers, topic=topic, group_id=f"{topic}-g",
        run_dir=tmp_path / topic, run_name=topic, streams=manifest["streams"], window=manifest["window"],
        model=TINY, seed=0, device="cpu", total_batches=manifest["total_batches"],
        classes=tuple(manifest["classes"]), n_fragments=manifest["n_fragments"], idle_timeout_s=20, **kw)


def _learn(config, metrics=None):
    monitor = LiveMonitor(run=config.run_name, strategy="naive", classes=config.classes, metrics=metrics)
    summary = asyncio.run(run_learner(config, monitor=monitor))
    return summary, monitor


@pytest.fixture
def stream():
    return small_stream(CORPUS, fragments=7, mean_tokens=900, streams=3, window=10, seed=2)


def test_kafka_path_equals_the_memory_path_and_commits_what_it_learned(broker, stream, tmp_path):
    records, manifest = stream
    asyncio.run(produce(records, broker.bootstrap_servers, "path"))
    metrics = create_metrics()
    summary, monitor = _learn(_config(broker, "path", tmp_path, manifest), metrics)

    assert summary.stop_reason == "end_of_stream"
    assert json.loads((summary.run_dir / "config.json").read_text())["device"] == "cpu"
    log = read_loss_log(summary.run_dir / "losses.jsonl")
    assert len(log) == manifest["total_batches"]
    expected = [r.loss for r in run(naive(seed=0), batches_from_records(records, 3, 10))]
    assert [line["loss"] for line in log] == pytest.approx(expected, rel=1e-6)
    fragments = [f["index"] for f in manifest["fragments"] for _ in range(f["n_batches"])]
    assert [line["sequence"] for line in log] == fragments
    # synchronised streams: every batch has its fragment's class
    assert [line["domain_name"] for line in log] == [f["class"] for f in manifest["fragments"]
                                                      for _ in range(f["n_batches"])]
    assert {line["domain_name"]: line["domain"] for line in log} == {c: i for i, c in enumerate(manifest["classes"])}

    # live metrics == offline metrics over the same log
    live = monitor.tracker.snapshot()
    offline = calm_metrics(log)
    for key in ("loss", "ppl", "ppl@sw", "rec", "n_batches", "n_revisits"):
        assert live[key] == pytest.approx(offline[key], rel=1e-9)

    exported = generate_latest(metrics.registry).decode()
    assert f'streamer_batches_learned_total{{run="path",strategy="naive"}} {float(len(log))}' in exported
    assert f'streamer_switches_total{{run="path",strategy="naive"}} {float(manifest["n_fragments"] - 1)}' in exported

    # committed: what the final checkpoint covers, i.e. every record read (the b closing bytes,
    # never learned, are carried over in the checkpoint's batcher state)
    saved = load(summary.run_dir / "checkpoint.pt")
    assert saved["offsets"] == {"path:0": len(records)} and saved["step"] == len(log)

    async def committed():
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap_servers, group_id="path-g")
        await consumer.start()
        try:
            return await consumer.committed(TopicPartition("path", 0))
        finally:
            await consumer.stop()
    assert asyncio.run(committed()) == len(records)


class LagReadings(LiveMonitor):
    """The lag of each reading of the loop, with the batches learned by then; each result 10 ms slow, so
    that a run of a few hundred batches spans several of the loop's lag reads (one a second)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lags = []

    def observe(self, result):
        time.sleep(0.01)
        return super().observe(result)

    def read(self, reading):
        if reading.lag:
            self.lags.append((reading.step, reading.lag[0]))
        super().read(reading)


def test_the_exported_ppl_and_ppl_at_switch_are_the_reports_over_its_span(broker, tmp_path):
    """A run scored over fragments >= N/2 (the default span): streamer_class_loss_mean was each class's
    mean over the whole stream beside ppl@sw over the span, so the dashboard's ppl and ppl@sw bars (and
    streamer:switch_spike_ratio) compared two spans. Both gauges are the run's report's now."""
    from monitor.report import build_report

    records, manifest = small_stream(CORPUS, fragments=12, mean_tokens=500, streams=3, window=10, seed=3)
    asyncio.run(produce(records, broker.bootstrap_servers, "span"))
    config = _config(broker, "span", tmp_path, manifest, from_fragment=manifest["n_fragments"] // 2)
    metrics = create_metrics()
    monitor = LiveMonitor(run=config.run_name, strategy="naive", classes=config.classes, k=config.k,
                          from_fragment=config.from_fragment, metrics=metrics)
    summary = asyncio.run(run_learner(config, monitor=monitor))
    assert summary.stop_reason == "end_of_stream"
    report = build_report(summary.run_dir)["metrics"]
    assert report["from_fragment"] == 6 and report["n_revisits"] > 0
    exported = generate_latest(metrics.registry).decode()

    def gauge(name: str, cls: str) -> float | None:
        found = re.search(rf'^streamer_{name}{{class="{re.escape(cls)}",run="span",strategy="naive"}} (\S+)$',
                          exported, flags=re.MULTILINE)
        return None if found is None else math.exp(float(found.group(1)))

    compared = 0
    for cls, entry in [*report["per_class"].items(), ("all", report)]:
        assert gauge("class_loss_mean", cls) == pytest.approx(entry["ppl"], rel=1e-9), cls
        if entry["ppl@sw"] is not None:
            assert gauge("loss_after_switch_mean", cls) == pytest.approx(entry["ppl@sw"], rel=1e-9), cls
            compared += 1
    assert compared >= 2


def test_a_backlog_shows_its_lag_falling_while_the_fetch_side_waits_for_room(broker, tmp_path):
    """The whole topic written before the learner starts (a daemon's backlog after a restart): one
    fetch returns every record, so the consumer's position is the log's end at once, and the fetch
    side then waits for room in the queue for most of the run. The lag is the records the batcher
    has not taken yet, read on while it waits: above 0 until the last records are taken (the
    position alone said 0 from the first fetch), falling as batches are learned (read only between
    two fetches it stood still for the whole run), 0 at the end."""
    records, manifest = small_stream(CORPUS, fragments=7, mean_tokens=3000, streams=3, window=10, seed=2)
    assert len(records) < 2000  # one fetch's max_records: every record in the first fetch
    asyncio.run(produce(records, broker.bootstrap_servers, "backlog"))
    config = _config(broker, "backlog", tmp_path, manifest)
    monitor = LagReadings(run=config.run_name, strategy="naive", classes=config.classes)
    summary = asyncio.run(run_learner(config, monitor=monitor))
    assert summary.stop_reason == "end_of_stream" and summary.batches == manifest["total_batches"]
    lags = [lag for _, lag in monitor.lags]
    early = [lag for step, lag in monitor.lags if step < manifest["total_batches"] // 2]
    assert early and max(early) > len(records) // 3, monitor.lags  # a queue of 64 batches holds 192 records
    assert lags == sorted(lags, reverse=True) and len(set(lags)) >= 3, monitor.lags
    assert lags[-1] == 0, monitor.lags


class TransactionLog:
    """The calls of aiokafka's consumer that KafkaSource.fetch and lag make, over one partition
    holding a transaction's records 0-4 and its commit marker at offset 5, as aiokafka's fetcher serves
    it: getmany returns the 5 records and moves the position past the marker to 6, the log's end. (The
    embedded broker refuses transactional producers: UnknownError on the first send.)"""

    def __init__(self):
        self.tp, self._position = TopicPartition("txn", 0), 0
        key, value, headers = encode(Record("0", "a transaction's record"))
        self._records = [SimpleNamespace(topic="txn", partition=0, offset=offset, key=key, value=value,
                                         headers=headers) for offset in range(5)]

    def assignment(self):
        return {self.tp}

    def paused(self):
        return set()

    def highwater(self, tp):
        return 6

    async def position(self, tp):
        return self._position

    async def getmany(self, timeout_ms, max_records):
        got, self._position = ({self.tp: self._records} if self._position == 0 else {}), 6
        return got


def test_the_lag_of_a_caught_up_learner_is_0_past_a_commit_marker_it_never_sees():
    """A transactional producer (Kafka Streams, Flink exactly-once) ends each transaction with a commit
    marker: an offset that holds no record. While a fetch's records are being taken, the lag counts
    those beyond the batcher's next offset; once taken, it counts from the consumer's position, past
    the marker: 0 for a learner that has caught up, never a lasting 1 (StreamerLearnerStalled would
    fire on it 2 minutes after the producer paused)."""
    source = KafkaSource("127.0.0.1:1", "txn", "txn-g", dead_letter=False, log=lambda line: None)
    source._consumer = log = TransactionLog()

    async def take():
        taken, seen = {}, []
        async for fetched in source.fetch():
            seen.append(await source.lag(taken))  # before the batcher takes this record
            taken[("txn", 0)] = fetched.offset + 1
        seen.append(await source.lag(taken))  # every record taken: from the position
        return seen
    assert asyncio.run(take()) == [{0: 6}, {0: 5}, {0: 4}, {0: 3}, {0: 2}, {0: 0}]
    assert asyncio.run(source.lag({("txn", 0): 5})) == {0: 0} and log.highwater(log.tp) == 6


def test_bad_records_are_dead_lettered_counted_and_learning_goes_on(broker, stream, tmp_path, capsys):
    """Each is counted and copied to the DLQ; the first of each reason is said in one line (a topic of records
    without keys went to the DLQ in silence, the run learning nothing)."""
    records, manifest = stream

    async def produce_bad_then_good():
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
        await producer.start()
        await producer.send_and_wait("dirty", key=b"0", value=b"\xff\xfe broken")
        await producer.send_and_wait("dirty", key=None, value=b"no key")
        await producer.send_and_wait("dirty", key=None, value=b"no key again")
        await producer.send_and_wait("dirty", key=b"0", value=b"x", headers=[("streamer.class", b"en")])
        await producer.send_and_wait("dirty", key=b"99", value=b"a fourth stream")
        await producer.stop()
        await produce(records, broker.bootstrap_servers, "dirty")
    asyncio.run(produce_bad_then_good())
    summary, monitor = _learn(_config(broker, "dirty", tmp_path, manifest))

    assert summary.batches == manifest["total_batches"]
    assert monitor.dead_letters == {"bad_utf8": 1, "missing_key": 2, "bad_headers": 1, "extra_stream": 1}
    said = [line for line in capsys.readouterr().out.splitlines() if " dead-lettered (" in line]
    assert sorted(re.search(r"dead-lettered \((\w+)", line).group(1) for line in said) == [
        "bad_headers", "bad_utf8", "extra_stream", "missing_key"]
    assert re.fullmatch(r"record dirty:\d+:\d+" + re.escape(
        " dead-lettered (missing_key), a copy sent to dirty.dlq; later missing_key records this process reads are "
        "only counted "
        "(streamer_dead_letter_total). A record is key = its stream id 0..b-1, value = UTF-8 text, the truth in four "
        "optional headers (README: How a stream looks)"), next(line for line in said if "(missing_key" in line))

    async def dead_letters():
        consumer = AIOKafkaConsumer("dirty.dlq", bootstrap_servers=broker.bootstrap_servers,
                                    auto_offset_reset="earliest", group_id="dlq-reader")
        await consumer.start()
        try:
            batch = await consumer.getmany(timeout_ms=5000)
            return [dict(m.headers)["streamer.reason"].decode() for ms in batch.values() for m in ms]
        finally:
            await consumer.stop()
    assert sorted(asyncio.run(dead_letters())) == ["bad_headers", "bad_utf8", "extra_stream", "missing_key",
                                                   "missing_key"]


def test_an_independent_schedule_is_learned_through_kafka_without_changes_to_the_learner(broker, tmp_path):
    """Streams switching on their own plans. The synchronised kinds (calm, sequence, recurring) give
    records of one shape, differing only in the order and lengths of fragments: calm's are learned
    through Kafka above."""
    from producers.schedule import Schedule, build_stream

    schedule = Schedule(kind="independent", n_fragments=5, mean_tokens=600, streams=3, window=10, seed=1,
                        probe_tokens=200)
    records, manifest = build_stream(CORPUS, schedule)
    topic = "schedule-independent"
    asyncio.run(produce(records, broker.bootstrap_servers, topic))
    summary, monitor = _learn(_config(broker, topic, tmp_path, manifest))
    assert summary.stop_reason == "end_of_stream"
    log = read_loss_log(summary.run_dir / "losses.jsonl")
    assert len(log) == manifest["total_batches"]


def test_an_utterance_stream_is_learned_through_kafka(broker, tmp_path):
    from producers.schedule import Schedule
    from producers.utterance_stream import build_utterance_stream

    examples = {"en": [(f"turn on light {i}", "on") for i in range(200)],
                "fr": [(f"allume la lumière {i}", "on") for i in range(200)]}
    records, manifest = build_utterance_stream(
        examples, Schedule(n_fragments=6, mean_tokens=30, streams=3, window=10, seed=2), probe_examples=10)
    asyncio.run(produce(records, broker.bootstrap_servers, "utterances"))
    summary, _ = _learn(_config(broker, "utterances", tmp_path, manifest))
    assert summary.stop_reason == "end_of_stream" and summary.batches == manifest["total_batches"] > 0
    log = read_loss_log(summary.run_dir / "losses.jsonl")
    assert {line["domain_name"] for line in log} == {"en", "fr"}


def test_a_backlogs_partitions_are_read_side_by_side_not_each_whole_in_turn(broker, tmp_path):
    """A backlog of 4 streams on 4 partitions. aiokafka returns one partition's records, then the next's,
    and a batch needs every stream: the first partitions were read whole into their streams' buffers (and
    the checkpoint) before the last one's first record came. A partition whose streams hold enough is now
    left unread while a batch waits for another's, so what is carried over stays within a fetch (2,000
    records) and 256 windows (256 records here), whatever the backlog's length; and the losses stay the
    memory path's."""
    records, manifest = small_stream(CORPUS, fragments=4, mean_tokens=60_000, streams=4, window=10, seed=3)
    per_partition = len(records) // 4
    assert per_partition >= 5_000  # well over a fetch
    asyncio.run(produce(records, broker.bootstrap_servers, "side-by-side", partitions=4))
    summary, _ = _learn(_config(broker, "side-by-side", tmp_path, manifest, max_batches=60))

    carried = load(summary.run_dir / "checkpoint.pt")["loop"]["batcher"]["offsets"]
    pending = {part["partition"][1]: len(part["pending"]) + sum(len(lane) for _, lane in part["lanes"])
               for part in carried}
    assert len(pending) == 4 and max(pending.values()) <= 2_300, pending  # (before: 3 of them all 5,259)
    log = read_loss_log(summary.run_dir / "losses.jsonl")
    expected = [r.loss for r in run(naive(seed=0), batches_from_records(records, 4, 10)[:60])]
    assert [line["loss"] for line in log] == pytest.approx(expected, rel=1e-6)


def test_a_held_partitions_lag_counts_the_records_written_while_it_is_held(broker):
    """A held partition is not fetched, so the end its last fetch saw grows old: a daemon that holds one
    while a backlog on another is learned said its lag was what it had been when the hold began. Its end
    is asked of the broker while it is held, in the background (a read never waits on the network), and
    stands once the hold ends, until a fetch of it has seen as far."""
    records = [Record(str(i % 2), f"record {i}") for i in range(40)]
    asyncio.run(produce(records, broker.bootstrap_servers, "held-lag", partitions=2))

    async def lags():
        source = KafkaSource(broker.bootstrap_servers, "held-lag", "held-lag-g", partitions=[0, 1],
                             dead_letter=False, log=lambda line: None)
        source.seek_on_assign(dict)
        await source.start()
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
        await producer.start()
        try:
            taken = {}
            while sum(taken.values()) < 40:
                async for fetched in source.fetch():
                    taken[fetched.tp] = fetched.offset + 1
            seen = [await source.lag(taken)]
            assert source.hold({("held-lag", 0)}) == {("held-lag", 0)}
            for i in range(7):
                key, value, headers = encode(Record("0", f"written while held {i}"))
                await producer.send_and_wait("held-lag", value, key=key, headers=headers, partition=0)
            deadline = time.monotonic() + 10
            while (lag := await source.lag(taken)) != {0: 7, 1: 0} and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            seen.append(lag)
            source.hold(set())  # read again: its last fetch's end is still the old one
            seen.append(await source.lag(taken))
            return seen
        finally:
            await producer.stop()
            await source.stop()
    assert asyncio.run(lags()) == [{0: 0, 1: 0}, {0: 7, 1: 0}, {0: 7, 1: 0}]


def test_a_partition_read_again_from_an_earlier_offset_lags_only_beyond_what_was_read(broker):
    """A learner that reads a partition again (sought back to a record it skipped) has its consumer's
    position there: the records between were counted as lag again, though taken, and the lag jumped at
    each rewind. Past `read` (the furthest offset read) they are not; the loop adds those it skipped."""
    records = [Record("0", f"record {i}") for i in range(20)]
    asyncio.run(produce(records, broker.bootstrap_servers, "read-again"))

    async def lags():
        source = KafkaSource(broker.bootstrap_servers, "read-again", "read-again-g", partitions=[0],
                             dead_letter=False, log=lambda line: None)
        source.seek_on_assign(dict)
        await source.start()
        try:
            taken = {}
            while taken.get(("read-again", 0), 0) < 20:
                async for fetched in source.fetch():
                    taken[fetched.tp] = fetched.offset + 1
            source.seek(("read-again", 0), 5)
            return await source.lag(), await source.lag(read={("read-again", 0): 20}), await source.lag(
                read={("read-again", 0): 12})
        finally:
            await source.stop()
    assert asyncio.run(lags()) == ({0: 15}, {0: 0}, {0: 8})


def test_a_lag_read_with_a_held_partition_does_not_wait_for_a_broker_that_is_away():
    """A held partition's end is asked of the broker, which retries for its request timeout (15 s) while
    the broker is away: the read waited for it, and the loop, which gives a read 1 s, dropped every
    partition's figure. It gives the last ones at once."""
    with EmbeddedBroker() as own:
        records = [Record(str(i % 2), f"record {i}") for i in range(10)]
        asyncio.run(produce(records, own.bootstrap_servers, "away", partitions=2))

        async def lags():
            source = KafkaSource(own.bootstrap_servers, "away", "away-g", partitions=[0, 1], dead_letter=False,
                                 log=lambda line: None)
            source.seek_on_assign(dict)
            await source.start()
            try:
                taken = {}
                async for fetched in source.fetch():
                    taken[fetched.tp] = fetched.offset + 1
                source.hold({("away", 0)})
                own.stop()
                started = time.monotonic()
                lag = await source.lag(taken)
                return lag, time.monotonic() - started
            finally:
                await source.stop()
        lag, took = asyncio.run(lags())
    assert lag == {0: 0, 1: 0} and took < 0.5, (lag, took)


def test_a_commit_given_up_on_a_frozen_broker_leaves_no_traceback_when_its_request_fails_later():
    """aiokafka sends a commit from a shielded task, which the commit's timeout does not cancel: with the
    broker frozen (SIGSTOP) the request failed once the consumer closed, and asyncio printed "Task
    exception was never retrieved" with a 12-line traceback (every rank of a learner did). The commit's
    own line says it failed; nothing else is said."""
    said = []
    with EmbeddedBroker() as own:
        asyncio.run(produce([Record("0", f"record {i}") for i in range(10)], own.bootstrap_servers, "frozen"))

        async def commit_then_stop():
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: said.append(context["message"]))
            source = KafkaSource(own.bootstrap_servers, "frozen", "frozen-g", dead_letter=False, log=said.append,
                                 commit_timeout_s=1.0)
            source.seek_on_assign(dict)
            await source.start()
            try:
                async for fetched in source.fetch():
                    pass
                os.kill(own.pid, signal.SIGSTOP)
                until_stopped(own.pid)  # (the stop is asynchronous: a loaded machine's threads may lag)
                committed = await source.commit({("frozen", 0): 10})
            finally:
                await source.stop()
                os.kill(own.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)  # the abandoned request fails now, or already has
            gc.collect()
            return committed
        assert asyncio.run(commit_then_stop()) is False
        gc.collect()
    assert len(said) == 1 and said[0].startswith("commit of offsets [(0, 10)] failed (TimeoutError)"), said


def test_a_stream_far_ahead_stays_in_kafka_while_a_batch_waits_for_another_and_a_restart_reads_on(broker, tmp_path):
    """Stream 1's records lie behind all of streams 0 and 2's in one partition (it stopped while they went on).
    A batch needs a window of each, so the learner read the others whole into memory and its checkpoint;
    now each keeps at most --keep-windows windows (4 here) and their further records stay in Kafka,
    read again (aiokafka's seek) once they hold half as many. Stopped after 10 batches, mid-way, the
    checkpoint holds that little; the same run continued to the end gives the memory path's losses. The
    records read again are counted, in the checkpoint and, continued from it, in the exported counter; a
    rewind's fetch holds few, so they are fewer than three times the records (9 times with aiokafka's fetches of
    up to 2,000 while reading again)."""
    from monitor.console import STATUS_FILE, read_status
    from streamer.resume import resume_state

    records, manifest = small_stream(CORPUS, fragments=4, mean_tokens=900, streams=3, window=10, seed=4)
    late = [r for r in records if r.stream != "1"] + [r for r in records if r.stream == "1"]
    asyncio.run(produce(late, broker.bootstrap_servers, "far-ahead"))
    config = _config(broker, "far-ahead", tmp_path, manifest, keep_windows=4, total_records=len(records))
    lines = []
    first = dataclasses.replace(config, max_batches=10)
    asyncio.run(run_learner(first, monitor=LiveMonitor(run="far-ahead", strategy="naive"), log=lines.append))

    saved = load(config.run_dir / "checkpoint.pt")
    held = [len(buffer["data"]) for buffer in saved["loop"]["batcher"]["buffers"]]
    assert saved["step"] == 10 and max(held) <= 4 * 10 + 10, held  # (records of up to 10 bytes here)
    assert sum(len(r.text.encode()) for r in late if r.stream == "0") > 1000  # (all of it, before)
    assert any(line.startswith("partition 0: stream 0 holds more than 4 windows") for line in lines), lines
    assert saved["loop"]["read_again"] > 0
    log_path = config.run_dir / "losses.jsonl"  # a crash of the machine lost its last 3 lines: said, not hidden
    log_path.write_text("".join(log_path.read_text().splitlines(keepends=True)[:7]))

    metrics = create_metrics()
    summary = asyncio.run(run_learner(config, monitor=LiveMonitor(run="far-ahead", strategy="naive", metrics=metrics),
                                      resume=resume_state(config.run_dir, config), log=lines.append))
    assert summary.stop_reason == "end_of_stream"
    exported = next(float(line.split()[-1]) for line in generate_latest(metrics.registry).decode().splitlines()
                    if line.startswith("streamer_records_read_again_total{"))
    again = load(config.run_dir / "checkpoint.pt")["loop"]["read_again"]
    status = read_status(config.run_dir / STATUS_FILE)
    assert again > saved["loop"]["read_again"] and exported == again == status.read_again
    assert again < 3 * len(records)  # (603 for 324 records; with fetches of up to 2,000 while reading again 2,950)
    log = read_loss_log(config.run_dir / "losses.jsonl")
    expected = [r.loss for r in run(naive(seed=0), batches_from_records(records, 3, 10))]
    assert [line["loss"] for line in log] == pytest.approx(expected[:7] + expected[10:], rel=1e-6)
    assert ("losses.jsonl holds 7 of the checkpoint's 10 batches: batches 7 to 9 are missing from the loss log "
            "(cut, or lost in a crash of the machine), so a report from it leaves them out; the model learned "
            "them") in lines


def test_poison_among_records_read_again_is_dead_lettered_once_and_no_record_is_lost(broker, tmp_path):
    """Streams 0 and 2's records, with a record whose key is no stream id and one the Kafka client cannot
    parse among them, lie before all of stream 1's; each stream keeps 4 windows, so the partition is read
    again many times over the poison. Each poison record is dead-lettered once (the consumer sent a copy
    at every read), and the run gives the memory path's losses: a rereading stepping past the unparsable
    record one record at a time went on fetching after a jump sought the partition on, and the records it
    fetched were passed over as lying before the jump's end, though after it."""
    from collections import Counter

    from tests.test_poison import RawName, read_dead_letters, send_raw

    records, manifest = small_stream(CORPUS, fragments=4, mean_tokens=900, streams=3, window=10, seed=4)
    ahead = [r for r in records if r.stream != "1"]
    bootstrap, topic, cut = broker.bootstrap_servers, "far-ahead-poison", len(ahead) * 3 // 4
    asyncio.run(produce(ahead[:cut], bootstrap, topic))
    asyncio.run(send_raw(bootstrap, topic, [(b"abc", b"a named stream", []), (b"0", b"x", [(RawName("x"), b"v")])]))
    asyncio.run(produce(ahead[cut:] + [r for r in records if r.stream == "1"], bootstrap, topic))
    config = _config(broker, topic, tmp_path, manifest, keep_windows=4, total_records=len(records) + 2)
    summary, _ = _learn(config)

    assert summary.stop_reason == "end_of_stream"
    log = read_loss_log(config.run_dir / "losses.jsonl")
    expected = [r.loss for r in run(naive(seed=0), batches_from_records(records, 3, 10))]
    assert [line["loss"] for line in log] == pytest.approx(expected, rel=1e-6)
    letters = asyncio.run(read_dead_letters(bootstrap, f"{topic}.dlq"))
    assert Counter(headers["streamer.reason"].decode() for headers, _ in letters) == {"bad_key": 1, "unreadable": 1}


def test_a_partition_sought_while_a_fetch_steps_past_an_unparsable_record_is_read_on_from_there(broker):
    """A record the Kafka client cannot parse in partition 1 makes the fetch read every partition one record
    at a time. The learner seeks partition 0 on (a jump, when it reads records again) while that goes on,
    and passes over the fetch's further records of it: the stepping went on fetching partition 0 from the
    new offset, so the records it yielded there were passed over and never read again."""
    from tests.test_poison import RawName, send_raw

    bootstrap, topic = broker.bootstrap_servers, "step-seek"
    asyncio.run(produce([Record("0", f"record {i}") for i in range(10)], bootstrap, topic, partitions=2))
    asyncio.run(send_raw(bootstrap, topic, [(b"1", b"x", [(RawName("x"), b"v")])], partition=1))

    async def read():
        source = KafkaSource(bootstrap, topic, f"{topic}-g", partitions=[0, 1], dead_letter=False,
                             log=lambda line: None)
        source.seek_on_assign(dict)
        await source.start()
        taken, deadline = [], time.monotonic() + 20
        try:
            while len(taken) < 6 and time.monotonic() < deadline:
                sought = set()
                async for fetched in source.fetch():
                    if fetched.tp in sought:
                        continue
                    taken.append((fetched.tp[1], fetched.offset, fetched.dead_reason))
                    if fetched.tp == (topic, 0) and fetched.offset == 2 and (0, 8, None) not in taken:
                        source.seek(fetched.tp, 8)
                        sought.add(fetched.tp)
            return taken
        finally:
            await source.stop()
    taken = asyncio.run(read())
    assert (1, 0, "unreadable") in taken and sorted(offset for p, offset, _ in taken if p == 0) == [0, 1, 2, 8, 9]
