"""Independent jobs in parallel processes: spawned (a fresh interpreter, no forked torch or
event-loop state), one fresh process per job, a fixed number of torch threads each.

A job's exception never crosses the process boundary as a traceback: it comes back as one line.
Ctrl-C (or SIGTERM made an interrupt) in the parent stops every job: the children ignore SIGINT
themselves (blocked from their start until then: no traceback from an interpreter starting up), and
the parent sends each SIGTERM, which a child takes as Ctrl-C once (the job writes what it can, as a
command interrupted alone does; later SIGTERMs are ignored until it has sent its outcome), and waits
for them before the interrupt goes on; a second interrupt kills them. A job gets the same SIGTERM
when the parent dies (Linux: a kill -9 of the parent leaves no job running), and logs as the parent
does (its levels, its format).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as connection_wait
from dataclasses import dataclass
from typing import Callable, Sequence

from streamer.broker import signal_on_parent_death
from streamer.spin import governor
from streamer.threads import apply_thread_policy

__all__ = ["Outcome", "one_line", "run_jobs"]

_MASKS = hasattr(signal, "pthread_sigmask")  # (not on Windows)
STOPPED = "stopped by SIGTERM"  # the error of a job stopped by a SIGTERM (the parent's, or another's)


@dataclass(frozen=True)
class Outcome:
    """What a job returned, or the one-line error it raised."""

    value: object = None
    error: str | None = None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, at most `limit` characters."""
    return " ".join(f"{type(exc).__name__}: {exc}".replace("\\n", " ").split())[:limit]  # a repr's "\\n" too


def _child(threads: int, govern_spin: bool, logs: tuple, parent: int, conn) -> None:
    """A job process: SIGTERM (the parent's, a process group's, the kernel's when the parent dies) ends it
    until its function runs; then it is taken as Ctrl-C once and ignored after, until the job has sent its
    outcome (SIGINT ignored here: a terminal's Ctrl-C reaches the parent, which decides); the job,
    `(function, task)`, comes through `conn` (after the parent holds this process: an interrupt while a
    large task is sent stops it too); logging as the parent's (`logs`, _logging_now); torch gets
    `threads` threads (streamer.threads' policy, the allocator's with it; OpenMP's spins governed where
    the parent's are); the outcome goes back through `conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # SIGTERM's default until the job runs: nothing to write yet
    _unblock_sigint()  # blocked from its start (run_jobs): one that came meanwhile is dropped now
    try:
        signal_on_parent_death(signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the kernel was asked to tell us
            return
        try:
            function, task = conn.recv()
        except (EOFError, OSError):
            raise
        except Exception as exc:  # noqa: BLE001  (a task this process cannot load: its module is not here)
            _send(conn, Outcome(error=one_line(exc)))
            return
        _log_as(*logs)
        apply_thread_policy(threads, govern_spin=govern_spin)
        signal.signal(signal.SIGTERM, _interrupt_once)  # (raised in an import's callback it was swallowed)
        try:
            outcome = Outcome(value=function(*task))
        except Exception as exc:  # noqa: BLE001  (any failure of a job is its one-line outcome)
            outcome = Outcome(error=one_line(exc))
        _send(conn, outcome)
    except KeyboardInterrupt:  # the job has written and said what it could
        logging.disable(logging.CRITICAL)  # not the interrupted clients' warnings as they are collected
        _send(conn, Outcome(error=STOPPED))  # read where the parent did not stop it (a user's kill)
    except (EOFError, OSError):  # the parent is gone
        return


def _unblock_sigint() -> None:
    if _MASKS:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _send(conn, outcome: Outcome) -> None:
    with contextlib.suppress(OSError):  # BrokenPipeError: the parent is gone, and nobody reads it
        conn.send(outcome)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing is left to write: from here a SIGTERM ends the job


def _interrupt_once(signum, frame) -> None:
    """A process group's SIGTERM (`timeout`, systemd) reaches the job and the parent, which then sends its
    own: the second must not end the job while it writes its report. The parent kills it if asked twice."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


_STYLES = {logging.PercentStyle: "%", logging.StrFormatStyle: "{", logging.StringTemplateStyle: "$"}


def _logging_now() -> tuple:
    """(the root logger's level, its first handler's (format, date format, style) or None where it has
    none, {logger: level} of those set), for _log_as in a spawned job: a fresh interpreter, whose logging is
    not configured (the parent's quiet aiokafka warned there on every lost connection)."""
    root = logging.getLogger()
    form = None
    if root.handlers:
        formatter = root.handlers[0].formatter or logging.Formatter()
        form = (formatter._fmt, formatter.datefmt, _STYLES.get(type(formatter._style), "%"))
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET}
    return root.level, form, levels


def _log_as(level: int, form: tuple | None, levels: dict) -> None:
    if form is not None:  # the parent has a handler: one alike (a format of its own class: the default one)
        fmt, datefmt, style = form
        try:
            logging.basicConfig(level=level, format=fmt, datefmt=datefmt, style=style)
        except ValueError:
            logging.basicConfig(level=level)
    logging.getLogger().setLevel(level)
    for name, named_level in levels.items():
        logging.getLogger(name).setLevel(named_level)


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        return f"killed by {name}" + (": out of memory?" if exitcode == -signal.SIGKILL else "")
    return f"exit status {exitcode}"


