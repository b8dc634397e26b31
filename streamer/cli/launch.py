"""`streamer learn --nproc N`: torchrun's elastic agent, in the launcher's process, starts N ranks of the same
command on this machine (each with its share of the CPUs and its threads); the launcher's lines and exit
status for ranks that failed or were stopped, its signal handlers given back, and torchrun's log folders."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from streamer.cli.errors import UserError, caused_by
from streamer.settings import omp_num_threads, set_agent_pid, set_rank_threads, torchrun_environment
from streamer.threads import available_cpus, rank_threads

__all__ = ["AGENT_SIGNALS", "launches_ranks", "start_ranks", "failed_ranks"]


def launches_ranks(args) -> bool:
    """`learn --nproc N` outside torchrun: this process only starts the ranks (torchrun's agent); each
    rank decides its own CPUs, threads and spins."""
    return args.nproc > 1 and torchrun_environment() is None


def start_ranks(args, device: str) -> int:
    """torchrun's elastic agent, in this process, runs `args.nproc` ranks of this command less its --nproc
    (each with its share of the CPUs and its threads, where the user did not say them); the launcher's exit
    status: 0, 143 or 128 + the signal that stopped the ranks, or a UserError naming the failed ranks."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    command, split, threads = _without_nproc(args.argv), "", args.threads
    if args.threads is None and omp_num_threads() is None:  # else the user's count, in every rank, unpinned
        cpus = available_cpus()
        threads = rank_threads(cpus, args.nproc)
        command += ["--threads", str(threads)]
        if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
            split = "; CPUs not pinned for GPU ranks (torchrun's --numa-binding places them near their GPUs)"
        elif cpus >= args.nproc:  # the rule on each rank's share, on that share alone
            if not args.pin_cpus:
                command.append("--pin-cpus")
            split = f"; each pinned to its {cpus // args.nproc} of the {cpus} CPUs"
        else:
            split = f"; {cpus} CPUs for {args.nproc} ranks: not pinned"
    if threads is not None:  # OpenMP's count in the ranks too, where the user's OMP_NUM_THREADS does not say
        set_rank_threads(threads)  # (torchrun would set 1 there, with a four-line warning)
    set_agent_pid(os.getpid())  # torchrun's agent runs in this process: a rank orphaned before it asked stops
    print(f"starting {args.nproc} ranks (torchrun --standalone --nproc-per-node {args.nproc} -m streamer "
          f"{' '.join(command)}){split}", flush=True)
    for agent in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(agent).addFilter(_said_by_the_launcher)
    handlers = {number: signal.getsignal(number) for number in AGENT_SIGNALS}
    try:  # torchrun's own log folder, in one that goes with the run (its default, a /tmp/torchelastic_* per run, stays)
        with _rank_logs() as logs:
            torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "--log-dir", logs,
                      "-m", "streamer", *command])
    except ChildFailedError as exc:
        statuses = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        line = failed_ranks(statuses)
        if line is not None:
            raise UserError(line) from None
        # a SIGTERM sent to a rank by someone else: every rank stopped and checkpointed, a stop (2 was a failure)
        print(f"streamer learn: SIGTERM to rank(s) {', '.join(map(str, sorted(statuses)))}: the ranks stopped "
              "(see their lines above)", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except Exception as exc:
        # the agent passed the signal on to the ranks, which stopped cleanly; a SIGTERM landing in the
        # agent's metrics wrapper comes out as that wrapper's UnboundLocalError (the agent still sent
        # the ranks SIGTERM): seen once in a full suite, status 1 and a traceback instead of 143
        sigval = getattr(caused_by(exc, SignalException), "sigval", None)
        if sigval is None:
            raise
    else:
        return 0
    finally:  # the agent's handlers outlive it: a signal from here on would raise its exception, uncaught
        _handlers_back(handlers)
    ctrl_c = signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second one ends the launcher at once, not the wait
    _end_the_rendezvous()
    signal.signal(signal.SIGINT, ctrl_c)
    print(f"streamer learn: {signal.Signals(sigval).name}: the ranks stopped (see their lines above)",
          file=sys.stderr, flush=True)
    return 128 + sigval


AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # torchrun's agent's (by default)


def _handlers_back(handlers: dict) -> None:
    """In place of the handlers torchrun's agent installed for AGENT_SIGNALS (each raises its
    SignalException) and leaves behind: those before it (SIGHUP ignored under nohup stays so), except
    SIGTERM's, which said that nothing was learned yet: a SIGTERM now ends the launcher at once."""
    for number, handler in handlers.items():
        signal.signal(number, signal.SIG_DFL if number == signal.SIGTERM else handler)


def _end_the_rendezvous(wait_s: float = 10.0) -> None:
    """Stopped by a bare signal, the agent leaves its rendezvous unclosed, with a daemon thread that sends
    the store a heartbeat every 5 s until the rendezvous is freed. Left to the interpreter's exit, a
    heartbeat in flight there (the GIL released inside the store's C++) ended the launcher with
    "terminate called without an active exception" and SIGABRT instead of 143 (once in CI): the
    exception, then kept in a local, held the agent's frames and so the rendezvous. Nothing keeps it
    now; freed (by a collection, where it sits in a cycle), it stops and joins that thread. A heartbeat
    in flight holds it meanwhile: it is then freed in that thread as the heartbeat ends (which ends the
    thread), or, in a cycle, outlives the collection. So: collect, wait half a second, again, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    heartbeats = [thread for thread in threading.enumerate() if thread.name.startswith("RendezvousKeepAliveTimer")]
    for thread in heartbeats:
        while thread.is_alive() and time.monotonic() < deadline:
            gc.collect()
            thread.join(0.5)


RANK_LOGS, LAUNCHER_LOCK = "streamer-ranks-", ".launcher"  # torchrun's log folders (prefix), their lock


@contextlib.contextmanager
def _rank_logs():
    """A temporary folder for torchrun's logs, removed when the ranks end and held meanwhile (a flock on
    its LAUNCHER_LOCK, which the kernel drops when the launcher dies; where the file system has no flock,
    there is no lock and the folder is never swept). The folders of earlier launchers killed (-9) before
    they could remove their own, which nobody holds, are removed first."""
    for folder in Path(tempfile.gettempdir()).glob(RANK_LOGS + "*"):
        _remove_unless_held(folder)
    with tempfile.TemporaryDirectory(prefix=RANK_LOGS) as logs, open(Path(logs) / f"{LAUNCHER_LOCK}.new", "w") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.rename(lock.name, Path(logs) / LAUNCHER_LOCK)  # seen by others only once held
        yield logs


def _remove_unless_held(folder: Path) -> None:
    try:
        with open(folder / LAUNCHER_LOCK) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)
    except OSError:  # held (its launcher runs), not ours to open, or no lock (not a launcher's, or gone)
        pass


def failed_ranks(statuses: dict[int, int]) -> str | None:
    """The launcher's one line for ranks that ended badly (`statuses`: global rank -> exit status):
    those that failed, each with its status where they differ, and those torchrun's agent then stopped
    with SIGTERM (status -15, or 143 where the rank caught it); the failed ranks' own lines come before
    it. None when every rank ended by SIGTERM: sent to one by someone else, they all stopped."""
    stopped = sorted(rank for rank, status in statuses.items() if status in (-signal.SIGTERM, 128 + signal.SIGTERM))
    failed = sorted(set(statuses) - set(stopped))
    if not failed:
        return None
    names = {member.value: f" ({member.name})" for member in signal.Signals}

    def shown(code: int) -> str:
        return f"{code}{names.get(-code, '')}"  # a negative status: the signal
    if len({statuses[rank] for rank in failed}) == 1:
        line = (f"rank(s) {', '.join(map(str, failed))} failed (exit status {shown(statuses[failed[0]])}); "
                "their own lines are above")
    else:  # ("rank(s) 0, 1 failed (exit status -9 (SIGKILL), 2)" said not which was which)
        each = ", ".join(f"{rank} (exit status {shown(statuses[rank])})" for rank in failed)
        line = f"rank(s) {each} failed; their own lines are above"
    return line + (f"; torchrun's agent then stopped rank(s) {', '.join(map(str, stopped))}" if stopped else "")


def _said_by_the_launcher(record: logging.LogRecord) -> bool:
    """torchrun's agent's records that the launcher's own line restates: a rank's failure, the SIGTERM
    it then sends the others, and a signal it passes on to the ranks (its other records, such as a
    rank that will not stop, stay)."""
    return not str(record.msg).startswith(("failed (exitcode: ", "Sending process ", "Received %s death signal"))


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line less its --nproc N (or --nproc=N, or an abbreviation argparse took, --npro 2: passed
    on, torchrun refused it with its own 20-line usage): what each rank runs."""
    def nproc(flag: str) -> bool:
        return len(flag) > len("--n") and "--nproc".startswith(flag)
    kept, skip = [], False
    for word in argv:
        flag, given, _ = word.partition("=")
        if skip:
            skip = False
        elif nproc(word):
            skip = True
        elif not (given and nproc(flag)):
            kept.append(word)
    return kept
