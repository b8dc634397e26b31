"""Records the learner cannot learn, as the Kafka side meets them (a Kafka-side module of the learner, with
streamer.kafka.consumer): each fetched message decoded into a Fetched, or with its reason and its dead-letter copy
(`decoded`); a record the Kafka client itself cannot parse stepped past as `unreadable`
(step_past_unreadable); and the copies of those the learner takes sent to `<topic>.dlq` (DeadLetters).

Bad records are data: counted by reason (by the learner), sent to the dead-letter topic, and the learner
goes on. A copy is sent when the learner takes the record, not for one passed over when a partition is read
again; a restart reads on from the checkpoint's offsets and sends again those after them: at least once.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from aiokafka.errors import CorruptRecordException

from monitor.view import duration
from producers.wire import WireError, dead_letter_copy, decode, encode
from streamer.source import Fetched

__all__ = ["UNREADABLE", "decoded", "step_past_unreadable", "DeadLetters"]


UNREADABLE = (UnicodeDecodeError, CorruptRecordException)  # raised by aiokafka while parsing a fetched record


def decoded(message, max_record_bytes: int | None, last: int | None = None) -> Fetched:
    """The record, or None with its reason and its dead-letter copy (sent if the learner takes it); larger than
    `max_record_bytes` is too_large (None: no limit); `last`: the last offset of its partition in this fetch."""
    tp = (message.topic, message.partition)
    try:
        record = decode(message.key, message.value, message.headers, max_record_bytes=max_record_bytes)
    except WireError as exc:
        return Fetched(None, tp, message.offset, exc.reason,
                       dead_letter_copy(message.key, message.value, message.headers, reason=exc.reason,
                                        detail=str(exc), source=f"{tp[0]}:{tp[1]}:{message.offset}"), last=last)
    return Fetched(record, tp, message.offset, last=last, headers=message.headers)


async def step_past_unreadable(consumer, before: dict, error: Exception, max_records: int, sought: set,
                               max_record_bytes: int | None, patience_s: float = 30.0) -> AsyncIterator[Fetched]:
    """After a getmany of `consumer` that raised on an unparsable record: every partition goes back to where
    that call started (`before`: {TopicPartition: position}; aiokafka may have moved others past records it
    never returned), then partitions with records to read are read one record at a time (up to
    `max_records`) until the one that raises, which is dead-lettered as `unreadable` (no bytes of it can be
    read) and skipped. Records after it in the same producer batch raise too, so each is dead-lettered the
    same way on later fetches. A partition the caller seeks meanwhile (it is in `sought`) is left for the
    next fetch to read from there (the caller passes over this fetch's further records of it)."""
    for tp, position in before.items():
        if tp in consumer.assignment():
            consumer.seek(tp, position)
    for tp in sorted(set(before) & consumer.assignment()):
        deadline = time.monotonic() + patience_s
        for _ in range(max_records):
            if tp in sought:
                break
            highwater = consumer.highwater(tp)
            position = await consumer.position(tp)
            if (highwater is not None and position >= highwater) or time.monotonic() > deadline:
                break
            try:
                got = await consumer.getmany(tp, timeout_ms=200, max_records=1)
            except UNREADABLE:
                consumer.seek(tp, position + 1)
                detail = f"the Kafka client cannot parse it ({type(error).__name__}: {str(error)[:200]})"
                source = f"{tp.topic}:{tp.partition}:{position}"
                yield Fetched(None, (tp.topic, tp.partition), position, "unreadable",
                              dead_letter_copy(None, b"", [], reason="unreadable", detail=detail, source=source))
                return
            for message in got.get(tp, ()):
                deadline = time.monotonic() + patience_s
                yield decoded(message, max_record_bytes, message.offset)


def _cause(exc: BaseException) -> str:
    """A failed send's cause, in a line's words."""
    return f"{type(exc).__name__}: {str(exc)[:200]}"


class DeadLetters:
    """The dead letters of a learner reading `topic`: the first of each reason said in one line to `log`, each
    copy sent to `<topic>.dlq` by the producer `send` is given. A copy not sent (its send failed, now or at
    delivery, or it was not tried) is counted in `failures`, never raised: the first failure is said in one
    line with its cause, later ones at most every `say_every_s` in one line with their count since
    (say_unsaid says the rest at the stop). For `retry_s` after a failed send the copies are counted as failed
    without being tried, so a .dlq the broker never gives (no such topic and no auto-creation, a name it
    refuses, writes denied, the broker away) holds fetching up at most once per `retry_s`, not at every
    bad record; then the next copy is tried again."""

    def __init__(self, topic: str, log, retry_s: float = 60.0, say_every_s: float = 300.0):
        self.topic = topic
        self.retry_s = retry_s
        self.say_every_s = say_every_s
        self.failures = 0  # dead-letter copies not sent: failed or not tried (each record is counted by reason too)
        self._log = log
        self._reasons_said: set[str] = set()  # the reasons whose first dead letter was said in a line
        self._failed_at: float | None = None  # (monotonic) the last send that failed: copies wait retry_s after it
        self._said_at: float | None = None  # (monotonic) the last line about failed copies
        self._unsaid, self._untried = 0, 0  # copies failed since that line, and of those the ones not tried
        self._cause = ""  # the last failed send's
        self._in_flight: set = set()  # the deliveries of copies sent and not yet delivered or failed

    async def send(self, producer, fetched: Fetched, reason: str, detail: str, timeout_s: float) -> None:
        """Dead-letter a record the learner takes and cannot learn: one it rejected after decoding, or one
        that could not be decoded (its copy, made then). Not at the read: a record read again after a
        rewind (streamer.offsets.OffsetTracker.admit) is passed over, and its copy is not sent again.
        `producer` None: said and counted only (no dead-letter producer); `timeout_s`: the longest the send
        may hold up fetching, then it counts as failed."""
        source = f"{fetched.tp[0]}:{fetched.tp[1]}:{fetched.offset}"
        if reason not in self._reasons_said:  # the first of each reason in a line: a topic of records without
            self._reasons_said.add(reason)  # keys went silently to the DLQ, the run learning nothing
            self._log(f"record {source} dead-lettered ({reason}" + (f": {detail[:200]})" if detail else ")")
                      + (f", a copy sent to {self.topic}.dlq" if producer is not None else "")
                      + f"; later {reason} records this process reads are only counted (streamer_dead_letter_total). "
                      "A record is key = its stream id 0..b-1, value = UTF-8 text, the truth in four optional headers "
                      "(README: How a stream looks)")
        if fetched.record is None:
            if fetched.copy is not None:
                await self._send(producer, fetched.copy, timeout_s)
            return
        key, value, headers = encode(fetched.record)  # (a decoded record's key and value are its bytes)
        headers = headers if fetched.headers is None else fetched.headers  # the producer's own too (a trace id)
        await self._send(producer, dead_letter_copy(key, value, headers, reason=reason, detail=detail,
                                                    source=source), timeout_s)

    async def _send(self, producer, copy: tuple, timeout_s: float) -> None:
        """Send one dead-letter copy without waiting for the broker, unless a send failed in the last
        `retry_s` (then it is counted as failed, untried); a failure, now or at delivery, is counted in
        `failures` and said (_failed), never raised."""
        if producer is None:
            return
        if self._failed_at is not None and time.monotonic() - self._failed_at < self.retry_s:
            self._failed(None)
            return
        key, value, headers = copy
        try:
            async with asyncio.timeout(timeout_s):  # a broker that is away blocks send()
                delivery = await producer.send(f"{self.topic}.dlq", key=key, value=value, headers=headers)
        except TimeoutError:  # (its text is empty) no metadata for the topic, or no room in the producer's buffer
            self._failed(f"not sent within {timeout_s:g} s: the broker gives no {self.topic}.dlq (it does not "
                         "exist and is not auto-created, its name is refused, or the broker is away or slow)")
            return
        except Exception as exc:  # noqa: BLE001 - the boundary: a dead letter must never stop the learner
            self._failed(_cause(exc))
            return
        self._in_flight.add(delivery)
        delivery.add_done_callback(self._delivered)

    async def settle(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the copies in flight to be delivered; count the rest as failed now (their
        later end is not counted again). The learner's last checkpoint and metrics, written before its source
        stops, held no copy that failed at the stop (the producer's close cancels them): a broker away at a
        stop lost them from the count for good. Call it once nothing more is sent (the fetch side ended)."""
        waiting = {delivery for delivery in self._in_flight if not delivery.done()}
        if waiting:
            _, waiting = await asyncio.wait(waiting, timeout=timeout_s)
        await asyncio.sleep(0)  # the deliveries that ended meanwhile: their _delivered callbacks run first
        for delivery in waiting:
            if not delivery.done() and delivery.remove_done_callback(self._delivered):
                self._in_flight.discard(delivery)
                self._failed(f"not delivered within {timeout_s:g} s before the learner stopped", hold=False)

    def _delivered(self, delivery) -> None:
        self._in_flight.discard(delivery)
        if delivery.cancelled():  # (the producer stopped with it unsent)
            self._failed("cancelled: the producer stopped before it was delivered")
        elif delivery.exception() is not None:
            self._failed(_cause(delivery.exception()))

    def _failed(self, cause: str | None, hold: bool = True) -> None:
        """One copy not sent: its send failed with `cause`, or (None) it was not tried, within `retry_s` of a
        failed send (`hold` False: this failure does not hold the next copies back). The first is said in one
        line; later ones are counted and said by say_unsaid, at most every `say_every_s`."""
        self.failures += 1
        now = time.monotonic()
        if cause is not None:
            self._cause = cause
            if hold:
                self._failed_at = now
        if self._said_at is None:
            self._said_at = now
            self._log(f"dead letter to {self.topic}.dlq failed ({cause}); going on: for {self.retry_s:g} s after "
                      "a failed send the copies are not tried, and every copy not sent is counted "
                      "(streamer_dead_letter_total, reason dead_letter_failed) and said at most every "
                      f"{duration(self.say_every_s)}")
            return
        self._unsaid += 1
        self._untried += cause is None
        if now - self._said_at >= self.say_every_s:
            self.say_unsaid()

    def say_unsaid(self) -> None:
        """Say in one line the copies that failed since the last line about them, if any (at the stop too)."""
        if not self._unsaid:
            return
        now = time.monotonic()
        self._log(f"{self._unsaid} more dead-letter {'copy' if self._unsaid == 1 else 'copies'} to {self.topic}.dlq "
                  f"failed in the last {duration(now - self._said_at)} ({self._untried} not tried, within "
                  f"{self.retry_s:g} s of a failed send; last: {self._cause}); going on")
        self._said_at, self._unsaid, self._untried = now, 0, 0
