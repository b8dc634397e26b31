"""The Kafka side of the learner: KafkaSource, the product's Source. It and the rooms it uses, its package
streamer.kafka, are the modules of streamer/ that import aiokafka: reach (reaching the broker at start),
joining (joining the group and the learner group at start), learner_group (who may learn in the group),
assignment (where each assigned partition is read from), dead_letters (records that cannot be learned),
commits (committing offsets) and lag (consumer lag).

Fetches in batches, decodes wire records, dead-letters bad ones (sent to `<topic>.dlq` when the learner
takes them: send_dead_letter; a failed send is counted in `dead_letter_failures`, logged, and never
raised), commits offsets only when asked (bounded in time), and reports consumer lag.

At start: the broker is retried with backoff up to `broker_timeout_s`; a topic that does not exist is
said in one line and waited for (asked with a listing, which never creates it); the group is joined,
and so is its learner group, and another learner is refused (streamer.kafka.joining, by the rules of
streamer.kafka.learner_group). Every partition
is read from the learner's own offset, or from the earliest one: never from the group's committed
offset (streamer.kafka.assignment). Afterwards `reachable()` tells the loop whether the broker answers, and a
rebalance hands the learner's state over (`on_revoke`) and seeks to the learner's own offsets
(SeekOnAssign); it never raises.
"""

from __future__ import annotations

import asyncio
import sys
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import (IllegalStateError, KafkaConnectionError, KafkaError, NoOffsetForPartitionError,
                             OffsetOutOfRangeError, UnsupportedCodecError)

from producers.kafka import closed_quietly
from producers.wire import MAX_RECORD_BYTES
from streamer.kafka.assignment import SeekOnAssign, deleted_unread, place_out_of_range, seek_to_own
from streamer.kafka.commits import commit_assigned, quiet_abandoned_commits
from streamer.kafka.dead_letters import UNREADABLE, DeadLetters, decoded, step_past_unreadable
from streamer.kafka.joining import GroupJoin
from streamer.kafka.lag import HeldEnds, records_behind
from streamer.kafka.learner_group import Membership
from streamer.kafka.reach import BrokerReach
from streamer.source import CODEC_CURE, Fetched, SourceError

__all__ = ["KafkaSource", "unsupported_codec"]


