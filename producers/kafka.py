"""Write wire records to a Kafka topic, optionally rate-limited."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Callable, Iterable

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from producers.wire import Record, encode

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
    token_rate: float | None = None,
    partitions: int = 1,
    truth_topic: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Send records in order (key = stream id); `rate` caps records per second and
    `token_rate` bytes of text per second. With `truth_topic`, each fragment's start on
    each stream is also announced there (JSON), so a remote monitor can read the ground
    truth without touching the model's input."""
    await ensure_topic(bootstrap_servers, topic, partitions)
    if truth_topic:
        await ensure_topic(bootstrap_servers, truth_topic, 1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, linger_ms=5, acks="all")
    try:
        await producer.start()
    except KafkaConnectionError:
        raise ProduceError(f"cannot reach Kafka at {bootstrap_servers}") from None
    sent = sent_bytes = 0
    started = time.monotonic()
    fragment_of: dict[str, int] = {}
    try:
        for record in records:
            if record.truth is not None:
                record = dataclasses.replace(
                    record, truth=dataclasses.replace(record.truth, produced=time.time()))
                if truth_topic and fragment_of.get(record.stream) != record.truth.fragment:
                    fragment_of[record.stream] = record.truth.fragment
                    await producer.send(truth_topic, key=record.stream.encode(), value=json.dumps({
                        "stream": record.stream, **dataclasses.asdict(record.truth)}).encode())
            key, value, headers = encode(record)
            await producer.send(topic, value=value, key=key, headers=headers)
            sent += 1
            sent_bytes += len(value)
            ahead = max(sent / rate if rate else 0.0, sent_bytes / token_rate if token_rate else 0.0)
            ahead -= time.monotonic() - started
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
