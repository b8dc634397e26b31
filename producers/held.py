"""What a topic already holds, read record by record, and where a production it holds resumes.

`streamer produce` reads a topic before it writes: a topic that holds records is not given a second
copy of a stream unless asked, and an interrupted production resumes where it stopped. Records are
counted by reading them, never from offsets: Tansu's end offset of a partition is its last batch's
first offset + 1 (1034 for 1067 records), not a count. A partition has been read to its end once the
position has reached that end offset and a fetch brings nothing more (the last batch comes whole)."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CorruptRecordException, KafkaError

from producers.kafka import ProduceError, closed_quietly, started_client
from producers.wire import Record, WireError, decode

__all__ = ["Held", "StreamHeld", "held_by", "read_topic", "resume_positions"]

_UNREADABLE = (UnicodeDecodeError, CorruptRecordException)  # what aiokafka raises for a record it cannot parse


@dataclass
class StreamHeld:
    """A stream's records on the topic: how many, and the last (its truth says its position)."""

    records: int
    last: Record


@dataclass
class Held:
    """What a topic and its truth topic hold: `records` in all, per stream `streams`, `foreign` records
    that are no stream's wire record with truth headers; `announcements` on the truth topic and the last
    fragment announced per stream."""

    records: int = 0
    streams: dict[str, StreamHeld] = field(default_factory=dict)
    foreign: int = 0
    announcements: int = 0
    announced: dict[str, int] = field(default_factory=dict)

    def add(self, message) -> None:
        """One record read (None: one the Kafka client could not parse)."""
        self.records += 1
        try:
            record = None if message is None else decode(message.key, message.value, message.headers)
        except WireError:
            record = None
        if record is None or record.truth is None:
            self.foreign += 1
            return
        held = self.streams.get(record.stream)
        if held is None:
            self.streams[record.stream] = StreamHeld(1, record)
        else:
            held.records, held.last = held.records + 1, record

    def announce(self, message) -> None:
        self.announcements += 1
        try:
            said = json.loads(message.value)
            stream, fragment = str(said["stream"]), int(said["fragment"])
        except (ValueError, TypeError, KeyError, AttributeError):
            return
        self.announced[stream] = max(fragment, self.announced.get(stream, -1))


async def held_by(bootstrap_servers: str, topic: str, truth_topic: str | None = None,
                  client_options: Mapping | None = None, *, broker_timeout_s: float = 60.0,
                  log: Callable[[str], None] | None = None) -> Held:
    """What `topic` (and `truth_topic`, when given) hold; an empty Held for topics that do not exist.
    A broker that stops answering for `broker_timeout_s` is a ProduceError."""
    held = Held()
    await read_topic(bootstrap_servers, topic, held.add, client_options, broker_timeout_s, log)
    if truth_topic:
        await read_topic(bootstrap_servers, truth_topic, held.announce, client_options, broker_timeout_s, log)
    return held


async def read_topic(bootstrap_servers: str, topic: str, each: Callable, client_options: Mapping | None = None,
                     timeout_s: float = 60.0, log: Callable[[str], None] | None = None) -> None:
    """`each(message)` of every record `topic` holds, partition by partition in order (none when the topic
    does not exist; `each(None)` for a record the client cannot parse), to the end the module's docstring
    says."""
    consumer = await started_client(
        lambda: AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False,
                                 request_timeout_ms=max(1000, int(timeout_s * 1000)), **(client_options or {})),
        "stop", bootstrap_servers, client_options, timeout_s, log)
    try:
        await asyncio.wait_for(consumer.topics(), timeout_s)  # all topics' metadata: asks for none by name
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return
        assigned = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        ends = await asyncio.wait_for(consumer.end_offsets(assigned), timeout_s)
        starts = await asyncio.wait_for(consumer.beginning_offsets(assigned), timeout_s)
        assigned = [tp for tp in assigned if ends[tp] > starts[tp]]  # (an empty partition's end is its start)
        if not assigned:
            return
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        for partition in assigned:
            await _read_partition(consumer, partition, ends[partition], each, f"Kafka at {bootstrap_servers}",
                                  timeout_s)
    except (KafkaError, asyncio.TimeoutError) as exc:
        raise ProduceError(f"Kafka at {bootstrap_servers} did not let topic {topic} be read "
                           f"({type(exc).__name__})") from None
    finally:
        await closed_quietly(consumer.stop())


async def _read_partition(consumer, partition, end: int, each: Callable, kafka: str, timeout_s: float) -> None:
    """Every record of `partition` to `each`, None for one the client cannot parse (a header name that is not
    UTF-8; those after it in its batch cannot be parsed either): stepped past one at a time."""
    quiet_since, one_by_one = time.monotonic(), 0
    while True:
        position = await consumer.position(partition)
        try:
            fetched = await consumer.getmany(partition, timeout_ms=200, max_records=1 if one_by_one else None)
        except _UNREADABLE:
            if one_by_one:  # this very record
                each(None)
                consumer.seek(partition, position + 1)
            else:  # one of the fetch's records: back to its start, then one record at a time
                consumer.seek(partition, position)
            one_by_one = 100
            continue
        one_by_one = max(0, one_by_one - 1)
        for message in fetched.get(partition, ()):
            each(message)
        if fetched:
            quiet_since = time.monotonic()
        elif position >= end:
            return
        elif time.monotonic() - quiet_since > timeout_s:
            raise ProduceError(f"{kafka} gave none of topic {partition.topic}'s records past offset {position} "
                               f"of partition {partition.partition} for {timeout_s:g} s (--broker-timeout)")


def resume_positions(records: Iterable[Record], held: Held, topic: str, *, loop: bool = False) -> dict[str, int]:
    """Per stream, the position of the last record `topic` holds, once it is known to hold exactly the
    first records of this production, each once (`loop`: of its endless replay, producers.stream.looped);
    else a ProduceError that says what differs."""
    def differs(what: str) -> ProduceError:
        return ProduceError(f"cannot resume: topic {topic} {what}, so it is not an interrupted production of "
                            f"these flags; produce with the flags it was produced with, or onto a new --topic")

    if held.foreign:
        raise differs(f"holds {held.foreign} record(s) that are no stream's record with truth headers")
    ours: dict[str, list[Record]] = {}
    for record in records:
        ours.setdefault(record.stream, []).append(record)
    positions = {}
    for stream, got in sorted(held.streams.items()):
        mine = ours.get(stream)
        if not mine:
            raise differs(f"holds records of stream {stream}, which this production has not")
        lap, at = 0, got.last.truth.position
        if loop:  # a lap spans the stream's bytes; positions continue from lap to lap
            lap, at = divmod(at, mine[-1].truth.position + len(mine[-1].text.encode("utf-8")))
        starts = [record.truth.position for record in mine]
        index = bisect.bisect_left(starts, at)
        same = index < len(mine) and starts[index] == at and mine[index].text == got.last.text \
            and mine[index].truth.class_name == got.last.truth.class_name
        if not same:
            raise differs(f"holds a record of stream {stream} at position {got.last.truth.position} that this "
                          f"production does not write there")
        if got.records != lap * len(mine) + index + 1:
            raise differs(f"holds {got.records} records of stream {stream} up to position "
                          f"{got.last.truth.position}, where one production has {lap * len(mine) + index + 1}")
        positions[stream] = got.last.truth.position
    return positions
