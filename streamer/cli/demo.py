"""`streamer demo`: broker, producer, learner, exporter and live view, then a report."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from producers.stream import prepare_stream, produce_stream
from streamer.broker import EmbeddedBroker
from streamer.cli.configs import learn_config, schedule, stream_options
from streamer.cli.flags import add_model_flags, add_run_flags, add_stream_flags
from streamer.cli.report import print_run_report
from streamer.cli.runs import (default_run_dir, ensure_corpus, learn_under_view, run_with_report_on_interrupt,
                               sigterm_as_interrupt)

__all__ = ["DEMO_DEFAULTS", "add_parser", "run"]

# The demo's own defaults, shorter than the flags' (shown by `streamer demo --help`).
DEMO_DEFAULTS = {"fragments": 40, "mean_tokens": 10_000, "minutes": 3.0, "metrics_port": 0}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="broker, producer, learner, exporter and live view on a real multilingual corpus")
    p.add_argument("--bootstrap-servers", help="use this Kafka instead of the embedded broker")
    p.add_argument("--corpus", default="calm-multilingual",
                   help="a corpus name (built on first use) or a path of your own data (default %(default)s)")
    p.add_argument("--cache", type=Path, help="corpus cache directory (default $STREAMER_CACHE or ~/.cache/streamer)")
    add_stream_flags(p)
    add_model_flags(p)
    add_run_flags(p, minutes=DEMO_DEFAULTS["minutes"], metrics_port=DEMO_DEFAULTS["metrics_port"])
    p.set_defaults(**DEMO_DEFAULTS)


def run(args) -> int:
    sigterm_as_interrupt()
    corpus = ensure_corpus(args.corpus, args.cache)
    run_dir = args.run_dir or default_run_dir(args.strategy)
    manifest_path = run_dir / "manifest.json"
    records, manifest = prepare_stream(corpus, schedule(args), manifest_path, **stream_options(args))
    print(f"stream: {manifest['n_fragments']} fragments of {', '.join(manifest['classes'])}, "
          f"{manifest['total_batches']} batches of {args.streams}x{args.window} bytes", flush=True)
    topic = f"demo-{int(time.time())}"

    def learn(bootstrap: str):
        config = learn_config(args, bootstrap=bootstrap, topic=topic, group=f"{topic}-learner",
                              run_dir=run_dir, manifest=manifest)

        def producer():
            return produce_stream(records, bootstrap, topic)

        return asyncio.run(learn_under_view(config, manifest=manifest, producer=producer))

    def learn_somewhere():
        if args.bootstrap_servers:
            return learn(args.bootstrap_servers)
        with EmbeddedBroker() as broker:
            print(f"embedded broker on {broker.bootstrap_servers}", flush=True)
            return learn(broker.bootstrap_servers)

    summary = run_with_report_on_interrupt(run_dir, learn_somewhere)
    print_run_report(summary)
    return 0
