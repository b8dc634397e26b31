"""The Kafka side of the learner: the only module of streamer/ that imports aiokafka.

Fetches in batches, decodes wire records, dead-letters bad ones (counted by
reason and sent to `<topic>.dlq` as producers.wire.dead_letter_copy makes them;
a failed send is counted in `dead_letter_failures`, logged, and never raised),
commits offsets only when asked, and reports consumer lag.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CorruptRecordException, IllegalStateError, KafkaConnectionError, KafkaError

from producers.wire import MAX_RECORD_BYTES, Record, WireError, dead_letter_copy, decode, encode

__all__ = ["KafkaSource", "SourceError", "Fetched", "SeekOnAssign"]


class SourceError(RuntimeError):
    pass


UNREADABLE = (UnicodeDecodeError, CorruptRecordException)  # raised by aiokafka while parsing a fetched record


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Fetched:
    record: Record | None  # None when dead-lettered
    tp: tuple[str, int]
    offset: int
    dead_reason: str | None = None


class KafkaSource:
    def __init__(self, bootstrap_servers: str, topic: str, group_id: str,
                 *, max_records: int = 2000, dead_letter: bool = True,
                 max_record_bytes: int | None = MAX_RECORD_BYTES, dead_letter_timeout_s: float = 5.0, log=None):
        """`max_record_bytes`: larger records are dead-lettered as too_large (None: no limit).
        `dead_letter_timeout_s`: the longest a dead-letter send may hold up fetching; then it counts as
        failed. `log`: where the one line per failed dead-letter send goes (default: standard error)."""
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.group_id = group_id
        self.max_records = max_records
        self.dead_letter = dead_letter
        self.max_record_bytes = max_record_bytes
        self.dead_letter_timeout_s = dead_letter_timeout_s
        self.dead_letter_failures = 0  # dead-letter sends that failed (each record is counted by reason too)
        self._log = log or _stderr
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None

    def seek_on_assign(self, positions, from_beginning: bool = False) -> None:
        """Before start(): on every assignment, seek each partition to `positions()`'s
        {(topic, partition): next offset} (the learner's own: a checkpoint's, then what it has read);
        a partition it has no position for starts at the group's committed offset, or at the earliest
        (`from_beginning`, or nothing committed)."""
        self._seek_positions, self._from_beginning = positions, from_beginning

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers, group_id=self.group_id,
            enable_auto_commit=False, auto_offset_reset="earliest", request_timeout_ms=15_000,
            # A slow strategy (30 experts, MbPA++'s local steps, a pretrained model on a CPU) keeps the
            # bounded queue full, so fetches pause for minutes; the background heartbeat still proves
            # liveness, so the poll interval must not evict the learner from its group.
            max_poll_interval_ms=24 * 3600 * 1000,
        )
        listener = SeekOnAssign(self._consumer, getattr(self, "_seek_positions", dict),
                                getattr(self, "_from_beginning", False), self._log)
        self._consumer.subscribe([self.topic], listener=listener)
        try:
            await self._consumer.start()
            if self.dead_letter:
                self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers)
                await self._producer.start()
        except KafkaConnectionError:
            await self.stop()
            raise SourceError(f"cannot reach Kafka at {self.bootstrap_servers}") from None

    async def stop(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                try:
                    await client.stop()
                except KafkaError:
                    pass
        self._consumer = self._producer = None

    async def fetch(self, timeout_s: float = 0.5) -> AsyncIterator[Fetched]:
        before = await self._positions()
        try:
            batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        except UNREADABLE as exc:  # a record aiokafka itself cannot parse (a header name that is not UTF-8)
            async for fetched in self._step_past_unreadable(before, exc):
                yield fetched
            return
        for messages in batches.values():
            for message in messages:
                yield await self._decoded(message)

    async def _positions(self) -> dict:
        positions = {}
        for tp in self._consumer.assignment():
            try:
                positions[tp] = await self._consumer.position(tp)
            except IllegalStateError:  # revoked meanwhile
                pass
        return positions

    async def _decoded(self, message) -> Fetched:
        """The record, or None with its reason after its copy was sent to the dead-letter topic."""
        tp = (message.topic, message.partition)
        try:
            record = decode(message.key, message.value, message.headers, max_record_bytes=self.max_record_bytes)
        except WireError as exc:
            await self._send(dead_letter_copy(message.key, message.value, message.headers, reason=exc.reason,
                                              detail=str(exc), source=f"{tp[0]}:{tp[1]}:{message.offset}"))
            return Fetched(None, tp, message.offset, exc.reason)
        return Fetched(record, tp, message.offset)

    async def _step_past_unreadable(self, before: dict, error: Exception,
                                    patience_s: float = 30.0) -> AsyncIterator[Fetched]:
        """After a getmany that raised on an unparsable record: every partition goes back to where that
        call started (aiokafka may have moved others past records it never returned), then partitions
        with records to read are read one record at a time until the one that raises, which is
        dead-lettered as `unreadable` (no bytes of it can be read) and skipped. Records after it in
        the same producer batch raise too, so each is dead-lettered the same way on later fetches."""
        for tp, position in before.items():
            if tp in self._consumer.assignment():
                self._consumer.seek(tp, position)
        for tp in sorted(set(before) & self._consumer.assignment()):
            deadline = time.monotonic() + patience_s
            for _ in range(self.max_records):
                highwater = self._consumer.highwater(tp)
                position = await self._consumer.position(tp)
                if (highwater is not None and position >= highwater) or time.monotonic() > deadline:
                    break
                try:
                    got = await self._consumer.getmany(tp, timeout_ms=200, max_records=1)
                except UNREADABLE:
                    self._consumer.seek(tp, position + 1)
                    detail = f"the Kafka client cannot parse it ({type(error).__name__}: {str(error)[:200]})"
                    source = f"{tp.topic}:{tp.partition}:{position}"
                    await self._send(dead_letter_copy(None, b"", [], reason="unreadable", detail=detail, source=source))
                    yield Fetched(None, (tp.topic, tp.partition), position, "unreadable")
                    return
                for message in got.get(tp, ()):
                    deadline = time.monotonic() + patience_s
                    yield await self._decoded(message)

    async def send_dead_letter(self, fetched: Fetched, reason: str, detail: str) -> None:
        """Dead-letter a record the learner rejected after decoding."""
        if fetched.record is None:
            return
        source = f"{fetched.tp[0]}:{fetched.tp[1]}:{fetched.offset}"
        await self._send(dead_letter_copy(*encode(fetched.record), reason=reason, detail=detail, source=source))

    async def _send(self, copy: tuple) -> None:
        """Send one dead-letter copy without waiting for the broker; a failure, now or at delivery, is
        counted in `dead_letter_failures` and logged in one line, never raised."""
        if self._producer is None:
            return
        key, value, headers = copy
        try:
            delivery = await asyncio.wait_for(  # a broker that is away blocks send() up to its request timeout
                self._producer.send(f"{self.topic}.dlq", key=key, value=value, headers=headers),
                self.dead_letter_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the boundary: a dead letter must never stop the learner
            self._failed(exc)
            return
        delivery.add_done_callback(self._delivered)

    def _delivered(self, delivery) -> None:
        if not delivery.cancelled() and delivery.exception() is not None:
            self._failed(delivery.exception())

    def _failed(self, exc: BaseException) -> None:
        self.dead_letter_failures += 1
        self._log(f"dead letter to {self.topic}.dlq failed ({type(exc).__name__}: {str(exc)[:200]}); going on")

    async def commit(self, positions: dict) -> bool:
        """Commit {(topic, partition): next offset} for the partitions assigned now; False (and one
        line) when Kafka refuses, e.g. during a rebalance: the checkpoint holds the offsets anyway,
        and the next one commits them."""
        assigned = self._consumer.assignment()
        offsets = {TopicPartition(t, p): o for (t, p), o in positions.items() if TopicPartition(t, p) in assigned}
        if not offsets:
            return False
        try:
            await self._consumer.commit(offsets)
        except (KafkaError, AssertionError) as exc:  # CommitFailedError, IllegalStateError, a lost coordinator
            self._log(f"commit of offsets {sorted((tp.partition, o) for tp, o in offsets.items())} failed "
                      f"({type(exc).__name__}); the checkpoint holds them, the next one commits them")
            return False
        return True

    async def lag(self) -> dict[int, int]:
        """Records in the log beyond the consumer's position, per assigned partition."""
        lags = {}
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            if highwater is None:
                continue
            position = await self._consumer.position(tp)
            lags[tp.partition] = max(0, highwater - position)
        return lags


class SeekOnAssign(ConsumerRebalanceListener):
    """The learner's offsets, not the group's, decide where each assigned partition is read from
    (aiokafka's local-state consumer example). Never raises: a rebalance must not crash a learner."""

    def __init__(self, consumer: AIOKafkaConsumer, positions, from_beginning: bool, log):
        self.consumer, self.positions, self.from_beginning, self.log = consumer, positions, from_beginning, log

    async def on_partitions_revoked(self, revoked) -> None:
        pass  # nothing to hand over: what was read stays in the learner's state, and its checkpoint commits it

    async def on_partitions_assigned(self, assigned) -> None:
        try:
            known = self.positions()
            for tp in assigned:
                position = known.get((tp.topic, tp.partition))
                if position is not None:
                    self.consumer.seek(tp, position)
                elif self.from_beginning:
                    await self.consumer.seek_to_beginning(tp)
        except Exception as exc:  # noqa: BLE001 - the boundary: a rebalance never crashes a learner
            self.log(f"seek after a rebalance failed ({type(exc).__name__}: {str(exc)[:200]}); "
                     "reading from the committed offsets")
