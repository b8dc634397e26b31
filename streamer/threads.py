"""The torch thread policy: decided here, once, at the start of a learning command, and said in one line.

Default: the CPUs this process may use (its affinity mask, not the machine's count), less one
for the asyncio loop that fetches and decodes records when there are more than 2; an
``OMP_NUM_THREADS`` the user set wins over that default, ``--threads`` over both. OpenMP's
idle threads spin libgomp's own 300,000 turns, about 3 ms, before they sleep (``GOMP_SPINCOUNT``,
set by the command line before torch loads; streamer.settings), so the step's parallel regions
find their threads awake, and 100 turns while other work shares the CPUs (streamer.spin), so a
second torch job on the same CPUs slows the learner instead of starving it. Where the threads are
too few for that (at most half the CPUs, rounded up: the default on 3 CPUs, or a small --threads)
or there is no /proc/stat to watch the CPUs by, the spin is a fixed 500 turns.

The ranks of `learn --nproc N` each pin themselves first to an equal share of the CPUs
(``--pin-cpus``: rank_cpu_share, pin_to_rank_share), so each decides all of the above on its own
share, as one learner on a machine of that size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from streamer.allocator import keep_freed_memory
from streamer.settings import choose_openmp_spin
from streamer.spin import govern, watchable

__all__ = ["ThreadPolicy", "available_cpus", "default_threads", "rank_threads", "thread_policy", "choose_spin",
           "apply_thread_policy", "pin_to_first_cpus", "rank_cpu_share", "pin_to_rank_share"]


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int  # torch intra-op threads
    cpus: int  # the CPUs this process may use
    reason: str  # why this many: "--threads", "OMP_NUM_THREADS=N" or the default's rule
    governed: bool = False  # OpenMP's spins follow whether other work shares the CPUs (streamer.spin)

    def describe(self) -> str:
        spins = "; OpenMP spins shortened while other work shares them" if self.governed else ""
        return f"torch threads: {self.threads} ({self.cpus} CPUs, {self.reason}; --threads N to change{spins})"


def available_cpus() -> int:
    """The CPUs this process may run on (sched_getaffinity where the OS has it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def pin_to_first_cpus(cpus: int | None) -> list[int]:
    """Pin this process (and what it starts later) to the first `cpus` CPUs it may use; returns them
    (None: all it may use, nothing pinned). ValueError (one line) when it may use fewer, or `cpus` is
    under 1. Linux only (sched_setaffinity)."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpus is None:
        return allowed
    if not 1 <= cpus <= len(allowed):
        raise ValueError(f"--cpus {cpus}, but this process may use 1 to {len(allowed)} CPUs")
    os.sched_setaffinity(0, allowed[:cpus])
    return allowed[:cpus]


def rank_cpu_share(allowed: list[int], local_rank: int, local_world: int) -> list[int] | None:
    """Local rank `local_rank`'s share of the CPUs `allowed` (sorted) among the `local_world` ranks on one
    machine: len(allowed) // local_world consecutive ones, the same count for every rank (the ranks step
    together, so the slowest sets the pace; a remainder is left to the agent and whatever else runs);
    None when there are fewer CPUs than ranks."""
    share = len(allowed) // local_world if local_world > 0 else 0
    if share == 0 or not 0 <= local_rank < local_world:
        return None
    return allowed[local_rank * share:(local_rank + 1) * share]


def pin_to_rank_share(local_rank: int, local_world: int) -> list[int] | None:
    """Pin this process to its rank_cpu_share of the CPUs it may use: every thread it has (numpy's
    OpenBLAS pool starts at import) and, through the mask they inherit, those it starts later (before
    torch loads: OpenMP's team); returns them, or None (nothing done) when there are fewer CPUs than ranks."""
    share = rank_cpu_share(sorted(os.sched_getaffinity(0)), local_rank, local_world)
    if share is None:
        return None
    try:
        threads = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread alone
        threads = [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, share)
        except ProcessLookupError:  # ended meanwhile
            continue
    return share


def default_threads(cpus: int, omp_threads: int | None = None) -> ThreadPolicy:
    """The policy when --threads is not given (`omp_threads`: the user's OMP_NUM_THREADS, if set)."""
    if omp_threads:
        return ThreadPolicy(omp_threads, cpus, f"OMP_NUM_THREADS={omp_threads}")
    if cpus > 2:
        return ThreadPolicy(cpus - 1, cpus, "one CPU left to the event loop")
    return ThreadPolicy(cpus, cpus, "all of them")


def rank_threads(cpus: int, ranks: int) -> int:
    """The torch threads of each of `ranks` learners on one machine's `cpus` CPUs (`learn --nproc`):
    the default rule on each rank's share of the CPUs (each rank has an event loop of its own)."""
    return default_threads(max(1, cpus // ranks)).threads


def thread_policy(threads: int | None, omp_threads: int | None = None) -> ThreadPolicy:
    """The policy for --threads `threads` (None: not given) on the CPUs this process may use."""
    cpus = available_cpus()
    return ThreadPolicy(threads, cpus, "--threads") if threads else default_threads(cpus, omp_threads)


def choose_spin(threads: int | None, omp_threads: int | None = None) -> bool:
    """Before torch loads: OpenMP's wait for the policy's threads on the CPUs this process may use
    (streamer.settings.choose_openmp_spin, where /proc/stat shows them); True when
    apply_thread_policy is to govern the spins (its `govern_spin`)."""
    policy = thread_policy(threads, omp_threads)
    return choose_openmp_spin(policy.threads, policy.cpus, watchable())


def apply_thread_policy(threads: int | None, omp_threads: int | None = None, *,
                        govern_spin: bool = False) -> ThreadPolicy:
    """Set torch's thread counts once (imports torch) and the allocator's policy beside them
    (streamer.allocator: the step's memory is reused, not faulted in anew every batch); return the
    thread policy applied. `govern_spin` (the spin count is the command's own, streamer.settings):
    with more than one thread, OpenMP's spins follow whether the CPUs are shared (streamer.spin)."""
    import torch

    keep_freed_memory()

    policy = thread_policy(threads, omp_threads)
    torch.set_num_threads(policy.threads)
    try:  # allowed once, before any inter-op work; a second command in one process keeps the first
        torch.set_num_interop_threads(policy.threads)
    except RuntimeError:
        pass
    if govern_spin and policy.threads > 1:
        govern()
        return replace(policy, governed=True)
    return policy
