"""`streamer learn`: consume a topic and learn prequentially under the live view."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
from pathlib import Path

from streamer.cli.configs import learn_config, say, silent
from streamer.cli.errors import UserError, storage_error
from streamer.cli.flags import (DEFAULT_BOOTSTRAP, DEFAULT_TOPIC, add_model_flags, add_run_flags, default_of,
                                positive_float, positive_int)
from streamer.cli.launch import launches_ranks, start_ranks
from streamer.cli.ranks import (a_peer_is_gone, last_words, leave_the_line_to_rank_0, rank_status, refusal, refuse,
                                refuse_for_ranks)
from streamer.cli.report import print_run_report
from streamer.cli.security_flags import add_metrics_security_flags, add_security_flags
from streamer.cli.runs import (default_manifest_path, learn_under_view, run_with_report_on_interrupt, signals_deferred,
                                unwind_on_sigterm)
from streamer.config import LearnConfig, default_group
from streamer.source import CODEC_CURE
from streamer.settings import torchrun_environment

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
                        "beginning (default: continue the run from its checkpoint, when it has one, else set an "
                        "old run's loss log aside all the same, unless its learner stopped before a first "
                        "checkpoint; the run directory defaults to runs/<topic>-<group>; a run without a "
                        "checkpoint is refused in a group that has committed offsets: they belong to a model "
                        "elsewhere)")
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
        refuse(exc, leader, beside_rank_0)  # the same flags and files as rank 0's on its machine
    from streamer.resume import RunDirBusy, RunDirLock  # torch: not imported for --help
    ranks = None
    if ranked:
        refuse_for_ranks(config, environment[1], leader, stream=beside_rank_0)
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

            state, stream, old = _start_or_resume(config, args.fresh, ranks, lock, manifest)
            if not leader:
                config, manifest = _rank_0s_stream(config, stream), stream["manifest"]
            config = _resumed_settings(config, state, leader)
            with _fresh_start(run_dir, manifest, args.fresh if leader else None, old=old) as before_run:
                summary = _learn(config, run_dir, manifest, state, args.fresh, before_run, leader=leader,
                                 ranked=ranks is not None)
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
    if (line := _stopped_line(summary, config, run_dir)) is not None:  # checkpointed by the learner: one line, exit 2
        raise UserError(line)
    gc.freeze()  # the interpreter's exit then skips its last collection, about a second of torch's objects
    return status


def _learn(config, run_dir: Path, manifest, state, fresh: bool, before_run, *, leader: bool, ranked: bool):
    """The run itself, under the live view; a stop that the checkpoint survives (a full disk, a checkpoint the
    strategy cannot load, a rank gone) is one line. Returns the learner's summary."""
    from streamer.checkpoint import CheckpointError  # torch: imported only where a run starts
    from streamer.source import SourceError

    try:
        return run_with_report_on_interrupt(run_dir, lambda: asyncio.run(learn_under_view(
            config, manifest=manifest, resume=state, from_beginning=fresh, before_run=before_run)))
    except CheckpointError as exc:  # a checkpoint the strategy cannot load: one line
        raise UserError(str(exc)) from None
    except OSError as exc:  # a full disk, a run directory turned read-only: one line, no traceback
        if (line := storage_error(exc)) is None:
            raise
        raise UserError(f"{line}; once it can be written, the same command continues from the last "
                        f"checkpoint in {run_dir}") from None
    except SourceError as exc:
        if exc.every_rank and not leader:  # rank 0 says the same line
            leave_the_line_to_rank_0()
        raise
    except RuntimeError as exc:
        if not ranked or not a_peer_is_gone(exc):
            raise
        raise UserError(f"another rank is gone ({last_words(exc)}): torchrun's agent ends the run; the "
                        f"same command continues from the last checkpoint in {run_dir}") from None


def _stopped_line(summary, config, run_dir: Path) -> str | None:
    """The line of a run that stopped for want of its log (the broker or topic gone past --broker-timeout, the log
    changed under it, records it cannot decompress), each checkpointed by the learner; None for every other
    stop. The source's own line, or (another rank's source found it) one naming the cause."""
    if summary.stop_reason == "broker_lost":
        learned = summary.batches_before + summary.batches
        lost = (f"topic {config.topic} was gone from {config.bootstrap_servers} (deleted)" if summary.topic_gone
                else f"Kafka at {config.bootstrap_servers} was lost")
        return (f"{lost} for {config.broker_timeout_s:g} s (--broker-timeout); the checkpoint at batch {learned} is "
                f"in {run_dir}: the same command continues the run")
    if summary.stop_reason == "log_changed":  # a restart refuses with the same line
        return summary.stop_line or (f"another rank found a partition of topic {config.topic} ending before its "
                                     "offset there: the topic was re-created or truncated; start a new model with "
                                     "--fresh, or give another --run-dir or --group")
    if summary.stop_reason == "codec_missing":
        return summary.stop_line or (f"another rank found records of topic {config.topic} compressed with a codec "
                                     f"this installation cannot decompress; {CODEC_CURE}")
    return None


