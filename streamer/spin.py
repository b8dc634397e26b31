"""OpenMP's wait: long spins while the learner has its CPUs to itself, short ones while it shares them.

torch's OpenMP runtime on Linux (GNU libgomp) keeps the step's helper threads spinning for
GOMP_SPINCOUNT turns after each parallel region before they sleep. A step runs hundreds of regions
(the default LSTM 261), and a region that starts after its helper slept waits for the wake-up (22 us
to an idle vCPU on the 2-core VM this was measured on). `benchmarks/contention.py --spins` on that
VM: alone, 500 spins ran the step at 0.91 of libgomp's own 300,000 and 2,000 at 1.05; beside a
second learner on the same 2 CPUs, 500 spins slowed it 2.7x, 1,000 3.9x, 2,000 6.4x (spinning
threads hold the CPUs the other job's threads wait for). No fixed count is good at both.

libgomp itself has the second setting: a throttled spin (100 turns, with OMP_WAIT_POLICY unset) that
it uses, checked at every wait, while it manages more threads than the CPUs the process may use.
The learning commands set GOMP_SPINCOUNT to libgomp's own 300,000 (streamer.settings; 2,000, tried
first, let the helpers sleep between regions: the memory path ran at 0.93 of torch's default on 2
cores and 0.68 on 16), and `SpinGovernor` watches how much CPU other work takes on the CPUs this
process may use (their busy time in /proc/stat less this process's own CPU time): when it is
shared, a parked thread runs one parallel torch op and waits; its idle OpenMP team (as large as
the step's) takes libgomp over the CPU count (it counts 2 x threads - 1 for the two teams;
streamer.settings governs only where that is over the CPUs), so every wait spins 100 turns. When other work has stayed low long enough, the parked thread
ends, its team with it, and the long spins come back. The thread count does not change
(streamer.threads decides it once), nor do the results: spinning only moves when a thread notices
its next region. (Our own threads' run delay would not do as the signal: with the short spins they
sleep instead of waiting for a CPU, so it falls while the other job still runs, and the governor
flaps.)

Any other long-lived thread that runs a parallel torch op keeps an OpenMP team of its own for good,
and with it the short spins; the learner's torch work outside its step's worker (the checkpoint's
state and copy, a resume's load, building the model; compare's plan check and multitask run) runs
through `in_passing`, in a thread that ends at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SpinGovernor", "govern", "governor", "in_passing", "outlast", "busy_ticks", "stat_cpus", "watchable",
           "Reader"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_governor: SpinGovernor | None = None  # this process's, once started


def govern() -> SpinGovernor:
    """Start this process's SpinGovernor (once; later calls return the same one), stopped at the
    interpreter's exit: a thread left inside torch's C++ there (the parked thread making its team)
    aborts the process ("terminate called without an active exception"), seen once in a full suite
    after a learner's one-line error."""
    global _governor
    if _governor is None:
        _governor = SpinGovernor().start()
        atexit.register(_governor.stop)
    return _governor


def governor() -> SpinGovernor | None:
    """This process's SpinGovernor, None where the spins are not governed (the job processes it
    starts then govern theirs the same way)."""
    return _governor


def in_passing(function: Callable[..., T], *args, on_interrupt: Callable[[], None] | None = None) -> T:
    """`function(*args)` in a thread of its own that ends when it returns (its OpenMP team, if a
    parallel op made one, ends with it); returns its value or raises its exception, here. The thread
    starts on the caller's CUDA device (torch keeps it per thread). A signal's exception (Ctrl-C,
    SIGTERM) that interrupts the wait here is raised once the thread has ended (a process that
    exits while a thread is inside torch's C++ aborts): `on_interrupt` is called first, to make
    long work stop early; a second one exits at once (`outlast`)."""
    torch = sys.modules.get("torch")  # not imported here: the caller's torch work has imported it
    device = torch.cuda.current_device() if torch is not None and torch.cuda.is_initialized() else None
    outcome: dict = {}
    ended = threading.Event()  # not Thread.join: on Python 3.11 a join that an interrupt ends marks the
    # still running thread as ended (bpo-45274's mend), and every later join returns at once

    def call() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outcome["value"] = function(*args)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc
        finally:
            ended.set()

    thread = threading.Thread(target=call, name="streamer-in-passing", daemon=True)
    thread.start()
    try:
        outlast(ended.wait, on_interrupt)
    finally:
        thread.join()  # its last C++ (an OpenMP team's end) too
    error = outcome.pop("error", None)
    if error is not None:
        try:
            raise error
        finally:  # no cycle through this frame keeps the failed work's objects alive
            del error
    return outcome["value"]


