"""Independent jobs in parallel processes: spawned (a fresh interpreter, no forked torch or
event-loop state), one fresh process per job, a fixed number of torch threads each.

A job's exception never crosses the process boundary as a traceback: it comes back as one line.
Ctrl-C (or SIGTERM made an interrupt) in the parent stops every job: the children ignore SIGINT
themselves, and the parent terminates them before the interrupt goes on.
"""

from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.connection import wait as connection_wait
from dataclasses import dataclass
from typing import Callable, Sequence

from streamer.spin import governor
from streamer.threads import apply_thread_policy

__all__ = ["Outcome", "one_line", "run_jobs"]

@dataclass(frozen=True)
class Outcome:
    """What a job returned, or the one-line error it raised."""

    value: object = None
    error: str | None = None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, at most `limit` characters."""
    return " ".join(f"{type(exc).__name__}: {exc}".replace("\\n", " ").split())[:limit]  # a repr's "\\n" too


def _child(function: Callable, task: tuple, threads: int, govern_spin: bool, conn) -> None:
    """A job process: the parent stops us on Ctrl-C (SIGINT ignored here); torch gets `threads` threads
    (streamer.threads' policy, the allocator's with it; OpenMP's spins governed where the parent's
    are); the outcome goes back through `conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    apply_thread_policy(threads, govern_spin=govern_spin)
    try:
        outcome = Outcome(value=function(*task))
    except Exception as exc:  # noqa: BLE001  (any failure of a job is its one-line outcome)
        outcome = Outcome(error=one_line(exc))
    conn.send(outcome)
    conn.close()


def _collect(process, conn) -> Outcome:
    """The outcome of a job process that has sent it or ended."""
    try:
        if conn.poll():
            outcome = conn.recv()
            process.join()
            return outcome
    except EOFError:  # the pipe closed with nothing in it: the process died
        pass
    process.join()
    return Outcome(error=f"the job's process ended without a result (exit status {process.exitcode})")


def run_jobs(function: Callable, tasks: Sequence[tuple], jobs: int, threads: int = 1,
             on_outcome: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
    """`function(*task)` for every task, at most `jobs` at a time, each in its own spawned process.

    `function` must be importable by name (a module-level function) and the tasks picklable.
    `on_outcome(index, outcome)` runs in the parent as each job ends (in any order); an exception
    it raises stops the remaining jobs and propagates. A process that dies (killed, out of memory)
    is its job's error. Returns the outcomes in task order."""
    context = multiprocessing.get_context("spawn")
    outcomes: list[Outcome | None] = [None] * len(tasks)
    waiting = list(range(len(tasks)))
    running: dict[int, tuple] = {}  # index -> (process, the parent's end of its pipe)
    governed = governor() is not None  # where the parent's spins are governed, the jobs' are too
    try:
        while waiting or running:
            while waiting and len(running) < max(1, jobs):
                index = waiting.pop(0)
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(function, tasks[index], threads, governed, sender),
                                          name=f"streamer-job-{index}", daemon=True)
                process.start()
                sender.close()  # the child holds its copy
                running[index] = (process, receiver)
            ready = set(connection_wait([end for pair in running.values() for end in (pair[0].sentinel, pair[1])]))
            for index in [i for i, (process, conn) in running.items() if process.sentinel in ready or conn in ready]:
                process, conn = running.pop(index)
                outcomes[index] = _collect(process, conn)
                conn.close()
                if on_outcome is not None:
                    on_outcome(index, outcomes[index])
    except BaseException:  # interrupted, or on_outcome stopped it: no job outlives the parent's decision
        for process, conn in running.values():
            process.terminate()
        for process, conn in running.values():
            process.join()
            conn.close()
        raise
    return outcomes
