"""Tokens per second of the full Kafka path beside the same model fed from memory, for the default
LSTM and for poe, with the memory path under the issue's-time thread setting as a baseline.

    ./dev bench [--cpus N] [--rounds 3] [--batches 300] [--poe-batches 60] [--hidden 256] [--threads N]

Each measurement is a process of its own, started on the CPUs this one may use; `--cpus N` first
pins this process to the first N of them (os.sched_setaffinity; the children inherit the mask and
torch's OpenMP reads it when it loads), so 1, 2 or 16 cores show from one machine:

- memory: the strategy fed from memory (batcher, prequential step) under the learner's thread policy
  (streamer.threads, OpenMP's short spin GOMP_SPINCOUNT=500), or --threads, and its allocator
  policy (streamer.allocator);
- kafka: the learner's whole path (streamer.learner.run: aiokafka consumer, decode, dead-letter
  checks, batching, metrics, loss log, status file) reading the same stream from one embedded
  broker, each time with a consumer group of its own; same thread policy;
- baseline: the memory path with the setting of the issue's time: torch's default threads,
  OpenMP's default (spinning) wait and malloc's defaults, so a slower memory path cannot raise the
  ratio unseen.

Throughput counts from the first learned batch to the last (process start, torch import, the
consumer group's join and the final checkpoint excluded). The three run in turn, --rounds times,
the order rotating; the ratios are taken within a round (same load) and the median over rounds is
printed, so a burst of load from another job skews one round, not the result. Each path's line
also says how much of its time was spent inside the step (predict and learn, from the step's own
timings): what is left is the hand-over between batches (for kafka: the worker thread waiting while
the event loop takes in the result, writes the loss line and metrics, and hands it the next batch),
and the process's CPU time per 1,000 tokens (all its threads; the broker is a process of its own):
kafka's extra CPU per token over memory's is the fetch side's and the bookkeeping's cost, which a
loaded machine inflates less than it does wall time. Kafka's line under them gives the event-loop
thread's own CPU time per batch: on 2 cores with 2 torch threads it is time the step loses (the
event loop's Python holds the GIL the step's Python needs, and takes a core from its threads).
On a loaded machine the ratios mean little: a process with more runnable threads (kafka's event
loop, worker and broker) gets a larger share of contended CPUs, and the baseline's spinning OpenMP
threads collapse; compare the figures of a quiet machine.

Last lines: `ratio kafka/memory: X` (the lower of the two models; the target is >= 0.95) and
`memory/baseline: X` (the lower of the two; >= 1 means the policy keeps the memory path's speed).
poe runs 10 experts and 10 gate steps (the CALM reference setting; its defaults, 30 and 100, take
seconds a batch on 2 cores): --experts and --gate-steps change that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamer.threads import pin_to_first_cpus  # noqa: E402

PATHS = ("memory", "kafka", "baseline")
SCHEDULE = dict(n_fragments=40, mean_tokens=10_000, streams=10, window=20, record_tokens=20, seed=0)


def corpus() -> tuple[str, dict[str, str]]:
    from producers.corpora import CorpusError, corpus_path, load_corpus_dir
    from streamer.settings import cache_root

    try:
        return "calm-multilingual", load_corpus_dir(corpus_path("calm-multilingual", cache_root()))
    except CorpusError:
        from tests.conftest import write_corpus

        path = write_corpus(Path(tempfile.mkdtemp()) / "corpus", lines=4000)
        return "synthetic (calm-multilingual not built)", load_corpus_dir(path)


def stream():
    from producers.schedule import CalmSchedule, build_stream

    name, text = corpus()
    records, manifest = build_stream(text, CalmSchedule(**SCHEDULE))
    return name, records, manifest


# ---------------------------------------------------------------- one measurement (a child process)

def learn_config(args, run_dir: Path, bootstrap: str = "", group: str = "bench"):
    from streamer.config import LearnConfig
    from streamer.models import LSTMConfig

    options = (("n_experts", args.experts), ("gate_steps", args.gate_steps)) if args.model == "poe" else ()
    return LearnConfig(bootstrap_servers=bootstrap, topic=args.topic, group_id=group,
                       run_dir=run_dir, strategy="naive" if args.model == "lstm" else "poe",
                       strategy_options=options, model=LSTMConfig(hidden=args.hidden), device=args.device,
                       max_batches=args.batches)


def figures(tokens: int, elapsed: float, stepping: float, cpu: float) -> dict:
    """tokens/s; the share of the time inside the step (predict and learn); process CPU ms per 1,000 tokens."""
    return {"tokens_per_s": tokens / elapsed, "stepping": stepping / elapsed, "cpu_ms_per_ktoken": 1e6 * cpu / tokens}


def memory_path(config, records, batches: int) -> dict:
    """From the first result to the last (the first batch's tokens predate the span)."""
    from streamer.batching import Batcher
    from streamer.learner import build_strategy, resolve_device
    from streamer.step import run

    strategy, _ = build_strategy(config, resolve_device(config.device))
    batcher = Batcher(config.streams, config.window, resolve_device(config.device))

    def feed():
        for record in records:
            batcher.add(record)
            while batcher.ready():
                ready = batcher.pop()
                yield ready.batch, ready.truth

    times, cpu, tokens, stepping = [], [], 0, 0.0
    for result in run(strategy, feed()):
        times.append(time.perf_counter())
        cpu.append(time.process_time())
        if len(times) > 1:
            tokens, stepping = tokens + result.tokens, stepping + result.predict_s + result.learn_s
        if len(times) == batches:
            break
    return figures(tokens, times[-1] - times[0], stepping, cpu[-1] - cpu[0])


def kafka_path(config) -> dict:
    """As memory_path, through the learner: times from its loss log, CPU time (all of the process's
    threads; the broker is another process) read as the monitor takes in each result, and the
    event-loop thread's own CPU time per batch (fetch, decode, batching, metrics, loss log)."""
    from monitor.exporter import create_metrics
    from monitor.live import LiveMonitor
    from monitor.view import LiveView
    from streamer.learner import run as run_learner

    class CpuClock(LiveMonitor):
        def observe(self, result) -> dict:
            # (process CPU, event-loop thread CPU) at the first result, at the latest
            self.cpu[1:] = [(time.process_time(), time.thread_time())]
            return super().observe(result)

    monitor = CpuClock(run="bench", strategy=config.strategy, metrics=create_metrics())
    monitor.cpu = []
    asyncio.run(run_learner(config, monitor=monitor, view=LiveView(enabled=False), log=lambda line: None))
    lines = [json.loads(line) for line in (config.run_dir / "losses.jsonl").read_text().splitlines()]
    tokens = sum(line["tokens"] for line in lines[1:])
    stepping = sum(line["predict_s"] + line["learn_s"] for line in lines[1:])
    (process_0, loop_0), (process_1, loop_1) = monitor.cpu
    return {**figures(tokens, lines[-1]["time"] - lines[0]["time"], stepping, process_1 - process_0),
            "event_loop_ms_per_batch": 1e3 * (loop_1 - loop_0) / (len(lines) - 1)}


def measure(args) -> None:
    """One path in this process; prints one JSON line. The policy's paths set OpenMP's wait policy
    before torch loads, as the streamer command does; the baseline leaves OpenMP and torch alone."""
    if args.path != "baseline":
        from streamer.settings import bound_openmp_spin

        bound_openmp_spin()
    import torch

    if args.path == "baseline":
        threads = torch.get_num_threads()
    else:
        from streamer.settings import omp_num_threads
        from streamer.threads import apply_thread_policy

        threads = apply_thread_policy(args.threads, omp_num_threads()).threads
    with tempfile.TemporaryDirectory() as run_dir:
        config = learn_config(args, Path(run_dir) / "bench", args.bootstrap, args.group)
        measured = kafka_path(config) if args.path == "kafka" else memory_path(config, stream()[1], args.batches)
    wait = ", ".join(part for part in (
        f"spin {os.environ['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in os.environ else "",
        os.environ.get("OMP_WAIT_POLICY", "")) if part) or "default"
    print(json.dumps({**measured, "threads": threads, "wait": wait}))


# ---------------------------------------------------------------- the benchmark (the parent)

def run_child(args, model: str, path: str, batches: int, bootstrap: str, group: str) -> dict:
    command = [sys.executable, __file__, "--measure", path, "--model", model, "--batches", str(batches),
               "--hidden", str(args.hidden), "--device", args.device, "--experts", str(args.experts),
               "--gate-steps", str(args.gate_steps), "--topic", args.topic, "--bootstrap", bootstrap,
               "--group", group]
    if args.threads:
        command += ["--threads", str(args.threads)]
    environment = dict(os.environ)
    if path == "baseline":  # torch's and OpenMP's own defaults, as before the thread policy
        environment.pop("OMP_WAIT_POLICY", None)
        environment.pop("GOMP_SPINCOUNT", None)
        environment.pop("OMP_NUM_THREADS", None)
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"throughput: the {model} {path} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])



def benchmark_model(args, model: str, batches: int, bootstrap: str) -> dict:
    rates, stepping, cpu = ({path: [] for path in PATHS} for _ in range(3))
    threads, loop_ms = {}, []
    for round_ in range(args.rounds):
        order = PATHS[round_ % 3:] + PATHS[:round_ % 3]
        for path in order:
            measured = run_child(args, model, path, batches, bootstrap, group=f"bench-{model}-{round_}")
            rates[path].append(measured["tokens_per_s"])
            stepping[path].append(measured["stepping"])
            cpu[path].append(measured["cpu_ms_per_ktoken"])
            threads[path] = (measured["threads"], measured["wait"])
            if path == "kafka":
                loop_ms.append(measured["event_loop_ms_per_batch"])
    kafka = [k / m for k, m in zip(rates["kafka"], rates["memory"])]
    kept = [m / b for m, b in zip(rates["memory"], rates["baseline"])]
    return {"rates": rates, "stepping": stepping, "cpu": cpu, "threads": threads, "kafka": statistics.median(kafka),
            "kafka_rounds": kafka, "kept": statistics.median(kept), "kept_rounds": kept,
            "loop_ms": statistics.median(loop_ms)}


def show(model: str, label: str, batches: int, result: dict) -> None:
    rates, threads = result["rates"], result["threads"]
    cpu_ratio = statistics.median(result["cpu"]["kafka"]) / statistics.median(result["cpu"]["memory"])
    median = {path: statistics.median(values) for path, values in rates.items()}
    print(f"{label}, {batches} batches:")
    for path in PATHS:
        count, wait = threads[path]
        rounds = " ".join(f"{value:,.0f}" for value in rates[path])
        inside, cpu = statistics.median(result["stepping"][path]), statistics.median(result["cpu"][path])
        print(f"  {path:8s} {median[path]:9,.0f} tokens/s, {inside:4.0%} of it inside the step, {cpu:6.1f} CPU ms "
              f"per 1k tokens  ({count} torch threads, OpenMP wait {wait}; rounds {rounds})")
    print(f"  kafka's event loop (fetch, decode, batching, metrics, loss log): {result['loop_ms']:.2f} CPU ms per batch")
    print(f"  {model}: kafka/memory {result['kafka']:.3f} (rounds "
          + " ".join(f"{value:.3f}" for value in result["kafka_rounds"])
          + f"), memory/baseline {result['kept']:.3f} (rounds "
          + " ".join(f"{value:.3f}" for value in result["kept_rounds"]) + ")"
          + f"; CPU per token kafka/memory {cpu_ratio:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, help="pin the benchmark to the first N CPUs it may use (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three paths (default 3)")
    parser.add_argument("--batches", type=int, default=300, help="batches of the LSTM per run (default 300)")
    parser.add_argument("--poe-batches", type=int, default=60, help="batches of poe per run (default 60)")
    parser.add_argument("--hidden", type=int, default=256, help="LSTM hidden size, both models (default 256)")
    parser.add_argument("--experts", type=int, default=10, help="poe's experts (default 10)")
    parser.add_argument("--gate-steps", type=int, default=10, help="poe's gate steps per batch (default 10)")
    parser.add_argument("--models", default="lstm,poe", help="comma-separated: lstm, poe (default both)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads of memory and kafka (default: the policy's)")
    # one measurement, in a child process
    parser.add_argument("--measure", choices=PATHS, dest="path", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("lstm", "poe"), default="lstm", help=argparse.SUPPRESS)
    parser.add_argument("--topic", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    parser.add_argument("--group", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.path:
        return measure(args)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    if not models or set(models) - {"lstm", "poe"}:
        parser.error("--models takes lstm, poe or both, comma-separated")
    cpus = pin_to_first_cpus(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    started = time.monotonic()

    from producers.kafka import produce
    from streamer.broker import EmbeddedBroker

    name, records, manifest = stream()
    labels = {"lstm": f"lstm-char 2x{args.hidden} (naive)",
              "poe": f"poe {args.experts} experts x 2x{args.hidden}, {args.gate_steps} gate steps"}
    batches = {"lstm": min(args.batches, manifest["total_batches"]),
               "poe": min(args.poe_batches, manifest["total_batches"])}
    print(f"CPUs {','.join(map(str, cpus))} ({len(cpus)}); load average {load:.2f} at the start; "
          f"corpus {name}; batches of 10x20 byte tokens; device {args.device}", flush=True)
    results = {}
    with EmbeddedBroker() as broker:
        asyncio.run(produce(records, broker.bootstrap_servers, args.topic))
        for model in models:
            results[model] = benchmark_model(args, model, batches[model], broker.bootstrap_servers)
            show(model, labels[model], batches[model], results[model])
    print(f"load average {os.getloadavg()[0]:.2f} at the end; {time.monotonic() - started:.0f} s in all")
    low = min(models, key=lambda model: results[model]["kafka"])
    kept = min(models, key=lambda model: results[model]["kept"])
    print(f"ratio kafka/memory: {results[low]['kafka']:.3f} (lower of "
          + ", ".join(f"{model} {results[model]['kafka']:.3f}" for model in models) + "; target >= 0.95)")
    print(f"memory/baseline: {results[kept]['kept']:.3f} (lower of "
          + ", ".join(f"{model} {results[model]['kept']:.3f}" for model in models)
          + "; >= 1: the thread policy keeps the memory path's speed)")


if __name__ == "__main__":
    main()