def outlast(wait: Callable[[], object], on_interrupt: Callable[[], None] | None = None) -> None:
    """`wait()`, a wait for work in another thread (a step in flight), to its end. An interrupt (Ctrl-C,
    or SIGTERM taken as one) that lands in it calls `on_interrupt` (to make the work stop early) and is
    raised after the wait; a second exits the process at once."""
    try:
        wait()
    except BaseException:
        if on_interrupt is not None:
            on_interrupt()
        _to_the_end(wait)
        raise


def _to_the_end(wait: Callable[[], object]) -> None:
    """`wait()` again, after an interrupt: a second interrupt exits the process now (os._exit, status 130, or
    a SystemExit's own), since a normal exit while the awaited thread is inside torch's C++ aborts it
    ('terminate called without an active exception', status 134), as two quick Ctrl-Cs did."""
    try:
        wait()
    except BaseException as again:
        print("streamer: interrupted again: exiting now", file=sys.stderr, flush=True)
        os._exit(again.code if isinstance(again, SystemExit) and isinstance(again.code, int) else 130)


def _cpu_lines(stat: str) -> dict[int, list[int]] | None:
    """/proc/stat's per-CPU lines: {CPU number: its tick counters}; None where there is no such file."""
    cpus = {}
    try:
        with open(stat) as file:
            for line in file:
                if not line.startswith("cpu"):
                    break
                name, *fields = line.split()
                if name != "cpu":
                    cpus[int(name[3:])] = [int(field) for field in fields]
    except (OSError, ValueError):
        return None
    return cpus


def stat_cpus(stat: str = "/proc/stat") -> set[int] | None:
    """The CPUs /proc/stat lists, None where there is no such file."""
    lines = _cpu_lines(stat)
    return None if lines is None else set(lines)


def watchable(cpus: set[int] | None = None, stat: str = "/proc/stat") -> bool:
    """Whether a SpinGovernor can watch `cpus` (default: those this process may use): /proc/stat
    lists each of them (not where it is missing, or renumbered inside a container)."""
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return False
        cpus = set(os.sched_getaffinity(0))
    listed = stat_cpus(stat)
    return listed is not None and cpus <= listed


def busy_ticks(cpus: set[int], stat: str = "/proc/stat") -> int | None:
    """Clock ticks (USER_HZ) the CPUs `cpus` have spent busy (user, nice, system, irq, softirq; not
    iowait, not steal), all processes together; None where there is no such file."""
    lines = _cpu_lines(stat)
    if lines is None:
        return None
    return sum(user + nice + system + irq + softirq
               for cpu, (user, nice, system, _idle, _iowait, irq, softirq, *_) in lines.items() if cpu in cpus)


class Reader:
    """Other work's CPU time on `cpus`, read as (CPU seconds, over seconds) every `every_s`.

    A read is kept only when it came every_s after the one before, give or take half: a longer gap
    means this process was stopped (SIGSTOP, a frozen container) or its reading thread starved, and
    whatever ran in the gap would look like work beside ours. The three clocks of a read (busy
    ticks, this process's CPU time, the monotonic clock) are taken together, within `within_s`, or
    the read is dropped too. `stat`: the file to read (tests point it elsewhere)."""

    def __init__(self, cpus: set[int], every_s: float, within_s: float = 0.02, stat: str = "/proc/stat"):
        self.cpus, self.every_s, self.within_s, self.stat = cpus, every_s, within_s, stat
        self.tick = os.sysconf("SC_CLK_TCK")
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[int, float, float] | None:
        began = time.monotonic()
        busy, own = busy_ticks(self.cpus, self.stat), time.process_time()
        at = time.monotonic()
        return None if busy is None or at - began > self.within_s else (busy, own, at)

    def read(self) -> tuple[float, float] | None:
        """Other work since the last read (CPU seconds, seconds), or None when this read is not kept."""
        now, last = self._snapshot(), self._last
        self._last = now  # a dropped read starts the next interval afresh
        if now is None or last is None or not 0.5 * self.every_s < now[2] - last[2] < 1.5 * self.every_s:
            return None
        # other work is never below none: the CPUs' ticks (10 ms) and this process's own clock differ in grain
        return max(0.0, (now[0] - last[0]) / self.tick - (now[1] - last[1])), now[2] - last[2]


