"""No record can stop the learner: any key, value or header bytes are learned or dead-lettered with a
reason, counted, and the offset advances; dead letters never change the good records' losses.

(a) decode, stream ids, the dead-letter copy and the batcher, in memory; (b) poison of every kind
produced raw before and after a good stream, learned by `streamer learn` through the real broker;
(c) hypothesis draws random key/value/header bytes, all sent through the broker beside a good stream
and one learner run."""

import ast
import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from producers.kafka import ensure_topic
from producers.wire import (MAX_STREAM_ID, REASONS, Record, Truth, WireError, dead_letter_copy, decode, encode,
                            stream_id)
from streamer.batching import Batcher
from streamer.kafka.consumer import KafkaSource
from tests.conftest import write_corpus

STREAMER = [sys.executable, "-m", "streamer.cli"]
PINNED = json.loads((Path(__file__).parent / "data" / "pinned_losses.json").read_text())
STREAMS = 3
TRUTH = [("streamer.class", b"en"), ("streamer.fragment", b"0"), ("streamer.position", b"0"),
         ("streamer.produced", b"1.5")]


def reason_of(key, value, headers, *, streams=STREAMS, max_record_bytes=1_000_000):
    """What the learner does with these bytes: None (learned) or the dead-letter reason."""
    try:
        record = decode(key, value, headers, max_record_bytes=max_record_bytes)
    except WireError as exc:
        return exc.reason
    return None if Batcher(streams, 10).accepts(record.stream) else "extra_stream"


# --- (a) in memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("key,reason", [
    ("²".encode(), "bad_key"), ("٣".encode(), "bad_key"), ("١٢".encode(), "bad_key"), ("é".encode(), "bad_key"),
    (b"abc", "bad_key"), (b"-1", "bad_key"), (b"+1", "bad_key"), (b"01", "bad_key"), (b" 1", "bad_key"),
    (b"1\n", "bad_key"), (b"", "bad_key"), (b"\xff\xfe", "bad_key"), (b"0\x00", "bad_key"),
    (str(MAX_STREAM_ID).encode(), "bad_key"), (b"9" * 40, "bad_key"), (None, "missing_key"),
])
def test_keys_that_are_not_stream_ids_are_dead_lettered(key, reason):
    with pytest.raises(WireError) as info:
        decode(key, b"text", [])
    assert info.value.reason == reason


def test_stream_ids_are_ascii_decimal_below_two_to_the_31():
    assert [stream_id(s) for s in ("0", "7", "2147483647")] == [0, 7, 2**31 - 1]
    assert {stream_id(s) for s in ("2147483648", "²", "٣", "-0", "00", "1.0", "1e3", "")} == {None}
    assert decode(b"2147483647", b"x", []).stream == "2147483647"
    assert reason_of(b"3", b"x", []) == "extra_stream" and reason_of(b"2", b"x", []) is None


@pytest.mark.parametrize("value,headers,reason", [
    (None, [], "missing_value"),
    (b"", [], "empty_value"),
    (b"abc\x00def", [], "nul_byte"),
    (b"\xff\xfe broken", [], "bad_utf8"),
    (b"\xc3", [], "bad_utf8"),  # a cut multi-byte character
    (b"x" * 1_000_001, [], "too_large"),
    (b"x" * 999_000, [("h", b"y" * 2000)], "too_large"),  # headers count too
    (b"x", [TRUTH[0]], "bad_headers"),
    (b"x", [("streamer.class", b"\xff"), *TRUTH[1:]], "bad_headers"),
    (b"x", [("streamer.class", None), *TRUTH[1:]], "bad_headers"),
    (b"x", [("streamer.class", b""), *TRUTH[1:]], "bad_headers"),
    (b"x", [TRUTH[0], ("streamer.fragment", "٣".encode()), *TRUTH[2:]], "bad_headers"),
    (b"x", [TRUTH[0], ("streamer.fragment", b"-1"), *TRUTH[2:]], "bad_headers"),
    (b"x", [*TRUTH[:3], ("streamer.produced", b"nan")], "bad_headers"),
    (b"x", [*TRUTH[:3], ("streamer.produced", b"\xff")], "bad_headers"),
    (b"x", [*TRUTH, ("streamer.label", b"\xff")], "bad_headers"),
])
def test_values_and_headers_that_cannot_be_learned_are_dead_lettered(value, headers, reason):
    with pytest.raises(WireError) as info:
        decode(b"0", value, headers, max_record_bytes=1_000_000)
    assert info.value.reason == reason and reason in REASONS


