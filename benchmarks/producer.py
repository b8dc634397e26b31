"""Producer throughput into the embedded broker: records/s and MB/s, beside the cost of
building the stream in memory (schedule + records) measured in the same run.

    .venv/bin/python benchmarks/producer.py [--fragments 40] [--lambda 10000]

The produce time runs from the first record taken to the last one acknowledged: the topics are
created and the client started before it (they cost the same for any stream length).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.command import ended_by_signals  # noqa: E402
from producers.corpora import CorpusError, corpus_path, load_corpus_dir  # noqa: E402
from producers.schedule import Schedule, build_stream  # noqa: E402
from producers.stream import produce_stream  # noqa: E402
from streamer.broker import EmbeddedBroker  # noqa: E402
from streamer.cli.flags import Parser, positive_int  # noqa: E402
from streamer.settings import cache_root  # noqa: E402


def corpus() -> tuple[str, dict[str, str]]:
    try:
        return "calm-multilingual", load_corpus_dir(corpus_path("calm-multilingual", cache_root()))
    except CorpusError:
        from tests.conftest import write_corpus

        with tempfile.TemporaryDirectory() as scratch:  # (read whole: the files can go)
            return "synthetic", load_corpus_dir(write_corpus(Path(scratch) / "c", lines=4000))


def timed(records, started: list[float]):
    """The records, noting when the first is taken: produce_stream takes it once its topics exist and its
    client has started, so neither counts in the time."""
    for record in records:
        if not started:
            started.append(time.perf_counter())
        yield record


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fragments", type=positive_int, default=40)
    parser.add_argument("--lambda", dest="mean_tokens", type=positive_int, default=10_000)
    args = parser.parse_args()
    with ended_by_signals("producer"):
        measure(args)


def measure(args) -> None:
    name, text = corpus()
    started = time.perf_counter()
    records, manifest = build_stream(text, Schedule(n_fragments=args.fragments, mean_tokens=args.mean_tokens))
    built = time.perf_counter() - started
    size = sum(len(r.text.encode("utf-8")) for r in records)
    with EmbeddedBroker() as broker:
        first: list[float] = []
        asyncio.run(produce_stream(timed(records, first), broker.bootstrap_servers, "bench-producer"))
        sent = time.perf_counter() - first[0]
    print(f"corpus {name}: {len(records):,} records, {size / 1e6:.2f} MB of text, {manifest['total_batches']} batches")
    print(f"build stream in memory: {built:6.2f} s  ({len(records) / built:10,.0f} records/s)")
    print(f"produce into broker   : {sent:6.2f} s  ({len(records) / sent:10,.0f} records/s, {size / 1e6 / sent:.2f} MB/s; "
          f"truth sidecar on, acks=all)")
    print(f"ratio produce/build (records/s): {(len(records) / sent) / (len(records) / built):.3f}")


if __name__ == "__main__":
    main()