def _received(conn) -> Outcome | None:
    """The outcome a job process has sent, else None (it ended without one, or has not sent it yet)."""
    try:
        if conn.poll():
            return conn.recv()
    except (EOFError, OSError):  # the pipe closed with nothing in it: the process died
        pass
    return None


def run_jobs(function: Callable, tasks: Sequence[tuple], jobs: int, threads: int = 1,
             on_outcome: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
    """`function(*task)` for every task, at most `jobs` at a time, each in its own spawned process.

    `function` must be importable by name (a module-level function) and the tasks picklable.
    `on_outcome(index, outcome)` runs in the parent as each job ends (in any order); an exception
    it raises stops the remaining jobs and propagates. A process that dies (killed, out of memory)
    is its job's error. Stopped (an interrupt, on_outcome's exception), the outcomes already sent are
    taken (on_outcome's exceptions then ignored), every other job is sent SIGTERM and waited for (it
    writes what it can); a second interrupt meanwhile kills them. Returns the outcomes in task order."""
    context = multiprocessing.get_context("spawn")
    outcomes: list[Outcome | None] = [None] * len(tasks)
    waiting = list(range(len(tasks)))
    running: dict[int, tuple] = {}  # index -> (process, the parent's end of its pipe)
    governed = governor() is not None  # where the parent's spins are governed, the jobs' are too
    logs, ending = _logging_now(), []  # ending: processes that have sent their outcome (never waited for)

    def taken(index: int, outcome: Outcome) -> None:
        outcomes[index] = outcome  # kept before anything can be interrupted: a finished job is never lost
        if on_outcome is not None:
            on_outcome(index, outcome)
    try:
        while waiting or running:
            while waiting and len(running) < max(1, jobs):
                index = waiting.pop(0)
                ours, theirs = context.Pipe()
                process = context.Process(target=_child, name=f"streamer-job-{index}", daemon=True,
                                          args=(threads, governed, logs, os.getpid(), theirs))
                # SIGINT blocked in this thread while the job starts, which inherits the mask: a terminal's Ctrl-C
                # reaching it before it ignores SIGINT (_child) waits there and is dropped, where it was raised
                # in the new interpreter's start-up (a traceback, or 'Fatal Python error: init_import_site').
                # The parent's own waits the milliseconds of the start (unless another of its threads takes it).
                # Inline, not a context manager, whose frames' starts are more places for a handler to raise.
                if _MASKS:  # multiprocessing's resource tracker, launched by a first start, unblocks SIGINT after
                    resource_tracker.ensure_running()  # its launch: launched first, the start finds it running
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, ()) if _MASKS else None
                try:
                    if _MASKS:
                        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                    process.start()
                    theirs.close()  # the child holds its copy
                    running[index] = (process, ours)
                finally:
                    if _MASKS:
                        try:
                            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                        finally:  # again: signal's wrapper is Python, and a handler raising (SIGTERM made an
                            # interrupt) as it began skipped the first (2 in 10,000 under a stream of SIGTERMs)
                            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                with contextlib.suppress(OSError):  # a child that ended unread: its sentinel or outcome says how
                    ours.send((function, tasks[index]))  # once held: the child reads it after its imports
            ready = set(connection_wait([*(end for pair in running.values() for end in (pair[0].sentinel, pair[1])),
                                         *(process.sentinel for process in ending)]))  # (reaped as they end)
            for index in [i for i, (process, conn) in running.items() if process.sentinel in ready or conn in ready]:
                process, conn = running.pop(index)
                outcome = _received(conn)
                conn.close()
                if outcome is None:
                    process.join()
                    outcome = Outcome(error=f"the job's process ended without a result ({_ended(process.exitcode)})")
                else:
                    ending.append(process)
                taken(index, outcome)
            ending = [process for process in ending if process.is_alive()]  # is_alive reaps the ended
        for process in ending:
            process.join()
    except BaseException:  # interrupted, or on_outcome stopped it: no job outlives the parent's decision
        for index, (process, conn) in list(running.items()):  # the outcomes sent: those jobs are ending
            if (outcome := _received(conn)) is not None:
                ending.append(running.pop(index)[0])
                conn.close()
                with contextlib.suppress(Exception):
                    taken(index, outcome)
        _stop([process for process, _ in running.values()], ending)
        for index, (process, conn) in running.items():  # those that finished as they were stopped
            if (outcome := _received(conn)) is not None and outcome.error != STOPPED:
                with contextlib.suppress(Exception):
                    taken(index, outcome)
            conn.close()
        raise
    return outcomes


def _stop(running: list, ending: list) -> None:
    """SIGTERM to the running jobs, then wait for them and for those ending; killed on a second interrupt."""
    for process in running:
        process.terminate()
    try:
        for process in [*running, *ending]:
            process.join()
    except KeyboardInterrupt:
        for process in [*running, *ending]:
            process.kill()
        for process in [*running, *ending]:
            process.join()
        raise