def unsupported_codec(topic: str, error: Exception) -> str:
    """The refusal's line for records of `topic` compressed with a codec aiokafka cannot decompress here (its
    lz4, snappy and zstd need the cramjam package): the records are good, so the learner stops, with its
    checkpoint, rather than dead-letter every one; the same command continues once the codec is installed."""
    return (f"topic {topic} holds records compressed with a codec this installation cannot decompress ({error}); "
            f"{CODEC_CURE}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class KafkaSource:
    def __init__(self, bootstrap_servers: str, topic: str, group_id: str,
                 *, max_records: int = 2000, dead_letter: bool = True,
                 max_record_bytes: int | None = MAX_RECORD_BYTES, dead_letter_timeout_s: float = 5.0,
                 dead_letter_retry_s: float = 60.0, dead_letter_say_every_s: float = 300.0, log=None,
                 security=None, client_options: dict | None = None, on_revoke=None, broker_timeout_s: float = 60.0,
                 session_timeout_ms: int = 6000, heartbeat_interval_ms: int = 2000, probe_timeout_s: float = 2.0,
                 commit_timeout_s: float = 10.0, join_timeout_s: float = 60.0, partitions=None,
                 rank_0_of: int | None = None):
        """`max_record_bytes`: larger records are dead-lettered as too_large (None: no limit).
        `dead_letter_timeout_s`: the longest a dead-letter send may hold up fetching; then it counts as
        failed. `dead_letter_retry_s`: for this long after a failed dead-letter send the copies are counted as
        failed without being tried (so a .dlq that cannot be written holds fetching up at most once per
        this, not at every bad record). `log`: where the lines go (default: standard error), among them the
        first failed dead-letter send's and, at most every `dead_letter_say_every_s`, the count of those since.
        `security`: the producers.security.KafkaSecurity the refusal of our credentials names (one line);
        `client_options`: its aiokafka keyword arguments, the password resolved by the caller
        (streamer.settings.kafka_client_options; None: none, plaintext; required with `security`), for every
        client of the source.
        `on_revoke`: an async callable awaited when partitions are revoked from a started learner (a
        rebalance), e.g. Checkpointer.on_revoke; settable as an attribute until start().
        `broker_timeout_s`: how long start() retries a broker that does not answer (then SourceError).
        `session_timeout_ms`, `heartbeat_interval_ms`: the group session; a learner killed with SIGKILL
        holds its partitions this long, so a restart joins about a session later.
        `probe_timeout_s`: the longest reachable() waits for an answer; `commit_timeout_s`: a commit's;
        `join_timeout_s`: joining the group, beyond the broker's timeout (a dead member expires first).
        `partitions`: read only these partitions, assigned (no group membership, no rebalance; offsets
        still committed under `group_id`): a list, or partitions(count) -> list given the topic's
        partition count (a rank of a distributed learner, streamer.distributed), whose ValueError is
        SourceError. `rank_0_of`: with `partitions`, this is rank 0 of a learner of that many ranks, and
        joins the learner group (streamer.kafka.learner_group) for all of them (the other ranks give None; one
        process always joins)."""
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.group_id = group_id
        self.max_records = max_records
        self.dead_letter = dead_letter
        self.max_record_bytes = max_record_bytes
        self.dead_letter_timeout_s = dead_letter_timeout_s
        self.dead_letter_retry_s, self.dead_letter_say_every_s = dead_letter_retry_s, dead_letter_say_every_s
        self._log = log or _stderr
        self._dead_letters = DeadLetters(topic, self._log, dead_letter_retry_s, dead_letter_say_every_s)
        self._seek_positions, self._new_run = dict, False  # seek_on_assign() sets the learner's own
        self._taking_from: dict | None = None  # while a fetch's records are being taken: the positions before it
        self._sought: set = set()  # the partitions `seek` moved during the fetch in progress
        self._held_ends = HeldEnds()  # the ends of held partitions, asked of the broker (lag())
        if security is not None and client_options is None:  # (it would connect in plaintext, unauthenticated)
            raise TypeError("KafkaSource: `security` names the refused credentials; give its resolved "
                            "client_options too (streamer.settings.kafka_client_options)")
        self._client_options = client_options or {}
        self._security = security
        self.on_revoke = on_revoke
        self.broker_timeout_s, self.probe_timeout_s, self.commit_timeout_s = broker_timeout_s, probe_timeout_s, commit_timeout_s
        self.session_timeout_ms, self.heartbeat_interval_ms = session_timeout_ms, heartbeat_interval_ms
        self.join_timeout_s = join_timeout_s
        self.partitions = partitions
        self._processes = 1 if partitions is None else rank_0_of  # the learner's, in its learner group
        self._consumer: AIOKafkaConsumer | None = None
        self._join: GroupJoin | None = None  # joining the groups at start(); it keeps the learner group's member
        self._producer: AIOKafkaProducer | None = None
        self._listener: SeekOnAssign | None = None
        self._answering = True  # the broker answered the last reachable()
        self.topic_missing_since: float | None = None  # wall time since when start() waits for the topic
        self.refusal: str | None = None  # assignment.not_this_log's line once a partition's log is not the learner's
        self.refusal_reason = "log_changed"  # the learner's stop for `refusal` (codec_missing: unsupported_codec)
        self.topic_gone = False  # the last reachable() found the topic deleted (the broker answers)
        self._gaps: list = []  # [(tp, beginning, records lost)] deleted unread, until take_gaps()
        self._reach = BrokerReach(bootstrap_servers, broker_timeout_s, self._client_options, security, self._log)
        # this learner in its group and its learner group, as the rules of streamer.kafka.learner_group see it
        self._membership = Membership(bootstrap_servers, topic, group_id, subscribed=partitions is None,
                                      processes=self._processes, describe_timeout_s=probe_timeout_s * 5)

    def seek_on_assign(self, positions, new_run: bool = False) -> None:
        """Before start(): on every assignment, seek each partition to `positions()`'s
        {(topic, partition): next offset} (the learner's own: a checkpoint's, then what it has read);
        a partition it has no position for starts at the earliest offset. `new_run`: the run has no
        checkpoint and was not asked to start over (--fresh), so start() refuses a group that has
        committed offsets on the topic (Membership.refuse_if_elsewhere)."""
        self._seek_positions, self._new_run = positions, new_run

    async def start(self) -> None:
        """Reach the broker (retried with backoff up to `broker_timeout_s`, said in one line, then
        SourceError naming the address), wait for the topic to exist (said in one line), join the group
        and the learner group, and refuse (SourceError) when another learner is in either, or when the
        group's committed offsets belong to a model that is not this run's (GroupJoin.refuse_other_learners)."""
        quiet_abandoned_commits(asyncio.get_running_loop())
        admin = await self._reach.admin()
        try:
            await self._reach.until_topic_exists(admin, self.topic, self.group_id, self._topic_missing)
            self._consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap_servers, group_id=self.group_id,
                enable_auto_commit=False, auto_offset_reset="none", request_timeout_ms=15_000,  # (seek_to_own)
                session_timeout_ms=self.session_timeout_ms, heartbeat_interval_ms=self.heartbeat_interval_ms,
                # A slow strategy (30 experts, MbPA++'s local steps, a pretrained model on a CPU) keeps the
                # bounded queue full, so fetches pause for minutes; the background heartbeat still proves
                # liveness, so the poll interval must not evict the learner from its group.
                max_poll_interval_ms=24 * 3600 * 1000, **self._client_options,
            )
            member = None if self._processes is None else self._membership.learner_member(
                self._client_options, self.session_timeout_ms, self.heartbeat_interval_ms)
            self._join = GroupJoin(self._consumer, member, self._membership, self._started,
                                   limit_s=self.broker_timeout_s + self.join_timeout_s, log=self._log)
            if self.partitions is not None:
                await self._assigned(admin)
            else:
                self._listener = SeekOnAssign(self._consumer, self._seek_positions, self._log,
                                              deleted=self._deleted, refuse=self._refuse)
                self._consumer.subscribe([self.topic], listener=self._listener)
                await self._join.join()
                await self._join.refuse_other_learners(admin, self._new_run)
            if self.dead_letter:
                self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, **self._client_options)
                await self._started(self._producer.start())
            if self._listener is not None:
                self._listener.on_revoke = self.on_revoke  # armed: revokes from now on hand the learner's state over
        except KafkaConnectionError:  # lost between the checks and the dead-letter producer's start
            await self.stop()
            raise SourceError(f"cannot reach Kafka at {self.bootstrap_servers}") from None
        except BaseException:
            await self.stop()
            raise
        finally:
            await closed_quietly(admin.close())

    async def _started(self, starting) -> None:
        """Await a client's start(); a broker that refuses our credentials is one line (SourceError)."""
        await self._reach.started(starting)

    def _topic_missing(self, since: float | None) -> None:
        self.topic_missing_since = since

    async def _assigned(self, admin) -> None:
        """Take `partitions` by assignment and seek each to the learner's own offset, else the earliest
        (refused first when the group's committed offsets are another model's: GroupJoin)."""
        chosen = self.partitions
        if callable(chosen):
            async with asyncio.timeout(self.broker_timeout_s):
                described = await admin.describe_topics([self.topic])
            try:
                chosen = chosen(len(described[0]["partitions"]))
            except ValueError as exc:
                raise SourceError(f"topic {self.topic}: {exc}", every_rank=True) from None
        await self._join.join()
        await self._join.refuse_other_learners(admin, self._new_run)
        assigned = [TopicPartition(self.topic, partition) for partition in chosen]
        self._consumer.assign(assigned)
        await seek_to_own(self._consumer, assigned, self._seek_positions(), self._deleted)

    async def stop(self) -> None:
        """Close the clients, leaving the group and the learner group; a broker that is away does not hold
        it up (5 s each, 1 s when the last reachable() had no answer; the learner's member beside them)."""
        consumer, producer, self._consumer, self._producer = self._consumer, self._producer, None, None
        member, self._join = None if self._join is None else self._join.member, None
        await self._held_ends.stop()
        timeout_s = 5.0 if self._answering else 1.0
        leaving = asyncio.ensure_future(closed_quietly(member.stop(), timeout_s)) if member is not None else None
        try:
            for client in (consumer, producer):
                if client is not None:
                    await closed_quietly(client.stop(), timeout_s)
            self._dead_letters.say_unsaid()  # (the copies that failed since the last line about them)
        finally:
            if leaving is not None:
                await leaving

    async def reachable(self) -> bool:
        """Whether the broker answers a metadata request within `probe_timeout_s` and lists the topic: one
        deleted under the learner (`topic_gone`; it said nothing and showed caught up, lag 0) is waited for as
        a broker that does not answer (streamer.broker_watch), up to --broker-timeout."""
        if self._consumer is None:
            return False
        try:
            # not wait_for: it can lose a cancel (streamer.cancellation)
            async with asyncio.timeout(self.probe_timeout_s):
                topics = await self._consumer.topics()
        except (KafkaError, asyncio.TimeoutError, OSError):
            self._answering = False
        else:
            self._answering, self.topic_gone = True, self.topic not in topics
        return self._answering and not self.topic_gone

    async def log_ends(self) -> dict:
        """{(topic, partition): the offset after its last record} for the assigned partitions, asked of
        the broker within `probe_timeout_s`; {} when it does not answer (or nothing is assigned)."""
        assigned = [] if self._consumer is None else list(self._consumer.assignment())
        if not assigned:
            return {}
        try:
            async with asyncio.timeout(self.probe_timeout_s):  # (not wait_for: streamer.cancellation)
                ends = await self._consumer.end_offsets(assigned)
        except (KafkaError, asyncio.TimeoutError, OSError):
            return {}
        return {(tp.topic, tp.partition): end for tp, end in ends.items()}

    def hold(self, partitions: set) -> set:
        """Fetch nothing from `partitions` ((topic, partition) pairs) until the next call, and from every
        other assigned partition again (aiokafka's pause and resume: the positions stay where they are).
        Returns those held (the assigned ones among them): none where that would be every one (a stream
        not seen yet has its records on one of them, and nothing else would be read)."""
        if self._consumer is None:
            return set()
        assigned = self._consumer.assignment()
        held = {tp for tp in assigned if tp in partitions}  # (a TopicPartition equals its plain pair)
        if held == assigned:
            held = set()
        paused = self._consumer.paused()
        if held - paused:
            self._consumer.pause(*(held - paused))
        if paused - held:
            self._consumer.resume(*(paused - held))
        return held

    def seek(self, tp, offset: int) -> None:
        """Read partition `tp` ((topic, partition)) from `offset` at the next fetch (records of it that the
        fetch in progress still yields are the caller's to pass over). One no longer assigned is left
        alone: its next assignment seeks it to the learner's own offset (SeekOnAssign)."""
        partition = TopicPartition(*tp)
        if self._consumer is not None and partition in self._consumer.assignment():
            self._consumer.seek(partition, offset)
            self._sought.add(partition)

    async def fetch(self, timeout_s: float = 0.5, max_records: int | None = None) -> AsyncIterator[Fetched]:
        """The records of one getmany: at most `max_records` (None: the source's `max_records`)."""
        if self.refusal is not None:  # the learner stops (streamer.loop): nothing more is read
            await asyncio.sleep(timeout_s)
            return
        before = await self._positions()
        self._taking_from = before  # until every record this fetch returns has been taken (lag())
        self._sought = set()
        try:
            batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000),
                                                   max_records=self.max_records if max_records is None else max_records)
        except OffsetOutOfRangeError as exc:  # (real Kafka; auto_offset_reset "none" resets nothing silently)
            await self._placed(exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {})
            self._taking_from = None
            return
        except NoOffsetForPartitionError as exc:  # one assigned while SeekOnAssign asked where its log begins
            known = self._seek_positions()
            await self._placed({tp: known.get((tp.topic, tp.partition)) for tp in exc.args
                                if isinstance(tp, TopicPartition)})
            self._taking_from = None
            return
        except UnsupportedCodecError as exc:  # a producer batch compressed with lz4, snappy or zstd, without cramjam
            self._refuse(unsupported_codec(self.topic, exc), "codec_missing")  # good records: stop, no dead letter
            self._taking_from = None
            return
        except UNREADABLE as exc:  # a record aiokafka itself cannot parse (a header name that is not UTF-8)
            self.hold(set())  # it reads each partition on its own, held ones too
            async for fetched in step_past_unreadable(self._consumer, before, exc, self.max_records, self._sought,
                                                      self.max_record_bytes):
                yield fetched
            self._taking_from = None
            return
        for messages in batches.values():
            for message in messages:
                yield await self._decoded(message, messages[-1].offset)
        self._taking_from = None

    def _deleted(self, tp: tuple[str, int], own: int, beginning: int) -> None:
        """Records `own`..`beginning` - 1 of `tp` were deleted before the learner read them: said, and kept
        for take_gaps()."""
        self._log(deleted_unread(tp, own, beginning))
        self._gaps.append((tp, beginning, beginning - own))

    def take_gaps(self) -> list:
        """[((topic, partition), the log's beginning, records lost)] for the records deleted unread since the
        last call (the learner counts them and reads on from the beginning: OffsetTracker.deleted_before)."""
        gaps, self._gaps = self._gaps, []
        return gaps

    def _refuse(self, line: str, reason: str = "log_changed") -> None:
        """A partition's log is not the learner's (not_this_log), or its records cannot be decompressed here
        (`reason` codec_missing): `refusal`, which stops the learner with `refusal_reason`."""
        if self.refusal is None:
            self.refusal, self.refusal_reason = line, reason

    async def _placed(self, positions: dict) -> None:
        """Seek the partitions a fetch found out of range ({TopicPartition: offset}): place_out_of_range."""
        await place_out_of_range(self._consumer, self.topic, positions, self.probe_timeout_s * 5, self._deleted,
                                 self._refuse)

    async def _positions(self) -> dict:
        positions = {}
        for tp in self._consumer.assignment():
            try:
                positions[tp] = await self._consumer.position(tp)
            except IllegalStateError:  # revoked meanwhile
                pass
        return positions

    async def _decoded(self, message, last: int | None = None) -> Fetched:
        return decoded(message, self.max_record_bytes, last)

    async def send_dead_letter(self, fetched: Fetched, reason: str, detail: str) -> None:
        """Dead-letter a record the learner takes and cannot learn (DeadLetters.send): the first of its reason
        said in one line, its copy sent to `<topic>.dlq` unless `dead_letter` is off."""
        await self._dead_letters.send(self._producer, fetched, reason, detail, self.dead_letter_timeout_s)

    async def settle_dead_letters(self) -> None:
        """The dead-letter copies in flight delivered, or counted as failed, within `dead_letter_timeout_s`
        (1 s when the last reachable() had no answer): before the learner's last checkpoint holds the count."""
        await self._dead_letters.settle(self.dead_letter_timeout_s if self._answering else 1.0)

    @property
    def dead_letter_failures(self) -> int:
        """Dead-letter sends that failed (each record is counted by reason too)."""
        return self._dead_letters.failures

    async def commit(self, positions: dict) -> bool:
        """Commit {(topic, partition): next offset} for the partitions assigned now; False (and one
        line) when Kafka refuses, e.g. during a rebalance: the checkpoint holds the offsets anyway,
        and the next one commits them."""
        if self._consumer is None:  # stopped before it ever joined (a signal while waiting for the topic)
            return False
        return await commit_assigned(self._consumer, positions, self.commit_timeout_s, self._log)

    async def lag(self, taken: dict | None = None, read: dict | None = None) -> dict[int, int]:
        """Records in the log (up to its end as last fetched) not yet read, per assigned partition.
        Between two fetches: beyond the consumer's position, which is past commit markers and
        compacted-away offsets too. While a fetch's records are being taken (a getmany returns up to
        max_records at once, and the learner takes them one by one, waiting while its queue is full;
        the position is already past them all): beyond `taken`'s next offset ({(topic, partition):
        offset}, the learner's batcher's) or, for a partition none of whose records is taken yet,
        beyond its position before that fetch. Never before `read`'s offset (as `taken`): the records
        before it were read, and a partition read again from an earlier offset does not count them. A
        held partition (hold()) is not fetched, so its end is asked of the broker in the background
        (streamer.kafka.lag.HeldEnds): the records written while it is held count from the next read on, and
        after the hold until a fetch of it has seen as far. Never waits on the network."""
        if self._consumer is None:
            return {}
        self._held_ends.ask(self._consumer, self._answering)
        return await records_behind(self._consumer, self._held_ends, lambda: self._taking_from, taken, read,
                                    self._refuse_unless_gone)

    def _refuse_unless_gone(self, line: str) -> None:
        """A log that ends before the learner's offset is refused, unless the topic was deleted (the watch's)."""
        if not self.topic_gone:
            self._refuse(line)
