"""Ending asyncio tasks for good: a task that loses its cancellation is cancelled again until it ends.

The prequential loop (streamer.loop) ends its fetch, watch and rank-watch tasks this way at its exit,
and a source's start that a stop overtook."""

from __future__ import annotations

import asyncio
import time

__all__ = ["tasks_ended"]


async def tasks_ended(tasks: list[asyncio.Task], log, again_after_s: float = 1.0, say_after_s: float = 10.0) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again each `again_after_s` one
    that is still running (said in one line once `say_after_s` have passed). A task can lose its
    cancellation: on Python 3.11 `asyncio.wait_for` returns its inner result instead of raising when
    the cancel lands just as that result arrives (CPython gh-86296, fixed in 3.12), and the loop's watch
    task awaited one every second (the broker probe), so a learner at its stop waited for that task for
    good (seen after `--max-batches`, "stopping" 14 minutes). This package's own waits use asyncio.timeout,
    which keeps a cancel; a library's may not."""
    pending, started, said = {task for task in tasks if not task.done()}, time.monotonic(), False
    try:
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=again_after_s)
            if pending and not said and time.monotonic() - started >= say_after_s:
                said = True
                log(f"still stopping: {', '.join(sorted(task.get_coro().__qualname__ for task in pending))} "
                    f"did not end when cancelled; cancelling again every {again_after_s:g} s")
    finally:  # retrieved, as gather(return_exceptions=True) did: a failure here is not the run's
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()
