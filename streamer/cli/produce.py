"""`streamer produce`: replay a corpus as a CALM stream into a Kafka topic."""

from __future__ import annotations

import asyncio
from pathlib import Path

from streamer.cli.configs import schedule, stream_options
from streamer.cli.flags import add_stream_flags, positive_float, positive_int
from streamer.cli.runs import corpus_dir

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("produce", help="replay a corpus as a CALM stream into a Kafka topic")
    p.add_argument("--corpus", default="calm-multilingual",
                   help="a built corpus name or a directory with one .txt per class (default %(default)s)")
    p.add_argument("--cache", type=Path, help="corpus cache directory (default $STREAMER_CACHE or ~/.cache/streamer)")
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092", help="Kafka address (default %(default)s)")
    p.add_argument("--topic", default="streamer", help="the topic to write (default %(default)s)")
    p.add_argument("--partitions", type=positive_int, default=1,
                   help="partitions of the topic when it is created (default %(default)s)")
    p.add_argument("--rate", type=positive_float, help="records per second (default: as fast as possible)")
    p.add_argument("--token-rate", type=positive_float, help="bytes of text per second (default: no limit)")
    p.add_argument("--realtime-factor", type=positive_float, default=1.0,
                   help="speed of the replay relative to --rate / --token-rate (2 = twice as fast; default 1)")
    p.add_argument("--loop", action="store_true", help="replay forever (positions and fragments continue), for a daemon")
    p.add_argument("--no-truth-topic", action="store_true",
                   help="do not announce fragments on the <topic>.truth sidecar topic")
    p.add_argument("--manifest", type=Path, help="ground-truth manifest path (default <topic>.manifest.json)")
    add_stream_flags(p)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from producers.stream import looped, prepare_stream, produce_stream

    corpus = corpus_dir(args.corpus, args.cache)
    manifest_path = args.manifest or Path(f"{args.topic}.manifest.json")
    records, manifest = prepare_stream(corpus, schedule(args), manifest_path, **stream_options(args))
    print(f"stream: {manifest['n_fragments']} fragments, {manifest['total_batches']} batches, "
          f"{len(records)} records; manifest {manifest_path}", flush=True)
    console = Console()
    stream = looped(records, manifest) if args.loop else records
    with Progress(TextColumn("producing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[mb]:.2f} MB"),
                  console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("produce", total=None if args.loop else len(records), mb=0.0)
        sent = asyncio.run(produce_stream(
            stream, args.bootstrap_servers, args.topic,
            rate=args.rate and args.rate * args.realtime_factor,
            token_rate=args.token_rate and args.token_rate * args.realtime_factor,
            partitions=args.partitions, truth_topic=not args.no_truth_topic,
            progress=lambda n, b: progress.update(task, completed=n, mb=b / 1e6)))
    print(f"sent {sent} records to {args.topic} at {args.bootstrap_servers}")
    return 0
