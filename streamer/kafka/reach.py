"""Reaching the broker at a learner's start (a Kafka-side module of the learner, with streamer.kafka.consumer): a
broker that does not answer is retried with backoff up to --broker-timeout and said once, then one line
naming its address; credentials it refuses are one line; a topic that does not exist is said once and
waited for, asked with a listing, which never creates it (a consumer's metadata request for it would, with
the broker's default partitions).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError

from producers.kafka import closed_quietly
from producers.security import authentication_failed, is_refusal, no_answer
from streamer.source import SourceError

__all__ = ["BrokerReach"]


@dataclass(frozen=True)
class BrokerReach:
    """The broker at `bootstrap_servers` as a learner reaches it: `timeout_s` (--broker-timeout), the longest
    it may not answer; `client_options`, the aiokafka keyword arguments of `security` (the password resolved);
    `log`, where its lines go."""

    bootstrap_servers: str
    timeout_s: float
    client_options: dict
    security: object  # a producers.security.KafkaSecurity, or None: plaintext
    log: Callable[[str], None]

    def no_answer(self) -> SourceError:
        return SourceError(no_answer(self.bootstrap_servers, self.timeout_s, self.client_options))

    async def started(self, starting) -> None:
        """Await a client's start(); a broker that refuses our credentials is one line (SourceError)."""
        try:
            await starting
        except Exception as exc:
            if isinstance(exc, KafkaConnectionError) or not is_refusal(exc, self.client_options):
                raise
            raise SourceError(authentication_failed(self.bootstrap_servers, self.security, exc)) from None

    async def admin(self) -> AIOKafkaAdminClient:
        """An admin client, started once the broker answers (retried)."""
        return await self.retried(self._admin, time.monotonic() + self.timeout_s)

    async def _admin(self) -> AIOKafkaAdminClient:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=10_000,
                                    **self.client_options)
        try:
            await self.started(admin.start())
        except BaseException:
            await closed_quietly(admin.close())
            raise
        return admin

    async def retried(self, connect, deadline: float):
        """`connect()` until it answers, with backoff (0.5 s doubling to 5 s); a broker that has not
        answered by `deadline` is SourceError (one line naming the address), said once while retrying."""
        delay, said = 0.5, False
        while True:
            try:
                async with asyncio.timeout(max(1.0, min(10.0, deadline - time.monotonic()))):
                    return await connect()
            except (KafkaConnectionError, asyncio.TimeoutError):
                if time.monotonic() >= deadline:
                    raise self.no_answer() from None
            if not said:
                said = True
                self.log(f"Kafka at {self.bootstrap_servers} does not answer yet; retrying for up to "
                         f"{self.timeout_s:g} s (--broker-timeout)")
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(2 * delay, 5.0)

    async def until_topic_exists(self, admin, topic: str, group_id: str, missing: Callable[[float | None], None],
                                 every_s: float = 1.0) -> None:
        """Wait for `topic` to exist, asked of `admin` with a listing; a missing topic is said once and waited
        for: `missing(wall time)` when first found missing, `missing(None)` once it exists."""
        said = False
        while True:
            try:
                async with asyncio.timeout(self.timeout_s):
                    topics = await admin.list_topics()
            except (KafkaError, asyncio.TimeoutError):
                raise self.no_answer() from None
            if topic in topics:
                missing(None)
                if said:
                    self.log(f"topic {topic} exists now; joining group {group_id}")
                return
            if not said:
                said = True
                missing(time.time())
                self.log(f"topic {topic} does not exist at {self.bootstrap_servers} yet; waiting for it "
                         f"(`streamer produce --topic {topic}` or your producer creates it)")
            await asyncio.sleep(every_s)
