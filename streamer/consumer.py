"""The Kafka side of the learner: the only module of streamer/ that imports aiokafka.

Fetches in batches, decodes wire records, dead-letters bad ones (counted by
reason and sent to `<topic>.dlq`), commits offsets only when asked, and
reports consumer lag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError

from producers.wire import Record, WireError, decode

__all__ = ["KafkaSource", "SourceError", "Fetched"]


class SourceError(RuntimeError):
    pass


@dataclass(frozen=True)
class Fetched:
    record: Record | None  # None when dead-lettered
    tp: tuple[str, int]
    offset: int
    dead_reason: str | None = None


class KafkaSource:
    def __init__(self, bootstrap_servers: str, topic: str, group_id: str,
                 *, max_records: int = 2000, dead_letter: bool = True):
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.group_id = group_id
        self.max_records = max_records
        self.dead_letter = dead_letter
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            self.topic, bootstrap_servers=self.bootstrap_servers, group_id=self.group_id,
            enable_auto_commit=False, auto_offset_reset="earliest", request_timeout_ms=15_000,
            # A slow strategy (30 experts, MbPA++'s local steps, a pretrained model on a CPU) keeps the
            # bounded queue full, so fetches pause for minutes; the background heartbeat still proves
            # liveness, so the poll interval must not evict the learner from its group.
            max_poll_interval_ms=24 * 3600 * 1000,
        )
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
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        for tp, messages in batches.items():
            for message in messages:
                key = (tp.topic, tp.partition)
                try:
                    record = decode(message.key, message.value, message.headers)
                except WireError as exc:
                    await self._dead_letter(message, exc.reason, str(exc))
                    yield Fetched(None, key, message.offset, exc.reason)
                    continue
                yield Fetched(record, key, message.offset)

    async def send_dead_letter(self, fetched: Fetched, reason: str, detail: str) -> None:
        """Dead-letter a record the learner rejected after decoding."""
        record = fetched.record
        if self._producer is None or record is None:
            return
        await self._producer.send(
            f"{self.topic}.dlq", key=record.stream.encode(), value=record.text.encode(),
            headers=[("streamer.reason", reason.encode()), ("streamer.detail", detail.encode()),
                     ("streamer.source", f"{fetched.tp[0]}:{fetched.tp[1]}:{fetched.offset}".encode())],
        )

    async def _dead_letter(self, message, reason: str, detail: str) -> None:
        if self._producer is None:
            return
        await self._producer.send(
            f"{self.topic}.dlq", key=message.key, value=message.value,
            headers=[("streamer.reason", reason.encode()), ("streamer.detail", detail.encode()),
                     ("streamer.source", f"{message.topic}:{message.partition}:{message.offset}".encode())],
        )

    async def commit(self, positions: dict) -> None:
        if positions:
            await self._consumer.commit({TopicPartition(t, p): o for (t, p), o in positions.items()})

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
