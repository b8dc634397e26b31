"""Who may learn in a consumer group, and why another learner is refused: a Kafka-side module of the learner
(streamer.kafka.joining applies these rules at a KafkaSource's start).

A learner joins its consumer group and its learner group (`<group>.learner`, learner_group), where each
learner is one member whatever its processes (ranks take their partitions by assignment and are no members
of the group: their rank 0 stands for them there); another learner in either is refused (SourceError: one
learner per group), and so is a new run (no checkpoint, not --fresh) in a group that has committed offsets
on the topic: the model that learned up to them is elsewhere.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

from streamer.source import SourceError

__all__ = ["learner_group", "Membership"]


def learner_group(group_id: str) -> str:
    """The group each learner reading in consumer group `group_id` joins as one member: a one-process learner
    beside its consumer, a learner of ranks by its rank 0 alone (its ranks read by assignment, so the group
    itself never sees them; they cannot join it, whose coordinator would share its partitions out among them).
    Its members take no partitions, fetch and commit nothing (_NoPartitions)."""
    return f"{group_id}.learner"


class _NoPartitions(AbstractPartitionAssignor):
    """The assignor of a learner group: every member gets no partition, so its consumer holds a membership
    (heartbeats while the learner runs, a LeaveGroup at its stop, a session that expires after a kill -9)
    and never fetches. A partition assigned, aiokafka would fetch it ahead of any getmany."""

    name = "streamer-learner"
    version = 0

    @classmethod
    def assign(cls, cluster, members) -> dict:
        return {member: ConsumerProtocolMemberAssignment(cls.version, [], b"") for member in members}

    @classmethod
    def metadata(cls, topics) -> ConsumerProtocolMemberMetadata:
        return ConsumerProtocolMemberMetadata(cls.version, sorted(topics), b"")

    @classmethod
    def on_assignment(cls, assignment) -> None:
        pass


def _processes_of(member) -> int | None:
    """The processes of the learner a learner group's member stands for, from the client id it joined with
    (`streamer-learner-N`): Kafka says the client id, Tansu only puts it first in the member id. None: not
    a streamer learner's member."""
    member_id, client_id = member[0], member[1]
    found = re.match(r"streamer-learner-(\d+)(?!\d)", client_id or member_id)
    return None if found is None else int(found.group(1))


def _learner(processes: int | None) -> str:
    if processes is None:
        return "a learner"
    return "a learner of one process" if processes == 1 else f"a learner of {processes} ranks"


async def _group_members(admin, group: str, timeout_s: float) -> list:
    """The members of `group` as the broker describes them within `timeout_s`; none when it cannot (no check).
    One group a request: Tansu's answer for several is one aiokafka cannot read (it closes the connection)."""
    try:
        async with asyncio.timeout(timeout_s):
            described = await admin.describe_consumer_groups([group])
        return list(described[0].groups[0][5])
    except Exception:  # noqa: BLE001 - a broker that cannot describe groups: no check
        return []