def test_other_headers_are_ignored_whatever_their_bytes():
    record = decode(b"1", b"hi", [("trace", b"\xff\x00"), ("empty", None), ("", b"")])
    assert record == Record("1", "hi")
    assert decode(*encode(Record("1", "ça\n", Truth("cs", 2, 5, 1.25, "x")))).truth == Truth("cs", 2, 5, 1.25, "x")


def test_the_dead_letter_copy_is_capped_and_says_so():
    key, value, headers = dead_letter_copy(b"k" * 10_000, b"\xff" * 5_000_000, [(f"h{i}", b"v" * 10_000) for i in range(100)],
                                           reason="too_large", detail="d" * 5000, source="t:0:7")
    size = len(key) + len(value) + sum(len(n.encode()) + len(v or b"") for n, v in headers)
    assert size < 200_000 and len(value) == 64 * 1024
    names = dict(headers)
    assert names["streamer.truncated"] == b"1" and names["streamer.reason"] == b"too_large"
    assert names["streamer.source"] == b"t:0:7" and len(names["streamer.detail"]) <= 1024
    assert [n for n, _ in headers][-3:] == ["streamer.reason", "streamer.detail", "streamer.source"]
    assert dead_letter_copy(None, None, [], reason="missing_key", detail="", source="s")[:2] == (None, b"")
    small = dead_letter_copy(b"0", b"x", [("a", b"b")], reason="bad_key", detail="d", source="s")
    assert small[:2] == (b"0", b"x") and "streamer.truncated" not in dict(small[2]) and small[2][0] == ("a", b"b")


def test_a_key_that_is_not_a_stream_id_never_takes_a_row_whatever_arrives_first():
    batcher = Batcher(2, 3)
    for stream in ("abc", "²", "٣", "-1", "01", "2"):
        assert not batcher.accepts(stream)
        with pytest.raises(ValueError):
            batcher.add(Record(stream, "zzzz"))
    batcher.add(Record("1", "yyyy"))
    batcher.add(Record("0", "xxxx"))
    assert batcher.pop().batch.inputs.tolist() == [list(b"xxx"), list(b"yyy")]


# --- through the real broker ----------------------------------------------------------------------


class RawName(str):
    """A header name whose bytes are not UTF-8 (a non-Python producer can write one)."""

    def encode(self, *args, **kwargs):
        return b"\xff\xfename"