def _launch(args) -> int:
    """--nproc N: torchrun's elastic agent starts N ranks of this same command on this machine."""
    manifest_path, manifest = _manifest(args, say=False)  # rank 0 says it
    group = args.group or default_group(args.topic, args.strategy)
    config = learn_config(args, bootstrap=args.bootstrap_servers, topic=args.topic, group=group,
                          run_dir=args.run_dir or Path("runs") / f"{args.topic}-{group}", manifest=manifest,
                          manifest_path=manifest_path, log=silent)  # the ranks' rank 0 says what it chose
    reason = refusal(config, args.nproc)
    if reason is not None:
        if args.manifest is None and manifest_path is not None and args.streams is None and config.streams % args.nproc:
            _say_default_manifest(args.topic, manifest_path)  # the refused --streams is the manifest's
        raise UserError(f"--nproc {args.nproc}: {reason}")
    return start_ranks(args, config.device)


def _resumed_settings(config: LearnConfig, state: dict | None, leader: bool = True) -> LearnConfig:
    """A resumed run keeps the span it started with (its live CALM tracker counts from there), and its
    seed and drift detector (the checkpoint's random generators and detector state go on): each said in
    one line when the flags differ, and recorded as the run's (config.json, results.json said a --seed or
    --detector that was not used)."""
    from streamer.checkpoint import CheckpointView  # (torch: imported only where a run starts)
    from streamer.resume import kept_settings

    saved = CheckpointView(state).config if state else {}
    kept = kept_settings(saved, config)  # which keys: streamer.resume's KEPT_KEYS
    for key, value in kept.items() if leader else ():
        flag, what = _KEPT_SAID[key]
        print(f"{flag}: the run continues with {what.format(value)} (not {getattr(config, key)}); "
              "--fresh starts over with the new one", flush=True)
    return dataclasses.replace(config, **kept) if kept else config


_KEPT_SAID = {"from_fragment": ("--from-fragment", "the span it started with, fragments >= {}"),
              "seed": ("--seed", "the seed it started with, {} (its random generators go on)"),
              "detector": ("--detector", "the drift detector it started with, {} (its state goes on)")}


def _start_or_resume(config: LearnConfig, fresh: bool, ranks=None, lock=lambda: None,
                     manifest: dict | None = None) -> tuple[dict | None, dict | None, str | None]:
    """(The checkpoint to continue (None: a fresh start), said in one line with the topic, group and run
    dir; with ranks, rank 0's stream for _rank_0s_stream; on rank 0, the old run's files that a new run sets
    aside, in words (_checkpoint_to_continue)). `lock()` takes the run directory first (rank 0's). Ranks:
    rank 0 reads the checkpoint and sends it to the others (who may not see the run directory) with its
    `manifest` and what it decided of the stream. A refusal is rank 0's one line, the others exit quietly."""
    if ranks is None:
        lock()
        state, old = _checkpoint_to_continue(config, fresh, 1)
        return state, None, old
    from streamer import checkpoint

    payload, failure, old = None, None, None
    if ranks.leader:
        try:
            lock()
            state, old = _checkpoint_to_continue(config, fresh, ranks.world)
            payload = {"state": state, "stream": {
                "manifest": manifest, "streams": config.streams, "window": config.window,
                "from_fragment": config.from_fragment, "hidden": config.model.hidden}}
        except UserError as exc:
            payload, failure = {"error": str(exc)}, exc
    shared = checkpoint.from_bytes(ranks.broadcast_bytes(checkpoint.to_bytes(payload) if ranks.leader else None))
    if failure is not None:
        raise failure
    if "error" in shared:
        leave_the_line_to_rank_0()
    return shared["state"], shared["stream"], old


