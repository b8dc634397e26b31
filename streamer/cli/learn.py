"""`streamer learn`: consume a topic and learn prequentially under the live view."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

from streamer.cli.configs import learn_config
from streamer.cli.errors import UserError
from streamer.cli.flags import add_model_flags, add_run_flags, default_of, positive_float, positive_int
from streamer.cli.report import print_run_report
from streamer.cli.runs import learn_under_view, run_with_report_on_interrupt
from streamer.config import LearnConfig, default_group

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("learn", help="consume a topic and learn prequentially")
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092", help="Kafka address (default %(default)s)")
    p.add_argument("--topic", default="streamer", help="the topic to learn from (default %(default)s)")
    p.add_argument("--group", help=f"consumer group id (default {default_group('<topic>', '<strategy>')}: two "
                                   "learners of one topic never share offsets by accident)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: move the run directory's old files aside and read the topic from its "
                        "beginning (default: continue the run from its checkpoint, when it has one; the run "
                        "directory defaults to runs/<topic>-<group>)")
    p.add_argument("--manifest", type=Path, help="the producer's manifest: total batches, classes, N")
    p.add_argument("--streams", type=positive_int, default=default_of(LearnConfig, "streams"),
                   help="b: parallel streams (default %(default)s)")
    p.add_argument("--window", type=positive_int, default=default_of(LearnConfig, "window"),
                   help="w: tokens per window (default %(default)s)")
    p.add_argument("--seed", type=int, default=default_of(LearnConfig, "seed"),
                   help="seed of the model and the strategy (default %(default)s)")
    p.add_argument("--idle-timeout", type=positive_float,
                   help="stop after this many seconds without records (default: wait forever)")
    add_model_flags(p)
    add_run_flags(p, run_dir_default="runs/<topic>-<group>: the same command continues the same run")


def run(args) -> int:
    manifest = None
    if args.manifest:
        try:
            manifest = json.loads(args.manifest.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read manifest {args.manifest}: {exc}") from None
    from streamer.resume import RunDirBusy, RunDirLock  # torch: not imported for --help

    group = args.group or default_group(args.topic, args.strategy)
    run_dir = args.run_dir or Path("runs") / f"{args.topic}-{group}"  # stable: the same command continues it
    config = learn_config(args, bootstrap=args.bootstrap_servers, topic=args.topic, group=group,
                          run_dir=run_dir, manifest=manifest)
    try:
        with RunDirLock(run_dir):
            state = _start_or_resume(config, args.fresh)
            if manifest is not None:
                (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
            summary = run_with_report_on_interrupt(run_dir, lambda: asyncio.run(learn_under_view(
                config, manifest=manifest, resume=state, from_beginning=args.fresh)))
    except RunDirBusy as exc:
        raise UserError(str(exc)) from None
    print_run_report(summary)
    gc.freeze()  # the interpreter's exit then skips its last collection, about a second of torch's objects
    return 0


def _start_or_resume(config: LearnConfig, fresh: bool) -> dict | None:
    """The checkpoint to continue (None: a fresh start), said in one line with the topic, group and run dir."""
    from streamer.resume import resume_state, set_aside

    where = f"topic {config.topic}, group {config.group_id}, run dir {config.run_dir}"
    if fresh:
        aside = set_aside(config.run_dir)
        print(f"{where}: starting fresh (--fresh" + (f"; the old run moved to {aside})" if aside else ")"), flush=True)
        return None
    try:
        state = resume_state(config.run_dir, config)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if state is None:
        print(f"{where}: starting fresh (no checkpoint yet)", flush=True)
    else:
        print(f"{where}: resuming from the checkpoint at batch {state['step']} "
              f"(offsets {', '.join(f'{tp}={offset}' for tp, offset in sorted(state['offsets'].items()))})", flush=True)
    return state
