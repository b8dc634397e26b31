"""Write wire records to a Kafka topic, optionally rate-limited."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Iterable

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from streamer.wire import Record, encode

__all__ = ["ProduceError", "ensure_topic", "produce"]


class ProduceError(RuntimeError):
    pass


async def ensure_topic(bootstrap_servers: str, topic: str, partitions: int = 1) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=10_000)
    try:
        await admin.start()
    except KafkaConnectionError:
        raise ProduceError(f"cannot reach Kafka at {bootstrap_servers}") from None
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()


async def produce(
    records: Iterable[Record],
    bootstrap_servers: str,
    topic: str,
    *,
    rate: float | None = None,
    partitions: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Send records in order (key = stream id); `rate` caps records per second."""
    await ensure_topic(bootstrap_servers, topic, partitions)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, linger_ms=5, acks="all")
    try:
        await producer.start()
    except KafkaConnectionError:
        raise ProduceError(f"cannot reach Kafka at {bootstrap_servers}") from None
    sent = sent_bytes = 0
    started = time.monotonic()
    try:
        for record in records:
            if record.truth is not None:
                record = dataclasses.replace(
                    record, truth=dataclasses.replace(record.truth, produced=time.time()))
            key, value, headers = encode(record)
            await producer.send(topic, value=value, key=key, headers=headers)
            sent += 1
            sent_bytes += len(value)
            if rate:
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if progress and sent % 1000 == 0:
                progress(sent, sent_bytes)
        await producer.flush()
    finally:
        await producer.stop()
    if progress:
        progress(sent, sent_bytes)
    return sent
