"""Write wire records to a Kafka topic, optionally rate-limited.

A broker that does not answer is retried with backoff for `broker_timeout_s` (at the start, and for
each record and the final flush; aiokafka retries the sends themselves within the same time), then
ProduceError says so in one line: never a silent hang."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Callable, Iterable, Mapping

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (ClusterAuthorizationFailedError, KafkaConnectionError, KafkaError, KafkaTimeoutError,
                             TopicAlreadyExistsError, TopicAuthorizationFailedError, for_code)

from producers.security import is_refusal, no_answer, refusal_reason
from producers.wire import Record, encode, stream_id

__all__ = ["ProduceError", "closed_quietly", "ensure_topic", "produce", "started_client"]


class ProduceError(RuntimeError):
    pass


def refused(bootstrap_servers: str, client_options: Mapping | None, exc: Exception) -> str:
    """One line for a broker that refused our credentials (the user named, never the password)."""
    options = client_options or {}
    who = f" as {options['sasl_plain_username']} ({options.get('sasl_mechanism')})" \
        if options.get("sasl_plain_username") else ""
    return (f"Kafka at {bootstrap_servers} refused the connection{who}: {refusal_reason(exc)}; "
            "check --security-protocol, --sasl-mechanism, --sasl-username and the password")


# create_topics' answers for a topic that may exist already (a user allowed to write a topic, not to create one)
_MAY_EXIST = (TopicAlreadyExistsError.errno, TopicAuthorizationFailedError.errno, ClusterAuthorizationFailedError.errno)


async def ensure_topic(bootstrap_servers: str, topic: str, partitions: int = 1,
                       client_options: Mapping | None = None, *, broker_timeout_s: float = 60.0,
                       log: Callable[[str], None] | None = None) -> int:
    """Create `topic` unless it exists; its partition count (that of a topic that existed, which may differ
    from `partitions`). `client_options`: aiokafka's security keyword arguments
    (producers.security.KafkaSecurity.client_kwargs), the same for every client. A broker that does
    not answer is retried for `broker_timeout_s` (said once through `log`), then ProduceError."""
    def connect():
        return AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=10_000,
                                   **(client_options or {}))
    admin = await started_client(connect, "close", bootstrap_servers, client_options, broker_timeout_s, log)
    try:
        created = await asyncio.wait_for(admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                                                       replication_factor=1)]), broker_timeout_s)
        errors = [t["error_code"] for t in created.to_object()["topic_errors"] if t["error_code"]]
        if not errors:
            return partitions
        if errors[0] not in _MAY_EXIST:  # (aiokafka returns the error codes, never raises them)
            raise for_code(errors[0])()
        # asked only of a topic that may exist: Tansu creates a topic whose metadata is asked for
        described = await asyncio.wait_for(admin.describe_topics([topic]), broker_timeout_s)
        found = [t for t in described if t["topic"] == topic and not t["error_code"] and t["partitions"]]
        if not found:
            raise for_code(errors[0])()
        return len(found[0]["partitions"])
    except (KafkaError, asyncio.TimeoutError) as exc:
        raise ProduceError(f"Kafka at {bootstrap_servers} did not create topic {topic} ({type(exc).__name__})") from None
    finally:
        await closed_quietly(admin.close())


async def started_client(make, closer: str, bootstrap_servers: str, client_options, timeout_s: float, log):
    """A client made by `make()` and started, retried with backoff (0.5 s doubling to 5 s) until
    `timeout_s` has passed without an answer; then ProduceError naming the address."""
    deadline, delay, said = time.monotonic() + timeout_s, 0.5, False
    while True:
        client = make()
        try:
            await asyncio.wait_for(client.start(), max(1.0, min(10.0, deadline - time.monotonic())))
            return client
        except (KafkaConnectionError, asyncio.TimeoutError):
            await closed_quietly(getattr(client, closer)())
            if time.monotonic() >= deadline:
                raise ProduceError(no_answer(bootstrap_servers, timeout_s, client_options)) from None
        except Exception as exc:
            await closed_quietly(getattr(client, closer)())
            if not is_refusal(exc, client_options):
                raise
            raise ProduceError(refused(bootstrap_servers, client_options, exc)) from None
        if not said and log is not None:
            said = True
            log(f"Kafka at {bootstrap_servers} does not answer yet; retrying for up to {timeout_s:g} s (--broker-timeout)")
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(2 * delay, 5.0)


async def closed_quietly(closing, timeout_s: float = 5.0) -> None:
    """Await a client's stop() or close(), bounded, ignoring what a broker that is away makes it raise
    (aiokafka's fetcher re-raises a CancelledError of its own when its retry backoff is cut short)."""
    task = asyncio.ensure_future(closing)
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except asyncio.CancelledError:
        if not task.done() or asyncio.current_task().cancelling():
            task.cancel()
            raise
    except (KafkaError, asyncio.TimeoutError, OSError):
        task.cancel()


class _Sender:
    """producer.send, each bounded by `timeout_s`; a delivery that failed (aiokafka gave up on its batch
    after the same time) stops the next send. Failures are ProduceError, one line."""

    def __init__(self, producer: AIOKafkaProducer, bootstrap_servers: str, timeout_s: float):
        self.producer, self.bootstrap_servers, self.timeout_s = producer, bootstrap_servers, timeout_s
        self.sent = 0
        self.failure: BaseException | None = None

    async def send(self, topic: str, **message) -> None:
        self.check()
        try:
            async with asyncio.timeout(self.timeout_s):  # no task per record, unlike wait_for
                delivery = await self.producer.send(topic, **message)
        except (KafkaError, asyncio.TimeoutError) as exc:
            raise self.error(exc) from None
        delivery.add_done_callback(self._delivered)

    async def flush(self) -> None:
        try:
            await asyncio.wait_for(self.producer.flush(), self.timeout_s)
        except (KafkaError, asyncio.TimeoutError) as exc:
            raise self.error(exc) from None
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise self.error(self.failure)

    def error(self, exc: BaseException) -> ProduceError:
        if isinstance(exc, KafkaError) and not exc.retriable and not isinstance(exc, KafkaTimeoutError):
            said = str(exc).strip()  # not a broker away: waiting longer would not help, nor does the timeout apply
            return ProduceError(f"Kafka at {self.bootstrap_servers} refused a record ({type(exc).__name__}"
                                f"{': ' + said[:300] if said else ''}); stopped after {self.sent} records")
        return ProduceError(f"Kafka at {self.bootstrap_servers} took no records for {self.timeout_s:g} s "
                            f"(--broker-timeout; {type(exc).__name__}); stopped after {self.sent} records")

    def _delivered(self, delivery) -> None:
        failed = None if delivery.cancelled() else delivery.exception()  # retrieved, each one: no asyncio warning
        if self.failure is None and failed is not None:
            self.failure = failed


def _partition(record: Record, partitions: int) -> int | None:
    """Stream id i goes to partition i % partitions (one partition per stream with --partitions b, so
    each rank of a distributed learner reads its own streams); other keys: the key's hash (None)."""
    if partitions <= 1:
        return None
    stream = stream_id(record.stream)
    return None if stream is None else stream % partitions


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
    client_options: Mapping | None = None,
    broker_timeout_s: float = 60.0,
    log: Callable[[str], None] | None = None,
    after: Mapping[str, int] | None = None,
    announced: Mapping[str, int] | None = None,
) -> int:
    """Send records in order (key = stream id; with `partitions` > 1, stream id i to partition
    i % partitions); `rate` caps records per second and
    `token_rate` bytes of text per second. With `truth_topic`, each fragment's start on
    each stream is also announced there (JSON), so a remote monitor can read the ground
    truth without touching the model's input. `broker_timeout_s`: see the module's docstring;
    `log`: where the one line "retrying" goes. To resume a production (producers.held): `after`, per
    stream, the position of the last record the topic holds (that record and those before it are not
    sent again); `announced`, per stream, the last fragment the truth topic holds. Returns the records sent."""
    await ensure_topic(bootstrap_servers, topic, partitions, client_options, broker_timeout_s=broker_timeout_s, log=log)
    if truth_topic:
        await ensure_topic(bootstrap_servers, truth_topic, 1, client_options, broker_timeout_s=broker_timeout_s, log=log)
    request_timeout_ms = max(1000, int(broker_timeout_s * 1000))  # a batch not taken by then fails its sends
    producer = await started_client(
        lambda: AIOKafkaProducer(bootstrap_servers=bootstrap_servers, linger_ms=5, acks="all",
                                 request_timeout_ms=request_timeout_ms, **(client_options or {})),
        "stop", bootstrap_servers, client_options, broker_timeout_s, log)
    sender = _Sender(producer, bootstrap_servers, broker_timeout_s)
    sent = sent_bytes = 0
    started = time.monotonic()
    fragment_of: dict[str, int] = {}
    held, announced = after or {}, dict(announced or {})
    try:
        for record in records:
            if record.truth is not None:
                record = dataclasses.replace(
                    record, truth=dataclasses.replace(record.truth, produced=time.time()))
                if truth_topic and fragment_of.get(record.stream) != record.truth.fragment:
                    fragment_of[record.stream] = record.truth.fragment
                    if record.truth.fragment > announced.get(record.stream, -1):
                        await sender.send(truth_topic, key=record.stream.encode(), value=json.dumps({
                            "stream": record.stream, **dataclasses.asdict(record.truth)}).encode())
                if record.truth.position <= held.get(record.stream, -1):
                    continue  # on the topic already
            key, value, headers = encode(record)
            await sender.send(topic, value=value, key=key, headers=headers, partition=_partition(record, partitions))
            sent = sender.sent = sent + 1
            sent_bytes += len(value)
            ahead = max(sent / rate if rate else 0.0, sent_bytes / token_rate if token_rate else 0.0)
            ahead -= time.monotonic() - started
            if ahead > 0:
                await asyncio.sleep(ahead)
            if progress and sent % 1000 == 0:
                progress(sent, sent_bytes)
        await sender.flush()
    finally:
        await closed_quietly(producer.stop())
        if progress:  # also when stopped (a signal, a lost broker): the caller says how far it got
            progress(sent, sent_bytes)
    return sent