class SpinGovernor:
    """Short OpenMP spins while other work shares this process's CPUs, long ones otherwise (above).

    Every `every_s` a `Reader` tells how much CPU other work took on the CPUs this process may use.
    The spins go short when the other work of the last `window` kept reads averages above
    `shared_above` CPUs (about one competing thread: a broker or an exporter beside the learner
    takes far less), and long again once that average has stayed under `alone_below` for
    `calm_reads` reads in a row. `start()` begins the watch in a daemon thread; `stop()` ends it
    and the short spins. `shared` (plain state): whether the short spins are on; `switches`: how
    often that changed."""

    def __init__(self, every_s: float = 0.1, window: int = 5, shared_above: float = 0.75,
                 alone_below: float = 0.5, calm_reads: int = 10):
        self.every_s, self.window = every_s, window
        self.shared_above, self.alone_below, self.calm_reads = shared_above, alone_below, calm_reads
        self.shared = False
        self.switches = 0
        self._reads: deque[tuple[float, float]] = deque(maxlen=window)  # kept reads: (CPU seconds, seconds)
        self._calm = 0  # reads in a row under alone_below while shared
        self._release: threading.Event | None = None  # set: the parked thread (and its team) ends
        self._team: threading.Thread | None = None  # the parked thread, while the spins are short
        self._stopped = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> SpinGovernor:
        """Begin the watch (streamer.settings.choose_openmp_spin governs only where spin.watchable)."""
        self._watch = threading.Thread(target=self._run, name="streamer-spin", daemon=True)
        self._watch.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the watch and the short spins, and wait (up to `timeout_s` each) for the watcher and
        the parked thread to end: neither is left inside torch's C++. Once is enough; again, nothing."""
        self._stopped.set()
        if self._watch is not None:
            self._watch.join(timeout_s)
        self._short(False)
        team, self._team = self._team, None
        if team is not None:
            team.join(timeout_s)

    def decide(self, others: float, seconds: float) -> bool:
        """Take one kept read (`others` CPU seconds of other work over `seconds`); True when the
        spins changed."""
        self._reads.append((others, seconds))
        if len(self._reads) < self.window:
            return False
        average = sum(cpu for cpu, _ in self._reads) / sum(span for _, span in self._reads)
        if not self.shared:
            self._calm = 0
            return average > self.shared_above and self._short(True)
        self._calm = self._calm + 1 if average < self.alone_below else 0
        return self._calm >= self.calm_reads and self._short(False)

    def _short(self, on: bool) -> bool:
        if on == self.shared:
            return False
        if on:
            self._release = threading.Event()
            team_made, failed = threading.Event(), []
            self._team = threading.Thread(target=_hold_a_team, args=(team_made, self._release, failed),
                                          name="streamer-spin-team", daemon=True)
            self._team.start()
            if not team_made.wait(10) or failed:
                self._release.set()
                self._release = None
                raise RuntimeError(f"no OpenMP team to shorten the spins with ({failed[0] if failed else 'timed out'})")
        else:
            self._release.set()
            self._release = None
        self.shared = on
        self.switches += 1
        log.info("OpenMP spins %s", "short: other work shares the CPUs" if on else "long: the CPUs are ours again")
        return True

    def _run(self) -> None:
        reader = Reader(set(os.sched_getaffinity(0)), self.every_s)
        try:
            while not self._stopped.wait(self.every_s):
                read = reader.read()
                if read is not None:
                    self.decide(*read)
        except Exception as exc:  # noqa: BLE001 - one line, and the spins stay as they are
            log.warning("OpenMP spin governor stopped: %s", exc)


def _hold_a_team(made: threading.Event, release: threading.Event, failed: list[BaseException]) -> None:
    """Run one parallel op (a team of torch's threads, as many as the step's, stays docked with this
    thread) and park until `release`; an exception goes into `failed` instead."""
    try:
        import torch

        ones = torch.ones(1 << 20)  # over at::parallel_for's grain (32,768) for up to 32 threads: one full team
        ones.mul_(2)
    except Exception as exc:  # noqa: BLE001 - the watcher reports it
        failed.append(exc)
        return
    finally:
        made.set()
    release.wait()
