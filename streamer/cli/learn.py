"""`streamer learn`: consume a topic and learn prequentially under the live view."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

from streamer.cli.configs import learn_config, say, silent
from streamer.cli.errors import UserError, caused_by, storage_error
from streamer.cli.flags import (DEFAULT_BOOTSTRAP, DEFAULT_TOPIC, add_model_flags, add_run_flags, default_of,
                                positive_float, positive_int)
from streamer.cli.report import print_run_report
from streamer.cli.security_flags import add_metrics_security_flags, add_security_flags
from streamer.cli.runs import (default_manifest_path, learn_under_view, run_with_report_on_interrupt, signals_deferred,
                                unwind_on_sigterm)
from streamer.config import LearnConfig, default_group
from streamer.settings import (omp_num_threads, set_agent_pid, set_rank_threads, started_by_torchrun_agent,
                               torchrun_environment, torchrun_local_world)
from streamer.threads import available_cpus, pin_to_rank_share, rank_threads

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("learn", help="consume a topic and learn prequentially")
    p.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP, metavar="HOST:PORT",
                   help="Kafka address, comma-separated for several (default %(default)s)")
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the topic to learn from (default %(default)s)")
    p.add_argument("--group", help=f"consumer group id (default {default_group('<topic>', '<strategy>')}: two "
                                   "learners of one topic never share offsets by accident)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: move the run directory's old files aside and read the topic from its "
                        "beginning (default: continue the run from its checkpoint, when it has one; the run "
                        "directory defaults to runs/<topic>-<group>; a run without a checkpoint is refused in a "
                        "group that has committed offsets: they belong to a model elsewhere)")
    p.add_argument("--manifest", type=Path,
                   help="the producer's manifest: total batches, classes, N, streams and window (default: "
                        f"{default_manifest_path('<topic>')} when `streamer produce` wrote it there)")
    p.add_argument("--streams", type=positive_int,
                   help=f"b: parallel streams (default: the manifest's, else {default_of(LearnConfig, 'streams')})")
    p.add_argument("--window", type=positive_int,
                   help="w: tokens (bytes) per window (default: the manifest's, else "
                        f"{default_of(LearnConfig, 'window')})")
    p.add_argument("--seed", type=int, default=default_of(LearnConfig, "seed"),
                   help="seed of the model and the strategy (default %(default)s)")
    p.add_argument("--idle-timeout", type=positive_float,
                   help="stop after this many seconds without records (default: wait forever, as a daemon)")
    p.add_argument("--keep-windows", type=positive_int, default=default_of(LearnConfig, "keep_windows"),
                   help="while the next batch waits for a stream (one stopped, or far slower), the most windows "
                        "(of --window tokens: bytes for the byte-level models) any other stream keeps in memory "
                        "and in the checkpoint: its further records stay in Kafka and are read again, in order, "
                        "once it holds half as many (default %(default)s)")
    p.add_argument("--nproc", type=positive_int, default=1,
                   help="ranks on this machine learning as one model (torchrun's elastic agent starts them; "
                        "each learns streams / nproc of the --streams, from its own partitions: produce with "
                        "--partitions <streams>; on the CPU, with a CPU or more a rank, each is pinned to its own "
                        "equal share of the CPUs (--pin-cpus) and takes its threads there, unless --threads or "
                        "OMP_NUM_THREADS says; default "
                        "%(default)s). Several machines: run `torchrun --nnodes ... -m streamer learn` on each "
                        "(see the README)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="under torchrun: pin this rank to its own equal share of the CPUs it may use (by "
                        "LOCAL_RANK of LOCAL_WORLD_SIZE), so the ranks of one machine never share a CPU and each "
                        "decides its OpenMP spin on its share as one learner does on the whole machine; give "
                        "--threads too (torchrun sets OMP_NUM_THREADS=1 in its ranks unless you set it). --nproc "
                        "adds both on the CPU where there are at least as many CPUs as ranks and neither "
                        "--threads nor OMP_NUM_THREADS is given")
    add_model_flags(p)
    add_security_flags(p)
    add_metrics_security_flags(p)
    add_run_flags(p, run_dir_default="runs/<topic>-<group>: the same command continues the same run")


def _manifest(args, say: bool = True) -> tuple[Path | None, dict | None]:
    """--manifest, else produce's default manifest of the topic when it exists (said in one line where
    `say`: by the run's one process or rank 0, not by `--nproc`'s launcher and every rank again)."""
    path = args.manifest
    if path is None:
        path = default_manifest_path(args.topic)
        if not path.is_file():
            return None, None
        if say:
            _say_default_manifest(args.topic, path)
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--manifest {path}: cannot read it ({exc})") from None


def _say_default_manifest(topic: str, path: Path) -> None:
    print(f"manifest: {path} (produce's for topic {topic}; --manifest to choose another)", flush=True)


def launches_ranks(args) -> bool:
    """`learn --nproc N` outside torchrun: this process only starts the ranks (torchrun's agent); each
    rank decides its own CPUs, threads and spins."""
    return args.nproc > 1 and torchrun_environment() is None


def pin_rank(args) -> str | None:
    """--pin-cpus under torchrun: pin this rank to its share of the CPUs (before torch loads and the
    thread policy is decided); the line that says so, or None without --pin-cpus or torchrun."""
    environment = torchrun_environment()
    if not getattr(args, "pin_cpus", False) or environment is None:
        return None
    local_rank, local_world = environment[2], torchrun_local_world()
    if local_world is None:
        return "CPUs not pinned: LOCAL_WORLD_SIZE is not set (torchrun sets it in every rank; --pin-cpus)"
    if not 0 <= local_rank < local_world:
        return f"CPUs not pinned: local rank {local_rank} is not below LOCAL_WORLD_SIZE {local_world} (--pin-cpus)"
    share = pin_to_rank_share(local_rank, local_world)
    if share is None:
        return (f"CPUs not pinned: {available_cpus()} CPUs for {local_world} ranks on this machine, "
                f"fewer than one each (--pin-cpus)")
    return f"CPUs {_cpu_list(share)}: local rank {local_rank}'s share of {local_world} (--pin-cpus)"


def _cpu_list(cpus: list[int]) -> str:
    """0-7 for consecutive CPUs, else 0,2,5."""
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def run(args) -> int:
    if launches_ranks(args):
        return _launch(args)
    environment = torchrun_environment()  # (rank, world, local rank) under torchrun, else None
    leader = environment is None or environment[0] == 0  # rank 0 (or the one process) speaks for the run
    ranked = environment is not None and environment[1] > 1  # torchrun with one process: a plain learner
    # rank 0's manifest and stream are every rank's (_start_or_resume): another machine's own (or none) is not
    # read; on rank 0's (RANK == LOCAL_RANK), the files are rank 0's, and its ranks refuse a stream as it does
    beside_rank_0 = not ranked or environment[0] == environment[2]
    group = args.group or default_group(args.topic, args.strategy)
    run_dir = args.run_dir or Path("runs") / f"{args.topic}-{group}"  # stable: the same command continues it
    try:
        manifest_path, manifest = _manifest(args, say=leader) if beside_rank_0 else (None, None)
        # on another machine, --params is not fitted here (rank 0's hidden size comes with its stream): without
        # the manifest, a word model's fit fails for want of its vocabulary, before the process group starts
        config = learn_config(args if beside_rank_0 else argparse.Namespace(**{**vars(args), "params": None}),
                              bootstrap=args.bootstrap_servers, topic=args.topic, group=group, run_dir=run_dir,
                              manifest=manifest, manifest_path=manifest_path, log=say if leader else silent)
    except UserError as exc:
        _refuse(exc, leader, beside_rank_0)  # the same flags and files as rank 0's on its machine
    from streamer.resume import RunDirBusy, RunDirLock  # torch: not imported for --help
    ranks = None
    if ranked:
        _refuse_for_ranks(config, environment[1], leader, stream=beside_rank_0)
        from streamer import distributed

        try:
            ranks = distributed.start(config.device)
        except ValueError as exc:  # this rank's own (a local rank without a GPU): each says its line
            raise UserError(str(exc)) from None
    try:
        with contextlib.ExitStack() as held:
            def lock() -> None:  # rank 0 (or the one process) holds the run directory
                try:
                    held.enter_context(RunDirLock(run_dir))
                except RunDirBusy as exc:
                    raise UserError(str(exc)) from None

            state, stream = _start_or_resume(config, args.fresh, ranks, lock, manifest)
            if not leader:
                config, manifest = _rank_0s_stream(config, stream), stream["manifest"]
            config = _resumed_settings(config, state, leader)
            from streamer.checkpoint import CheckpointError  # torch: imported only where a run starts
            from streamer.consumer import SourceError

            with _fresh_start(run_dir, manifest, args.fresh if leader else None) as before_run:
                try:
                    summary = run_with_report_on_interrupt(run_dir, lambda: asyncio.run(learn_under_view(
                        config, manifest=manifest, resume=state, from_beginning=args.fresh,
                        before_run=before_run)))
                except CheckpointError as exc:  # a checkpoint the strategy cannot load: one line
                    raise UserError(str(exc)) from None
                except OSError as exc:  # a full disk, a run directory turned read-only: one line, no traceback
                    if (line := storage_error(exc)) is None:
                        raise
                    raise UserError(f"{line}; once it can be written, the same command continues from the last "
                                    f"checkpoint in {run_dir}") from None
                except SourceError as exc:
                    if exc.every_rank and not leader:  # rank 0 says the same line
                        _leave_the_line_to_rank_0()
                    raise
                except RuntimeError as exc:
                    if ranks is None or not _a_peer_is_gone(exc):
                        raise
                    raise UserError(f"another rank is gone ({_last_words(exc)}): torchrun's agent ends the run; the "
                                    f"same command continues from the last checkpoint in {run_dir}") from None
    except BaseException:
        if ranks is not None:  # (distributed: imported where the ranks started)
            distributed.stop()
        raise
    status = rank_status(summary.stop_reason) if ranks is not None else 0
    try:
        if leader:
            print_run_report(summary, config.from_fragment)
    finally:
        if ranks is not None:  # rank 0's report is whole before any rank ends (see distributed.part)
            distributed.part(outlast_rank_0_s=10.0 if not leader and status == 2 else 0.0)
    if not leader:
        return status
    if summary.stop_reason == "broker_lost":  # checkpointed by the learner; exit 2 with one line
        learned = summary.batches_before + summary.batches
        lost = (f"topic {config.topic} was gone from {config.bootstrap_servers} (deleted)" if summary.topic_gone
                else f"Kafka at {config.bootstrap_servers} was lost")
        raise UserError(f"{lost} for {config.broker_timeout_s:g} s "
                        f"(--broker-timeout); the checkpoint at batch {learned} is in {run_dir}: "
                        "the same command continues the run")
    if summary.stop_reason == "log_changed":  # checkpointed by the learner; a restart refuses with the same line
        raise UserError(summary.stop_line or f"another rank found a partition of topic {config.topic} ending before "
                        "its offset there: the topic was re-created or truncated; start a new model with --fresh, "
                        "or give another --run-dir or --group")
    gc.freeze()  # the interpreter's exit then skips its last collection, about a second of torch's objects
    return status


def _a_peer_is_gone(exc: RuntimeError) -> bool:
    """Whether a collective failed because another rank died: torch.distributed's own errors, or gloo's
    transport (a RuntimeError naming gloo/transport: 'Connection closed by peer')."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or "gloo/transport" in str(exc)


def _last_words(exc: Exception) -> str:
    """The error's first line, less the C++ source location gloo puts before it."""
    from streamer.distributed import without_source_location

    return without_source_location(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def rank_status(stop_reason: str) -> int:
    """The exit status every rank of a distributed run ends with (they all stop at the same step, with
    the same reason): 0 for a run that ended as asked (the stream, --max-batches, --idle-timeout,
    --minutes), 2 for a lost broker or a log not the learner's (log_changed; rank 0 says the line), 143 for
    a stop by a signal, whichever rank received it. torchrun's agent waits up to 5 minutes at its exit
    barrier for the other machines' agents when its ranks exit 0, and returns at once when they fail: so a
    machine whose agent was killed (its ranks stopped by the parent-death signal, the others by the per-step
    agreement) does not keep the other machines waiting, and under `Restart=on-failure` they start again."""
    if stop_reason in ("broker_lost", "log_changed"):
        return 2
    return 128 + signal.SIGTERM if stop_reason == "signal" else 0


# Strategies whose state changes the model's shape or routing by what one rank sees: they cannot be
# one model across ranks.
NOT_DISTRIBUTED = {
    "adapters": "adds an adapter set per distribution its detector finds, which differs between ranks",
    "independent": "routes each batch to one model per ground-truth class, which differs between ranks' rows",
}


def _refusal(config: LearnConfig, world: int, stream: bool = True) -> str | None:
    """Why `config` cannot run as `world` ranks (one line), or None; with `stream` False, not asked of its
    streams (another rank than rank 0, whose stream is every rank's)."""
    if stream and config.streams % world:
        return (f"--streams {config.streams} is not divisible by {world} ranks (each rank learns streams / ranks "
                f"of them); use a multiple of {world}")
    if config.strategy in NOT_DISTRIBUTED:
        return f"strategy {config.strategy} {NOT_DISTRIBUTED[config.strategy]}: run it in one process"
    if config.model_name == "hf-classifier":
        return "the classifier's utterance batches are not split across ranks yet: run it in one process"
    return None


def _refuse_for_ranks(config: LearnConfig, world: int, leader: bool, stream: bool = True) -> None:
    """Rank 0 says why in one line (UserError), and so does a rank on another machine (`stream` False: not
    asked of the streams, rank 0's, which it learns by; its command line is its host's own); the other
    ranks on rank 0's machine refuse alike and leave the line to rank 0."""
    reason = _refusal(config, world, stream=stream)
    if reason is not None:
        _refuse(UserError(reason), leader, beside_rank_0=stream)


def _refuse(error: UserError, leader: bool, beside_rank_0: bool, wait_s: float = 10.0) -> NoReturn:
    """Refuse the run before the process group: `error` is raised (one line) by rank 0, by one process,
    by a rank on another machine (its command line is its host's own) and by a rank that torchrun's
    agent did not start. A rank of the agent on rank 0's machine refuses alike and leaves the line to
    rank 0: it waits (up to `wait_s`, then ends 2) for the SIGTERM that the agent sends once rank 0
    has ended, and ends as stopped by it (143: the agent's summary names rank 0 alone as failed).
    Ending first, it made the agent stop rank 0 before rank 0 said its line (1 of 8 tries gave no line
    at all), where each rank had said it."""
    if leader or not beside_rank_0 or not started_by_torchrun_agent():
        raise error
    _leave_the_line_to_rank_0(wait_s)


def _leave_the_line_to_rank_0(wait_s: float = 10.0) -> NoReturn:
    """A rank other than 0 whose run ends on rank 0's one line (a refusal, a source every rank lost): it
    waits, up to `wait_s`, for the SIGTERM torchrun's agent sends once rank 0 has ended, and ends by it;
    else with 2. Ending first with 2, it was the rank the launcher named as failed (2 of 5 tries of a
    1-rank checkpoint resumed with --nproc 2), though it had said nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    environment = torchrun_environment()
    beside_rank_0 = environment is not None and torchrun_local_world() == environment[1]  # one machine: its agent
    if started_by_torchrun_agent() and beside_rank_0:  # stops this rank once rank 0 ends (another host's may not)
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))  # not "SIGTERM before ..."
        time.sleep(wait_s)
    raise SystemExit(2)


def _launch(args) -> int:
    """--nproc N: torchrun's elastic agent starts N ranks of this same command on this machine."""
    manifest_path, manifest = _manifest(args, say=False)  # rank 0 says it
    group = args.group or default_group(args.topic, args.strategy)
    config = learn_config(args, bootstrap=args.bootstrap_servers, topic=args.topic, group=group,
                          run_dir=args.run_dir or Path("runs") / f"{args.topic}-{group}", manifest=manifest,
                          manifest_path=manifest_path, log=silent)  # the ranks' rank 0 says what it chose
    reason = _refusal(config, args.nproc)
    if reason is not None:
        if args.manifest is None and manifest_path is not None and args.streams is None and config.streams % args.nproc:
            _say_default_manifest(args.topic, manifest_path)  # the refused --streams is the manifest's
        raise UserError(f"--nproc {args.nproc}: {reason}")
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    command, split, threads = _without_nproc(args.argv), "", args.threads
    if args.threads is None and omp_num_threads() is None:  # else the user's count, in every rank, unpinned
        cpus = available_cpus()
        threads = rank_threads(cpus, args.nproc)
        command += ["--threads", str(threads)]
        if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
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


def _resumed_settings(config: LearnConfig, state: dict | None, leader: bool = True) -> LearnConfig:
    """A resumed run keeps the span it started with (its live CALM tracker counts from there), and its
    seed and drift detector (the checkpoint's random generators and detector state go on): each said in
    one line when the flags differ, and recorded as the run's (config.json, results.json said a --seed or
    --detector that was not used)."""
    from streamer.resume import kept_settings  # (torch: imported only where a run starts)

    kept = kept_settings((state or {}).get("config") or {}, config)  # which keys: streamer.resume's KEPT_KEYS
    for key, value in kept.items() if leader else ():
        flag, what = _KEPT_SAID[key]
        print(f"{flag}: the run continues with {what.format(value)} (not {getattr(config, key)}); "
              "--fresh starts over with the new one", flush=True)
    return dataclasses.replace(config, **kept) if kept else config


_KEPT_SAID = {"from_fragment": ("--from-fragment", "the span it started with, fragments >= {}"),
              "seed": ("--seed", "the seed it started with, {} (its random generators go on)"),
              "detector": ("--detector", "the drift detector it started with, {} (its state goes on)")}


def _start_or_resume(config: LearnConfig, fresh: bool, ranks=None, lock=lambda: None,
                     manifest: dict | None = None) -> tuple[dict | None, dict | None]:
    """(The checkpoint to continue (None: a fresh start), said in one line with the topic, group and run
    dir; with ranks, rank 0's stream for _rank_0s_stream). `lock()` takes the run directory first (rank
    0's). Ranks: rank 0 reads the checkpoint and sends it to the others (who may not see the run
    directory) with its `manifest` and what it decided of the stream. A refusal is rank 0's one line,
    the others exit quietly."""
    if ranks is None:
        lock()
        return _checkpoint_to_continue(config, fresh, 1), None
    from streamer import checkpoint

    payload, failure = None, None
    if ranks.leader:
        try:
            lock()
            payload = {"state": _checkpoint_to_continue(config, fresh, ranks.world), "stream": {
                "manifest": manifest, "streams": config.streams, "window": config.window,
                "from_fragment": config.from_fragment, "hidden": config.model.hidden}}
        except UserError as exc:
            payload, failure = {"error": str(exc)}, exc
    shared = checkpoint.from_bytes(ranks.broadcast_bytes(checkpoint.to_bytes(payload) if ranks.leader else None))
    if failure is not None:
        raise failure
    if "error" in shared:
        _leave_the_line_to_rank_0()
    return shared["state"], shared["stream"]


def _rank_0s_stream(config: LearnConfig, stream: dict) -> LearnConfig:
    """`config` with rank 0's stream: its manifest (what produce wrote on its host, --manifest or the
    cache's), streams and window, span and hidden size (--params fits it to the manifest). Each host had
    its own: one without produce's manifest took the default window, one with a stale one refused a
    flag that contradicted it, and the ranks' collectives parted (a hang with no line)."""
    return dataclasses.replace(
        config.with_manifest(stream["manifest"]), streams=stream["streams"], window=stream["window"],
        from_fragment=stream["from_fragment"], model=dataclasses.replace(config.model, hidden=stream["hidden"]))


@contextlib.contextmanager
def _fresh_start(run_dir: Path, manifest: dict | None, fresh: bool | None):
    """The learner's `before_run` (None off rank 0): once the model is built (a flag it refuses leaves the
    old run where it was), --fresh moves the old run's files aside, then the run's copy of its manifest is
    written. A run that fails before its first checkpoint (an unreachable broker, a busy port) puts the
    old run back: it had moved for a run that never began."""
    from streamer.resume import put_back, set_aside

    moved = []

    def before_run() -> None:
        with signals_deferred():  # (a Ctrl-C amid the move left the old run split, and nothing to put back)
            if fresh and (aside := set_aside(run_dir)):
                moved.append(aside)
                unwind_on_sigterm("--fresh's old run, moved aside")
                print(f"--fresh: the old run moved to {aside}", flush=True)
        if manifest is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    try:
        yield None if fresh is None else before_run
    except BaseException:
        if moved and not (run_dir / "checkpoint.pt").exists():
            with signals_deferred():  # a second Ctrl-C waits for the old run to be whole again
                put_back(run_dir, moved[0])
                print("--fresh: the new run ended before its first checkpoint; the old run is back in "
                      f"{run_dir.resolve()}", flush=True)
        raise


def _checkpoint_to_continue(config: LearnConfig, fresh: bool, world: int) -> dict | None:
    from streamer.resume import check_set_aside, resume_state

    where = f"topic {config.topic}, group {config.group_id}, run dir {config.run_dir}"
    if fresh:  # the old run's files move once the model is built (_fresh_start): a bad flag keeps them
        try:
            check_set_aside(config.run_dir)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        print(f"{where}: starting fresh (--fresh)", flush=True)
        return None
    try:
        state = resume_state(config.run_dir, config)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    saved = world if state is None else state.get("world_size", 1)
    if saved != world:
        raise UserError(f"{config.run_dir} holds the checkpoint of a run of {saved} rank(s); continue it with "
                        f"--nproc {saved} (or torchrun --nproc-per-node {saved}), or start over with --fresh")
    if state is None:
        print(f"{where}: no checkpoint yet; a new run reads the topic from its beginning (where the group has "
              "committed no offsets: those are another model's)", flush=True)
    else:
        print(f"{where}: resuming from the checkpoint at batch {state['step']} "
              f"(offsets {', '.join(f'{tp}={offset}' for tp, offset in sorted(state['offsets'].items()))})", flush=True)
    return state
