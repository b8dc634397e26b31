"""`streamer demo`: broker, producer, learner, exporter and live view, then a report."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from producers.stream import produce_stream
from streamer.broker import EmbeddedBroker
from streamer.cli.configs import learn_config, schedule, stream_options
from streamer.cli.flags import CACHE_HELP, DEFAULT_CORPUS, add_model_flags, add_run_flags, add_stream_flags
from streamer.cli.security_flags import add_metrics_security_flags, add_security_flags, client_options
from streamer.cli.report import print_run_report
from streamer.cli.runs import (default_run_dir, ensure_corpus, learn_under_view, prepare_and_say,
                               run_with_report_on_interrupt, sigterm_as_interrupt)

__all__ = ["DEMO_DEFAULTS", "add_parser", "run"]

# The demo's own defaults, shorter than the flags' (shown by `streamer demo --help`). No time limit: the demo
# always reaches its headline table (40 fragments: about 1,900 batches, 1.5 to 4 minutes on 2 busy cores).
DEMO_DEFAULTS = {"fragments": 40, "mean_tokens": 10_000, "minutes": None, "metrics_port": 0}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="broker, producer, learner, exporter and live view on a real multilingual corpus")
    p.add_argument("--bootstrap-servers", metavar="HOST:PORT",
                   help="use this Kafka instead of the embedded broker (default: the embedded broker on a free port)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="a corpus name (built on first use) or a path of your own data (default %(default)s)")
    p.add_argument("--cache", type=Path, help=CACHE_HELP)
    add_stream_flags(p)
    add_model_flags(p)
    add_security_flags(p)
    add_metrics_security_flags(p)
    add_run_flags(p, minutes=DEMO_DEFAULTS["minutes"], metrics_port=DEMO_DEFAULTS["metrics_port"])
    p.set_defaults(**DEMO_DEFAULTS)


def run(args) -> int:
    sigterm_as_interrupt()
    corpus = ensure_corpus(args.corpus, args.cache)
    run_dir = args.run_dir or default_run_dir(args.strategy)
    if args.run_dir is None:
        print(f"run directory: {run_dir} (new; --run-dir to choose)", flush=True)
    manifest_path = run_dir / "manifest.json"
    records, manifest = prepare_and_say(corpus, schedule(args), manifest_path,
                                        log=lambda note: print(note, flush=True), **stream_options(args))
    print(f"stream: {manifest['n_fragments']} fragments of {', '.join(manifest['classes'])}, "
          f"{manifest['total_batches']} batches of {args.streams}x{args.window} bytes"
          + (f"; stops after {args.minutes:g} min (--minutes)" if args.minutes else ""), flush=True)
    topic = f"demo-{int(time.time())}"
    spans = []

    def learn(bootstrap: str):
        config = learn_config(args, bootstrap=bootstrap, topic=topic, group=f"{topic}-learner",
                              run_dir=run_dir, manifest=manifest)
        spans.append(config.from_fragment)
        print(f"topic {topic} on {bootstrap} (new), learned by group {topic}-learner", flush=True)

        def producer():
            return produce_stream(records, bootstrap, topic, client_options=client_options(config.kafka_security),
                                  broker_timeout_s=config.broker_timeout_s, log=lambda line: print(line, flush=True))

        return asyncio.run(learn_under_view(config, manifest=manifest, producer=producer))

    def learn_somewhere():
        if args.bootstrap_servers:
            return learn(args.bootstrap_servers)
        with EmbeddedBroker() as broker:
            print(f"embedded broker on {broker.bootstrap_servers}", flush=True)
            return learn(broker.bootstrap_servers)

    summary = run_with_report_on_interrupt(run_dir, learn_somewhere)
    print_run_report(summary, spans[-1])
    return 0