@dataclass(frozen=True)
class Membership:
    """A learner reading `topic` in consumer group `group_id` on `bootstrap_servers`. `subscribed`: a member
    of the group itself (a one-process learner; ranks take their partitions by assignment). `processes`:
    those of the learner this process stands for in its learner group (None: a rank that does not; rank 0
    stands for them all). `describe_timeout_s`: the longest the broker's description of a group, or of the
    topic and its committed offsets, is waited for (then no check)."""

    bootstrap_servers: str
    topic: str
    group_id: str
    subscribed: bool
    processes: int | None
    describe_timeout_s: float

    def learner_member(self, client_options: dict, session_timeout_ms: int,
                       heartbeat_interval_ms: int) -> AIOKafkaConsumer:
        """This learner's member of its learner group: subscribed to the topic (a member must subscribe to
        something), given no partitions (_NoPartitions), named by its client id (_processes_of)."""
        member = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers, group_id=learner_group(self.group_id),
            client_id=f"streamer-learner-{self.processes}", enable_auto_commit=False, request_timeout_ms=15_000,
            session_timeout_ms=session_timeout_ms, heartbeat_interval_ms=heartbeat_interval_ms,
            partition_assignment_strategy=(_NoPartitions,),
            # It never polls: aiokafka leaves the group after this long without a getmany (a limit of the
            # client's own, not sent to the broker), and a daemon learner runs for months.
            max_poll_interval_ms=100 * 365 * 24 * 3600 * 1000, **client_options,
        )
        member.subscribe([self.topic])
        return member

    def not_authorized(self) -> str:
        """The one line of a broker whose ACLs let this user into the group but not into the learner group:
        no other learner is looked for there (as where the broker cannot describe groups), rather than a
        learner that no longer starts."""
        return (f"group {learner_group(self.group_id)} on {self.bootstrap_servers}: not authorized, so no other "
                f"learner in group {self.group_id} is looked for there; allow this user that group as well")

    async def refuse_if_group_shared(self, admin) -> None:
        """SourceError when another learner reads in the group now that we joined (members that died were
        dropped by our joins): two learners in one group would split its partitions, or (ranks, which the
        group never sees) both read all of them and commit over each other. Only groups this learner has
        just joined are described, since Tansu still lists a group's first member after it has left, until
        the next join: the group itself (a one-process learner's, `subscribed`) here, and the learner group
        (every learner's) by refuse_if_learner_group_shared, once this process's member of it joined. Under
        ranks only rank 0 decides; PrequentialLoop's start makes its refusal every rank's."""
        if not self.subscribed:
            return
        members = await _group_members(admin, self.group_id, self.describe_timeout_s)
        if len(members) > 1:
            raise SourceError(f"group {self.group_id} on {self.bootstrap_servers} has {len(members) - 1} other "
                              f"running member(s): another learner reads topic {self.topic} in it; stop that "
                              f"one, or give this one another --group")

    async def refuse_if_learner_group_shared(self, admin) -> None:
        """SourceError when the learner group lists another learner (refuse_if_group_shared says why)."""
        group = learner_group(self.group_id)
        learners = [_processes_of(member) for member in await _group_members(admin, group, self.describe_timeout_s)]
        if len(learners) < 2:
            return
        if self.processes in learners:  # (ours: the others are told apart by what they stand for)
            learners.remove(self.processes)
        raise SourceError(f"group {self.group_id} on {self.bootstrap_servers} has another running learner: "
                          f"{_learner(learners[0])} reads topic {self.topic} in it (group {group} lists it); "
                          f"stop that one, or give this one another --group")

    async def refuse_if_elsewhere(self, admin, consumer: AIOKafkaConsumer) -> None:
        """SourceError when the group has committed offsets on the topic (asked with `consumer`, a member of
        the group), for a run that is new (no checkpoint, and not --fresh: KafkaSource.seek_on_assign's
        `new_run`). Offsets are committed only after a checkpoint that holds them is written, so that
        checkpoint, and the model that learned up to them, are in another run directory or on another
        machine (a ranked run's rank 0 on another host): starting a new model here would be a restart that
        silently loses the model. Every rank asks for the whole topic, so all decide alike."""
        try:
            async with asyncio.timeout(self.describe_timeout_s):
                described = await admin.describe_topics([self.topic])
                held = []
                for partition in sorted(p["partition"] for p in described[0]["partitions"]):
                    offset = await consumer.committed(TopicPartition(self.topic, partition))
                    if offset is not None and offset >= 0:
                        held.append(f"{self.topic}:{partition}={offset}")
        except Exception:  # noqa: BLE001 - a broker that cannot say: no check
            return
        if held:
            shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
            raise SourceError(f"group {self.group_id} has committed offsets on topic {self.topic} ({shown}), but "
                              "this run has no checkpoint: the model that learned up to them is in another run "
                              "directory or on another machine; continue it there (its --run-dir), or start a new "
                              "model here with --fresh (from the topic's beginning) or with another --group",
                              every_rank=True)
