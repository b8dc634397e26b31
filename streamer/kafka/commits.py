"""Committing the learner's offsets to Kafka (a Kafka-side module of the learner: streamer.kafka.consumer's
KafkaSource commits by these): only when asked, after a checkpoint that holds them is written, bounded in
time, and a commit given up on kept quiet.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

__all__ = ["commit_assigned", "quiet_abandoned_commits"]


async def commit_assigned(consumer: AIOKafkaConsumer, positions: dict, timeout_s: float, log) -> bool:
    """Commit {(topic, partition): next offset} for the partitions `consumer` is assigned now, within
    `timeout_s`; False when none of them is assigned, and (with one line to `log`) when Kafka refuses, e.g.
    during a rebalance (CommitFailedError, IllegalStateError, a lost coordinator)."""
    assigned = consumer.assignment()
    offsets = {TopicPartition(t, p): o for (t, p), o in positions.items() if TopicPartition(t, p) in assigned}
    if not offsets:
        return False
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.commit(offsets)
    except (KafkaError, AssertionError, asyncio.TimeoutError) as exc:  # (the docstring's refusals)
        log(f"commit of offsets {sorted((tp.partition, o) for tp, o in offsets.items())} failed "
            f"({type(exc).__name__}); the checkpoint holds them, the next one commits them")
        return False
    return True


def quiet_abandoned_commits(loop: asyncio.AbstractEventLoop) -> None:
    """Have `loop` drop the failure of a commit that commit_assigned gave up on (its one line said
    so) and pass every other unhandled exception on as before. aiokafka runs a commit's request in a
    shielded task (GroupCoordinator.commit_offsets), which our timeout does not cancel: with the broker
    frozen it failed later, once the consumer closed, and asyncio printed a 12-line traceback
    ("Task exception was never retrieved") on every rank."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiet_abandoned_commits", False):
        return

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        task = context.get("future") or context.get("task")
        coroutine = task.get_coro() if isinstance(task, asyncio.Task) else None
        if isinstance(context.get("exception"), KafkaError) and \
                getattr(coroutine, "__qualname__", "").endswith("._do_commit_offsets"):
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    handle.quiet_abandoned_commits = True
    loop.set_exception_handler(handle)