def _rank_0s_stream(config: LearnConfig, stream: dict) -> LearnConfig:
    """`config` with rank 0's stream: its manifest (what produce wrote on its host, --manifest or the
    cache's), streams and window, span and hidden size (--params fits it to the manifest). Each host had
    its own: one without produce's manifest took the default window, one with a stale one refused a
    flag that contradicted it, and the ranks' collectives parted (a hang with no line)."""
    return dataclasses.replace(
        config.with_manifest(stream["manifest"]), streams=stream["streams"], window=stream["window"],
        from_fragment=stream["from_fragment"], model=dataclasses.replace(config.model, hidden=stream["hidden"]))


@contextlib.contextmanager
def _fresh_start(run_dir: Path, manifest: dict | None, fresh: bool | None, old: str | None = None):
    """The learner's `before_run` (None off rank 0): once the model is built (a flag it refuses leaves the
    old run where it was), --fresh moves the old run's files aside, as does a new run where the run
    directory holds an old run's history without its checkpoint (`old`, its words: the new run would write
    over it), then the run's copy of its manifest is written. A run that fails before its first checkpoint
    (an unreachable broker, a busy port, a group with another model's offsets) puts the old run back: it
    had moved for a run that never began."""
    from streamer.resume import put_back, set_aside

    moved = []

    def before_run() -> None:
        with signals_deferred():  # (a Ctrl-C amid the move left the old run split, and nothing to put back)
            if (fresh or old) and (aside := set_aside(run_dir)):
                moved.append(aside)
                unwind_on_sigterm("--fresh's old run, moved aside" if fresh else "the old run, moved aside")
                print(f"--fresh: the old run moved to {aside}" if fresh else
                      f"run dir {run_dir} holds {old} but no checkpoint: its files moved to {aside}; a new run "
                      "starts", flush=True)
        if manifest is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    try:
        yield None if fresh is None else before_run
    except BaseException:
        if moved and not (run_dir / "checkpoint.pt").exists():
            with signals_deferred():  # a second Ctrl-C waits for the old run to be whole again
                put_back(run_dir, moved[0])
                print(f"{'--fresh: ' if fresh else ''}the new run ended before its first checkpoint; the old run "
                      f"is back in {run_dir.resolve()}", flush=True)
        raise


def _checkpoint_to_continue(config: LearnConfig, fresh: bool, world: int) -> tuple[dict | None, str | None]:
    """(The run dir's checkpoint to continue, or None; without one, the old run's files that the new run sets
    aside (as --fresh does, _fresh_start), in words, or None: a run whose checkpoint was removed or lost had
    its whole history overwritten by the new run's, silently. The files of this same run whose learner
    stopped before its first checkpoint are not an old run's: its restart logs the same batches again.)"""
    from streamer.checkpoint import CheckpointView
    from streamer.resume import check_set_aside, old_run_without_checkpoint, resume_state

    where = f"topic {config.topic}, group {config.group_id}, run dir {config.run_dir}"
    if fresh:  # the old run's files move once the model is built (_fresh_start): a bad flag keeps them
        try:
            check_set_aside(config.run_dir)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        print(f"{where}: starting fresh (--fresh)", flush=True)
        return None, None
    try:
        state = resume_state(config.run_dir, config)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    saved = world if state is None else CheckpointView(state).world_size
    if saved != world:
        raise UserError(f"{config.run_dir} holds the checkpoint of a run of {saved} rank(s); continue it with "
                        f"--nproc {saved} (or torchrun --nproc-per-node {saved}), or start over with --fresh")
    if state is not None:
        resumed = CheckpointView(state)
        print(f"{where}: resuming from the checkpoint at batch {resumed.step} "
              f"(offsets {', '.join(f'{tp}={offset}' for tp, offset in sorted(resumed.offsets.items()))})", flush=True)
        return state, None
    old, own = old_run_without_checkpoint(config.run_dir, config)
    if old is None or own:
        again = f" (its learner stopped before its first checkpoint; {old} is logged again)" if old else ""
        print(f"{where}: no checkpoint yet{again}; a new run reads the topic from its beginning (where the group "
              "has committed no offsets: those are another model's)", flush=True)
        return None, None
    try:  # refused before the model is built: a directory not a run's keeps its files
        check_set_aside(config.run_dir, why=f"no checkpoint, and a new run would write over {old}")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(f"{where}: no checkpoint, but {old} of an earlier run, which a new run would write over: its files move "
          "aside, and a new run reads the topic from its beginning (where the group has committed no offsets)",
          flush=True)
    return None, old
