"""`streamer learn`: consume a topic and learn prequentially under the live view."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from streamer.cli.configs import learn_config
from streamer.cli.errors import UserError
from streamer.cli.flags import add_model_flags, add_run_flags, default_of, positive_float, positive_int
from streamer.cli.report import print_run_report
from streamer.cli.runs import default_run_dir, learn_under_view, run_with_report_on_interrupt, sigterm_as_interrupt
from streamer.config import LearnConfig

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("learn", help="consume a topic and learn prequentially")
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092", help="Kafka address (default %(default)s)")
    p.add_argument("--topic", default="streamer", help="the topic to learn from (default %(default)s)")
    p.add_argument("--group", default=default_of(LearnConfig, "group_id"),
                   help="consumer group id (default %(default)s)")
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
    add_run_flags(p)


def run(args) -> int:
    sigterm_as_interrupt()
    manifest = None
    if args.manifest:
        try:
            manifest = json.loads(args.manifest.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read manifest {args.manifest}: {exc}") from None
    run_dir = args.run_dir or default_run_dir(args.strategy)
    config = learn_config(args, bootstrap=args.bootstrap_servers, topic=args.topic, group=args.group,
                          run_dir=run_dir, manifest=manifest)
    if manifest is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    summary = run_with_report_on_interrupt(run_dir, lambda: asyncio.run(learn_under_view(config, manifest=manifest)))
    print_run_report(summary)
    return 0