async def send_raw(bootstrap: str, topic: str, records, partition: int = 0) -> None:
    """Each (key, value, headers) as it is, in its own batch, to `partition`. A RawName header, or no key and
    no value (which aiokafka's send refuses), goes in a batch built by aiokafka's pure-Python builder."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=4_000_000)
    await producer.start()
    try:
        for key, value, headers in records:
            if key is None and value is None or any(isinstance(name, RawName) for name, _ in headers):
                batch = producer.create_batch()
                batch._builder = _DefaultRecordBatchBuilderPy(  # noqa: SLF001 - the only way to write such bytes
                    2, 0, is_transactional=0, producer_id=-1, producer_epoch=-1, base_sequence=0, batch_size=16384)
                batch.append(key=key, value=value, timestamp=None, headers=headers)
                await (await producer.send_batch(batch, topic, partition=partition))
            else:
                await producer.send_and_wait(topic, key=key, value=value, headers=headers, partition=partition)
    finally:
        await producer.stop()


async def read_dead_letters(bootstrap: str, topic: str) -> list:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=f"{topic}-reader", enable_auto_commit=False)
    await consumer.start()
    try:
        found, empty = [], 0
        while empty < 3:
            batch = await consumer.getmany(timeout_ms=1000)
            empty = 0 if batch else empty + 1
            found += [(dict(m.headers), m) for ms in batch.values() for m in ms]
        return found
    finally:
        await consumer.stop()


POISON = [  # (key, value, headers, reason): more than twelve kinds
    (None, b"no key", [], "missing_key"),
    ("²".encode(), b"superscript two", [], "bad_key"),
    ("٣".encode(), b"arabic-indic three", [], "bad_key"),
    ("ключ".encode(), b"cyrillic", [], "bad_key"),
    (b"abc", b"a named stream", [], "bad_key"),
    (b"-1", b"negative", [], "bad_key"),
    (b"2147483648", b"too large an id", [], "bad_key"),
    (b"k" * 5000, b"a long key", [], "bad_key"),
    # decoded, then refused: its copy keeps the producer's own header (it was re-encoded from the truth alone)
    (b"7", b"a stream beyond the rows", [("trace", b"id-7"), *TRUTH], "extra_stream"),
    (b"0", None, [], "missing_value"),
    (b"1", b"", [], "empty_value"),
    (b"2", b"nul \x00 inside", [], "nul_byte"),
    (b"0", b"\xff\xfe not utf-8", [], "bad_utf8"),
    (b"1", b"x", [("streamer.class", b"\xff\xfe"), *TRUTH[1:]], "bad_headers"),
    (b"2", b"\xff" * 1_200_000, [], "too_large"),
    (b"0", b"x", [(RawName("x"), b"v")], "unreadable"),
]


def produce_good(bootstrap: str, topic: str, root: Path) -> Path:
    """The pinned stream (tests/test_pinned_losses.py), so its clean losses are known; --append: after the
    poison the topic may hold already."""
    manifest = root / f"{topic}.manifest.json"
    result = subprocess.run([*STREAMER, "produce", "--corpus", str(write_corpus(root / "corpus")), "--bootstrap-servers",
                             bootstrap, "--topic", topic, "--fragments", "6", "--lambda", "300", "--streams", "3",
                             "--window", "10", "--seed", "0", "--manifest", str(manifest), "--append"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return manifest


def learn(bootstrap: str, topic: str, manifest: Path, run_dir: Path) -> tuple[list, dict, str]:
    """`streamer learn` as the pinned test runs it: (losses, dead letters by reason, stderr)."""
    result = subprocess.run(
        [*STREAMER, "learn", "--bootstrap-servers", bootstrap, "--topic", topic, "--manifest", str(manifest),
         "--streams", "3", "--window", "10", "--hidden", "24", "--embedding", "8", "--no-view", "--no-probe",
         "--group", f"{topic}-g", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    found = re.search(r"dead letters (\{.*?\})", result.stdout)
    dead = ast.literal_eval(found.group(1)) if found else {}
    losses = [json.loads(line)["loss"] for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    return losses, dict(dead), result.stderr


def assert_pinned(losses: list) -> None:
    assert len(losses) == len(PINNED["naive"])
    assert max(abs(a - b) for a, b in zip(losses, PINNED["naive"])) <= 1e-6


def test_poison_before_and_after_a_stream_is_dead_lettered_and_the_losses_are_a_clean_runs(broker, tmp_path):
    bootstrap, topic = broker.bootstrap_servers, "poison"
    raw = [(key, value, headers) for key, value, headers, _ in POISON]
    asyncio.run(ensure_topic(bootstrap, topic))  # one partition, as produce's: not the 4 of Tansu's auto-creation
    asyncio.run(send_raw(bootstrap, topic, raw))
    manifest = produce_good(bootstrap, topic, tmp_path)
    asyncio.run(send_raw(bootstrap, topic, raw))

    losses, dead, _ = learn(bootstrap, topic, manifest, tmp_path / "run")
    assert_pinned(losses)
    before = Counter(reason for *_, reason in POISON)
    assert all(before[reason] <= dead.get(reason, 0) <= 2 * before[reason] for reason in before), dead
    assert set(dead) <= set(before), dead

    letters = asyncio.run(read_dead_letters(bootstrap, f"{topic}.dlq"))
    assert Counter(headers["streamer.reason"].decode() for headers, _ in letters) == Counter(dead)
    sources = [headers["streamer.source"].decode() for headers, _ in letters]
    assert len(sources) == len(set(sources))  # one copy per poison record
    first = {int(source.rsplit(":", 1)[1]): headers["streamer.reason"].decode()
             for (headers, _), source in zip(letters, sources)}
    assert [first[offset] for offset in range(len(POISON))] == [reason for *_, reason in POISON]
    by_reason = {headers["streamer.reason"].decode(): (headers, m) for headers, m in letters}
    headers, message = by_reason["too_large"]
    assert headers["streamer.truncated"] == b"1" and len(message.value) == 64 * 1024
    assert len(by_reason["bad_key"][1].key or b"") <= 1024
    # each copy is its record as it came (cut to the DLQ sizes), its own headers before the streamer.* ones:
    # reason, source and sizes only were checked, so copies without the key or the headers passed
    messages = {int(headers["streamer.source"].decode().rsplit(":", 1)[1]): m for headers, m in letters}
    for offset, (key, value, headers, reason) in enumerate(POISON):
        if reason == "unreadable":  # no byte of it can be read
            key, value, headers = None, b"", []
        want_key, want_value, want_headers = dead_letter_copy(key, value, headers, reason=reason, detail="",
                                                              source="")
        got = messages[offset]
        assert (got.key, got.value) == (want_key, want_value), reason
        assert [(n, v) for n, v in got.headers][:-2] == want_headers[:-2], reason  # (then detail and source)


def test_a_failed_dead_letter_send_is_counted_and_logged_in_one_line(broker):
    lines = []

    async def go():
        source = KafkaSource(broker.bootstrap_servers, "unsent", "unsent-g", log=lines.append,
                             dead_letter_timeout_s=0.5)
        await ensure_topic(broker.bootstrap_servers, "unsent")  # start() waits for a topic that does not exist
        await source.start()
        await source._producer.stop()  # noqa: SLF001 - a real failure: the closed producer's send blocks
        message = type("Message", (), {"topic": "unsent", "partition": 0, "offset": 5, "key": b"\xff",
                                       "value": b"v", "headers": ()})()
        fetched = await source._decoded(message)  # noqa: SLF001
        await source.send_dead_letter(fetched, fetched.dead_reason, "")  # (as the loop does when it takes it)
        await source.stop()
        return source, fetched
    source, fetched = asyncio.run(go())
    assert fetched.record is None and fetched.dead_reason == "bad_key" and fetched.offset == 5
    failed = [line for line in lines if "failed" in line]  # (and the first bad_key's line)
    assert source.dead_letter_failures == 1 and len(failed) == 1 and "\n" not in failed[0]


def test_a_copy_in_flight_at_the_stop_is_counted_before_the_last_checkpoint(tmp_path):
    """A copy sent while the broker is frozen is in flight when the learner stops: the producer's close
    cancelled it after the last checkpoint and metrics were written, so its failure was never in them.
    settle_dead_letters (the learner's, before its last checkpoint) waits for it, then counts it, once; that
    failure does not keep the next copy from being tried (it would be counted, untried, for retry_s)."""
    import signal

    from streamer.broker import EmbeddedBroker
    from tests.helpers import until_stopped

    own, lines = EmbeddedBroker().start(), []

    async def go():
        await ensure_topic(own.bootstrap_servers, "settled")
        await ensure_topic(own.bootstrap_servers, "settled.dlq")
        await send_raw(own.bootstrap_servers, "settled", [(b"abc", b"bad key %d" % i, []) for i in range(3)])
        source = KafkaSource(own.bootstrap_servers, "settled", "settled-g", log=lines.append,
                             dead_letter_timeout_s=3.0)
        await source.start()
        taken = []
        while len(taken) < 3:
            taken += [fetched async for fetched in source.fetch()]
        await source.send_dead_letter(taken[0], taken[0].dead_reason, "")
        await source.settle_dead_letters()  # delivered: the broker answers
        assert source.dead_letter_failures == 0
        os.kill(own.pid, signal.SIGSTOP)
        until_stopped(own.pid)
        try:
            await source.send_dead_letter(taken[1], taken[1].dead_reason, "")  # (its metadata known: in flight)
            await source.settle_dead_letters()
            counted = source.dead_letter_failures  # what the last checkpoint holds
        finally:
            os.kill(own.pid, signal.SIGCONT)
        await source.send_dead_letter(taken[2], taken[2].dead_reason, "")  # tried, and delivered
        await source.settle_dead_letters()
        await source.stop()
        return counted, source.dead_letter_failures

    try:
        counted, at_the_end = asyncio.run(go())
    finally:
        own.stop()
    assert (counted, at_the_end) == (1, 1)
    failed = [line for line in lines if "failed" in line]
    assert len(failed) == 1 and "not delivered within 3 s before the learner stopped" in failed[0], lines


def test_a_dead_letter_topic_that_cannot_be_written_is_tried_once_a_while_and_said_in_few_lines(broker):
    """A topic of 246 characters is valid and its .dlq (250) is not: the broker never gives its metadata, so
    each send waits its whole timeout. After a failed send the copies are counted, untried, for
    `dead_letter_retry_s` (they used to hold fetching up a timeout and log a line each); after the first
    line the failures are said at most every `dead_letter_say_every_s`, with their count."""
    topic, lines = "refused-dlq-".ljust(246, "x"), []

    async def go():
        await ensure_topic(broker.bootstrap_servers, topic)
        await send_raw(broker.bootstrap_servers, topic, [(b"abc", b"bad key %d" % i, []) for i in range(11)])
        source = KafkaSource(broker.bootstrap_servers, topic, f"{topic[:20]}-g", log=lines.append,
                             dead_letter_timeout_s=0.5, dead_letter_retry_s=1.5, dead_letter_say_every_s=1.0)
        await source.start()
        taken = []
        while len(taken) < 11:
            taken += [fetched async for fetched in source.fetch()]
        for index, fetched in enumerate(taken):
            if index == 10:
                await asyncio.sleep(1.6)  # past the retry and the say interval: this copy is tried again
            await source.send_dead_letter(fetched, fetched.dead_reason, "")
        await source.stop()
        return source
    source = asyncio.run(go())
    failed = [line for line in lines if "failed" in line]
    assert source.dead_letter_failures == 11 and len(failed) == 2, failed  # every copy counted, in two lines
    assert f"dead letter to {topic}.dlq failed (not sent within 0.5 s" in failed[0] and "\n" not in failed[0]
    # two sends tried of 11 (each waits its 0.5 s), not eleven
    assert re.match(rf"10 more dead-letter copies to {topic}\.dlq failed in the last \d+s \(9 not tried", failed[1])

# --- (c) random bytes, one learner ----------------------------------------------------------------

NAMES = st.sampled_from(["streamer.class", "streamer.fragment", "streamer.position", "streamer.produced",
                         "streamer.label", "trace"]) | st.text(max_size=8)
HEADER_VALUES = st.none() | st.binary(max_size=12) | st.sampled_from([b"0", b"12", b"1.5", b"en", "٣".encode(), b""])
ID_KEYS = st.integers(STREAMS, MAX_STREAM_ID - 1).map(lambda n: str(n).encode())  # stream ids, beyond the rows
KEYS = st.one_of(ID_KEYS, ID_KEYS, ID_KEYS, st.none(), st.binary(max_size=12),
                 st.integers(-5, 2**32).map(lambda n: str(n).encode()), st.text("0123456789²٣١", max_size=4).map(str.encode))
VALUES = st.one_of(st.none(), st.just(b""), st.binary(max_size=40), st.binary(max_size=8).map(lambda b: b + b"\xc3"),
                   st.text(max_size=20).map(str.encode),
                   st.text(max_size=20).map(str.encode), st.text(max_size=8).map(lambda t: f"{t}\x00{t}".encode()))
HEADERS = st.lists(st.tuples(NAMES, HEADER_VALUES), max_size=5) | st.tuples(
    st.integers(0, len(TRUTH) - 1), HEADER_VALUES).map(lambda change: [(n, change[1] if i == change[0] else v)
                                                                     for i, (n, v) in enumerate(TRUTH)])
RAW = st.tuples(KEYS, VALUES, HEADERS)


def not_a_good_row(raw) -> bool:
    """Random records that would be learned into the good stream's rows would change its losses."""
    try:
        record = decode(*raw)
    except WireError:
        return True
    return stream_id(record.stream) >= STREAMS


def drawn_records(n: int) -> list:
    drawn = []

    @settings(max_examples=n, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(RAW.filter(not_a_good_row))
    def collect(raw):
        drawn.append(raw)
    collect()
    return drawn


def test_random_bytes_are_each_dead_lettered_with_a_counted_reason_and_the_losses_stay(broker, tmp_path):
    """All drawn records before the good stream (each must be dead-lettered with the reason decode
    predicts) and again after it (read or not when the run ends, never learned)."""
    bootstrap, topic = broker.bootstrap_servers, "random-poison"
    drawn = drawn_records(40)
    expected = [reason_of(*raw) for raw in drawn]
    assert None not in expected  # no drawn record is learnable into rows 0..2 (not_a_good_row)
    asyncio.run(ensure_topic(bootstrap, topic))  # one partition, as produce's: not the 4 of Tansu's auto-creation
    asyncio.run(send_raw(bootstrap, topic, drawn))
    manifest = produce_good(bootstrap, topic, tmp_path)
    asyncio.run(send_raw(bootstrap, topic, drawn))

    losses, dead, _ = learn(bootstrap, topic, manifest, tmp_path / "run")
    assert_pinned(losses)
    letters = asyncio.run(read_dead_letters(bootstrap, f"{topic}.dlq"))
    assert Counter(headers["streamer.reason"].decode() for headers, _ in letters) == Counter(dead)
    got = {int(headers["streamer.source"].decode().rsplit(":", 1)[1]): headers["streamer.reason"].decode()
           for headers, _ in letters}
    assert len(got) == len(letters)  # one copy per record
    assert [got.get(offset) for offset in range(len(drawn))] == expected
    after = len(drawn) + json.loads(manifest.read_text())["total_records"]
    assert all(got[offset] == expected[offset - after] for offset in got if offset >= after)
    assert set(dead) <= set(REASONS)
