"""`streamer learn`: consume a topic and learn prequentially under the live view."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
from pathlib import Path

from streamer.cli.configs import learn_config
from streamer.cli.errors import UserError
from streamer.cli.flags import (DEFAULT_BOOTSTRAP, DEFAULT_TOPIC, add_model_flags, add_run_flags, default_of,
                                positive_float, positive_int)
from streamer.cli.report import print_run_report
from streamer.cli.security_flags import add_metrics_security_flags, add_security_flags
from streamer.cli.runs import default_manifest_path, learn_under_view, run_with_report_on_interrupt
from streamer.config import LearnConfig, default_group

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
                        "directory defaults to runs/<topic>-<group>)")
    p.add_argument("--manifest", type=Path,
                   help="the producer's manifest: total batches, classes, N, streams and window (default: "
                        f"{default_manifest_path('<topic>')} when `streamer produce` wrote it there)")
    p.add_argument("--streams", type=positive_int,
                   help=f"b: parallel streams (default: the manifest's, else {default_of(LearnConfig, 'streams')})")
    p.add_argument("--window", type=positive_int,
                   help=f"w: tokens (bytes) per window (default: the manifest's, else {default_of(LearnConfig, 'window')})")
    p.add_argument("--seed", type=int, default=default_of(LearnConfig, "seed"),
                   help="seed of the model and the strategy (default %(default)s)")
    p.add_argument("--idle-timeout", type=positive_float,
                   help="stop after this many seconds without records (default: wait forever, as a daemon)")
    add_model_flags(p)
    add_security_flags(p)
    add_metrics_security_flags(p)
    add_run_flags(p, run_dir_default="runs/<topic>-<group>: the same command continues the same run")


def _manifest(args) -> tuple[Path | None, dict | None]:
    """--manifest, else produce's default manifest of the topic when it exists (said in one line)."""
    path = args.manifest
    if path is None:
        path = default_manifest_path(args.topic)
        if not path.is_file():
            return None, None
        print(f"manifest: {path} (produce's for topic {args.topic}; --manifest to choose another)", flush=True)
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--manifest {path}: cannot read it ({exc})") from None


def run(args) -> int:
    manifest_path, manifest = _manifest(args)
    from streamer.resume import RunDirBusy, RunDirLock  # torch: not imported for --help

    group = args.group or default_group(args.topic, args.strategy)
    run_dir = args.run_dir or Path("runs") / f"{args.topic}-{group}"  # stable: the same command continues it
    config = learn_config(args, bootstrap=args.bootstrap_servers, topic=args.topic, group=group,
                          run_dir=run_dir, manifest=manifest, manifest_path=manifest_path)
    try:
        with RunDirLock(run_dir):
            state = _start_or_resume(config, args.fresh)
            config = _resumed_span(config, state)
            if manifest is not None:
                (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
            summary = run_with_report_on_interrupt(run_dir, lambda: asyncio.run(learn_under_view(
                config, manifest=manifest, resume=state, from_beginning=args.fresh)))
    except RunDirBusy as exc:
        raise UserError(str(exc)) from None
    print_run_report(summary, config.from_fragment)
    if summary.stop_reason == "broker_lost":  # checkpointed by the learner; exit 2 with one line
        raise UserError(f"Kafka at {config.bootstrap_servers} was lost for {config.broker_timeout_s:g} s "
                        f"(--broker-timeout); the checkpoint at batch {summary.batches} is in {run_dir}: "
                        "the same command continues the run")
    gc.freeze()  # the interpreter's exit then skips its last collection, about a second of torch's objects
    return 0


def _resumed_span(config: LearnConfig, state: dict | None) -> LearnConfig:
    """A resumed run keeps the span it started with (its live CALM tracker counts from there), said in one line."""
    saved = ((state or {}).get("config") or {}).get("from_fragment")
    if saved is None or saved == config.from_fragment:
        return config
    print(f"--from-fragment: the run continues with the span it started with, fragments >= {saved} "
          f"(not {config.from_fragment}); --fresh starts over with the new one", flush=True)
    return dataclasses.replace(config, from_fragment=saved)


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
