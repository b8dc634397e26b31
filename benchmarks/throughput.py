"""Tokens per second of the full path (Kafka, batching, metrics, loss log) beside the
same model fed from memory in the same process, and their ratio.

    ./dev bench [--batches 400] [--hidden 256] [--threads N]

Both paths run the same stream, seed and model; throughput is measured from
the first learned batch to the last, so the consumer-group join is excluded.
Torch threads and OpenMP's wait policy are the learner's (streamer.threads'
policy, OMP_WAIT_POLICY=PASSIVE) unless --threads says otherwise; the first
line says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamer.settings import omp_num_threads, prefer_passive_openmp  # noqa: E402

prefer_passive_openmp()  # as the streamer command does, before torch loads OpenMP

import torch  # noqa: E402

from monitor.exporter import create_metrics  # noqa: E402
from monitor.live import LiveMonitor  # noqa: E402
from monitor.view import LiveView  # noqa: E402
from producers.corpora import CorpusError, corpus_path, load_corpus_dir  # noqa: E402
from producers.kafka import produce  # noqa: E402
from producers.schedule import CalmSchedule, build_stream  # noqa: E402
from streamer.batching import Batcher  # noqa: E402
from streamer.broker import EmbeddedBroker  # noqa: E402
from streamer.settings import cache_root  # noqa: E402
from streamer.config import LearnConfig  # noqa: E402
from streamer.learner import build_strategy, resolve_device, run as run_learner  # noqa: E402
from streamer.models import LSTMConfig  # noqa: E402
from streamer.step import run  # noqa: E402
from streamer.threads import apply_thread_policy  # noqa: E402


def corpus() -> tuple[str, dict[str, str]]:
    try:
        path = corpus_path("calm-multilingual", cache_root())
        return "calm-multilingual", load_corpus_dir(path)
    except CorpusError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.conftest import write_corpus

        path = write_corpus(Path(tempfile.mkdtemp()) / "corpus", lines=4000)
        return "synthetic (calm-multilingual not built)", load_corpus_dir(path)


def memory_path(config: LearnConfig, records, batches: int) -> float:
    strategy, _ = build_strategy(config, resolve_device(config.device))
    batcher = Batcher(config.streams, config.window, resolve_device(config.device))

    def feed():
        for record in records:
            batcher.add(record)
            while batcher.ready():
                ready = batcher.pop()
                yield ready.batch, ready.truth

    times, tokens = [], 0
    for result in run(strategy, feed()):
        times.append(time.perf_counter())
        tokens += result.tokens if len(times) > 1 else 0
        if len(times) == batches:
            break
    return tokens / (times[-1] - times[0])


def kafka_path(config: LearnConfig, records) -> tuple[float, float]:
    with EmbeddedBroker() as broker:
        config = LearnConfig(**{**config.__dict__, "bootstrap_servers": broker.bootstrap_servers})
        asyncio.run(produce(records, broker.bootstrap_servers, config.topic))
        monitor = LiveMonitor(run="bench", strategy=config.strategy, metrics=create_metrics())
        started = time.perf_counter()
        asyncio.run(run_learner(config, monitor=monitor, view=LiveView(enabled=False)))
        total = time.perf_counter() - started
    lines = [json.loads(line) for line in (config.run_dir / "losses.jsonl").read_text().splitlines()]
    tokens = sum(line["tokens"] for line in lines[1:])
    return tokens / (lines[-1]["time"] - lines[0]["time"]), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, help="torch threads for both paths (default: the learner's policy)")
    args = parser.parse_args()
    print(apply_thread_policy(args.threads, omp_num_threads()).describe(), flush=True)
    name, text = corpus()
    schedule = CalmSchedule(n_fragments=40, mean_tokens=10_000, streams=10, window=20, record_tokens=20, seed=0)
    records, manifest = build_stream(text, schedule)
    batches = min(args.batches, manifest["total_batches"])
    config = LearnConfig(bootstrap_servers="", topic="bench", run_dir=Path(tempfile.mkdtemp()) / "bench",
                         model=LSTMConfig(hidden=args.hidden), device=args.device, max_batches=batches)
    before = memory_path(config, records, batches)
    full, wall = kafka_path(config, records)
    after = memory_path(config, records, batches)  # before and after, to average out drift in machine load
    memory = (before + after) / 2
    device = resolve_device(args.device)
    print(f"corpus {name}; {batches} batches of 10x20 byte tokens; LSTM hidden {args.hidden}; "
          f"device {device}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"memory path : {memory:10,.0f} tokens/s  (mean of {before:,.0f} before and {after:,.0f} after)")
    print(f"kafka path  : {full:10,.0f} tokens/s  (broker, aiokafka, batching, metrics, loss log; "
          f"{wall:.1f}s wall incl. group join)")
    print(f"ratio kafka/memory: {full / memory:.3f}")


if __name__ == "__main__":
    main()
