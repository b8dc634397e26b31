"""Joining at a learner's start (a Kafka-side module of the learner, with streamer.kafka.consumer): the consumer
and this learner's member of its learner group start at once, bounded in time, and another learner in the group
or the learner group is refused (the rules are streamer.kafka.learner_group's).
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import GroupAuthorizationFailedError, KafkaConnectionError

from producers.kafka import closed_quietly
from streamer.kafka.learner_group import Membership
from streamer.source import SourceError

__all__ = ["GroupJoin"]


class GroupJoin:
    """A KafkaSource's `consumer` joining at the source's start, with `member`, this learner's member of its
    learner group (Membership.learner_member; None: a rank that is not rank 0), kept here until the source's
    stop. `started(client.start())` awaits a client's start (BrokerReach.started: credentials the broker
    refuses are one line); `limit_s`: how long the joins may take (--broker-timeout plus the join's own);
    `log`: where a line goes."""

    def __init__(self, consumer: AIOKafkaConsumer, member: AIOKafkaConsumer | None, membership: Membership,
                 started, *, limit_s: float, log):
        self.consumer, self.member, self.membership = consumer, member, membership
        self._started, self.limit_s, self._log = started, limit_s, log

    async def join(self) -> None:
        """Start the consumer (bootstrap and, subscribed, the group's JoinGroup) and this learner's member of
        its learner group, both at once: each join takes about 3 s on Tansu, and a member killed before us
        expires first, about one session timeout."""
        starting = [asyncio.ensure_future(self._started(self.consumer.start()))]
        if self.member is not None:
            starting.append(asyncio.ensure_future(self._member_joined()))
        try:
            async with asyncio.timeout(self.limit_s):
                await asyncio.gather(*starting)
        except BaseException as exc:
            for task in starting:  # the other start is not left running on its own
                task.cancel()
            await asyncio.gather(*starting, return_exceptions=True)
            if not isinstance(exc, (KafkaConnectionError, asyncio.TimeoutError)):
                raise
            raise SourceError(f"cannot join group {self.membership.group_id} at "
                              f"{self.membership.bootstrap_servers} within {self.limit_s:g} s") from None

    async def _member_joined(self) -> None:
        """Start this learner's member of its learner group; one the broker does not authorize is said in a
        line (Membership.not_authorized) and left."""
        try:
            await self._started(self.member.start())
        except GroupAuthorizationFailedError:
            member, self.member = self.member, None
            await closed_quietly(member.stop())
            self._log(self.membership.not_authorized())

    async def refuse_other_learners(self, admin, new_run: bool) -> None:
        """SourceError when another learner reads in the group or the learner group, or when this run is
        `new_run` (KafkaSource.seek_on_assign's) and the group's committed offsets are another model's."""
        await self.membership.refuse_if_group_shared(admin)
        if self.member is not None:
            await self.membership.refuse_if_learner_group_shared(admin)
        if new_run:
            await self.membership.refuse_if_elsewhere(admin, self.consumer)
