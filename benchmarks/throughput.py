"""Tokens per second of the full Kafka path beside the same model fed from memory, for the default
LSTM and for poe, with the memory path under the issue's-time thread setting as a baseline.

    ./dev bench [--cpus N] [--processes 2] [--rounds 16] [--slice 0.5] [--poe-slice 0.5]
                [--hidden 256] [--threads N]

Each path runs in processes of its own (--processes, 2), started on the CPUs this one may use;
`--cpus N` first pins this process to the first N of them (os.sched_setaffinity; the children
inherit the mask and torch's OpenMP reads it when it loads), so 1, 2 or 16 cores show from one
machine:

- memory: the strategy fed from memory (batcher, prequential step) under the learner's thread policy
  (streamer.threads, OpenMP's spin as streamer.settings chooses it and streamer.spin governs it),
  or --threads, and its allocator policy (streamer.allocator);
- kafka: the learner's whole path (streamer.learner.run: aiokafka consumer, decode, dead-letter
  checks, batching, metrics, loss log, status file) reading the same stream from one embedded
  broker, with a consumer group of its own; same thread policy;
- baseline: the memory path with the setting of the issue's time: torch's default threads,
  OpenMP's default (spinning) wait and malloc's defaults, so a slower memory path cannot raise the
  ratio unseen.

The processes run interleaved, not one after another: each is started, learns its first batch
(process start, torch import, the consumer group's join excluded) and is stopped (SIGSTOP); then
they take turns, each continued (SIGCONT) for a slice of --slice seconds (poe: --poe-slice) while
all others are stopped, --rounds times, the paths' order rotating. A path's tokens/s counts the
batches that finished inside its processes' slices over their total length, so all three are
measured over the same minutes and a host whose speed drifts (on a 2-core VM the same run moved
20-30% between runs a minute apart) moves them alike: the ratios are of these pooled rates, and
each line also gives the middle half of the per-round ratios. Two processes of one path differ
too, by up to 11% on the 2-core VM in one run (the same code and stream; 1-3% in most), so one
process a path gave a ratio that moved more from run to run than the paths differ: each path's
processes are pooled, and a line gives each one's own tokens/s. A slice starts with the caches the
other processes left, alike for all; a batch cut by a slice's end counts in the slice where it
finishes. Periodic checkpoints are off (the final one, at the SIGTERM that ends a path, is outside
the slices). A Kafka process stays in its consumer group while stopped: the first one, stopped
for over 10 s while the others started, was neither dropped nor rebalanced (aiokafka's log at INFO).

Each path's line also says how much of its time was spent inside the step (predict and learn, from
the step's own timings): what is left is the hand-over between batches (for kafka: the worker
thread waiting while the event loop takes in the result, writes the loss line and metrics, and
hands it the next batch), and the process's CPU time per 1,000 tokens (all its threads, read from
/proc over the slices; the broker is a process of its own): kafka's extra CPU per token over
memory's is the fetch side's and the bookkeeping's cost. Kafka's line under them gives the
event-loop thread's own CPU time per batch: on 2 cores with 2 torch threads it is time the step
loses (it takes a core from the step's threads, and its Python holds the GIL the step's Python
needs). Two more lines say where the rest of the CPUs' time went: the broker's CPU per
batch during each path's slices (kafka's is the fetch's cost on the broker's side; the others'
show the broker's idle cost), and each path's involuntary context switches per batch (the kernel
took one of its threads off a CPU while it could run: a thread of another process, the broker's
or the path's own event loop, displaced it; with every CPU running a torch thread, each such
switch can hold a parallel region up until the displaced thread runs again; in brackets, the
main thread's: kafka's event loop, the memory paths' step). On a loaded machine the ratios mean
little: a process with more runnable threads (kafka's event loop, worker and broker) gets a
larger share of contended CPUs, and the baseline's spinning OpenMP threads collapse; compare the
figures of a quiet machine.

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
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.command import ended_by_signals, seconds  # noqa: E402
from streamer.cli.flags import Parser, positive_int  # noqa: E402
from streamer.broker import die_with_parent  # noqa: E402
from streamer.threads import pin_to_first_cpus  # noqa: E402

PATHS = ("memory", "kafka", "baseline")
SCHEDULE = dict(n_fragments=60, mean_tokens=10_000, streams=10, window=20, record_tokens=20, seed=0)


def corpus(scratch: Path) -> tuple[str, Path]:
    """(name, directory) of the stream's corpus: calm-multilingual once built, else a synthetic one written
    under `scratch` (the parent's, removed when it ends; its children are given the path)."""
    from producers.corpora import CorpusError, corpus_path
    from streamer.settings import cache_root

    try:
        return "calm-multilingual", corpus_path("calm-multilingual", cache_root())
    except CorpusError:
        from tests.conftest import write_corpus

        return "synthetic (calm-multilingual not built)", write_corpus(scratch / "corpus", lines=4000)


def stream(corpus_dir: Path) -> list:
    """The records of the benchmark's stream (the same in every process)."""
    from producers.corpora import load_corpus_dir
    from producers.schedule import CalmSchedule, build_stream

    return build_stream(load_corpus_dir(corpus_dir), CalmSchedule(**SCHEDULE))[0]


# ---------------------------------------------------------------- one path (a child process)

def learn_config(args, run_dir: Path, bootstrap: str = "", group: str = "bench"):
    from streamer.config import LearnConfig
    from streamer.models import LSTMConfig

    options = (("n_experts", args.experts), ("gate_steps", args.gate_steps)) if args.model == "poe" else ()
    return LearnConfig(bootstrap_servers=bootstrap, topic=args.topic, group_id=group,
                       run_dir=run_dir, strategy="naive" if args.model == "lstm" else "poe",
                       strategy_options=options, model=LSTMConfig(hidden=args.hidden), device=args.device,
                       checkpoint_every_s=1e9)


def say_ready() -> None:
    """The first batch is learned: the parent may stop this process and start the next."""
    print("ready", flush=True)


def memory_path(config, records) -> list:
    """(finished_at, tokens, seconds inside the step) of every batch, until SIGTERM."""
    from streamer.batching import Batcher
    from streamer.learner import build_strategy, resolve_device
    from streamer.step import run

    stopped = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    strategy, _ = build_strategy(config, resolve_device(config.device))
    batcher = Batcher(config.streams, config.window, resolve_device(config.device))

    def feed():
        for record in records:
            batcher.add(record)
            while batcher.ready():
                ready = batcher.pop()
                yield ready.batch, ready.truth

    batches = []
    for result in run(strategy, feed()):
        batches.append((result.finished_at, result.tokens, result.predict_s + result.learn_s))
        if len(batches) == 1:
            say_ready()
        if stopped:
            return batches
    while not stopped:  # the stream ran out: the parent says so (no batch in the slices left)
        time.sleep(0.1)
    return batches


def kafka_path(config) -> list:
    """As memory_path, through the learner, which SIGTERM stops cleanly; read from its loss log."""
    from monitor.exporter import create_metrics
    from monitor.live import LiveMonitor
    from monitor.view import LiveView
    from streamer.learner import run as run_learner

    class Ready(LiveMonitor):
        def observe(self, result) -> dict:
            if result.index == 0:
                say_ready()
            return super().observe(result)

    monitor = Ready(run="bench", strategy=config.strategy, metrics=create_metrics())
    asyncio.run(run_learner(config, monitor=monitor, view=LiveView(enabled=False), log=lambda line: None,
                            stop_signals=(signal.SIGTERM,)))
    lines = [json.loads(line) for line in (config.run_dir / "losses.jsonl").read_text().splitlines()]
    return [(line["time"], line["tokens"], line["predict_s"] + line["learn_s"]) for line in lines]


def measure(args) -> None:
    """One path in this process: says "ready" after its first batch, learns until SIGTERM, then prints
    one JSON line. The policy's paths set OpenMP's wait policy before torch loads, as the streamer
    command does; the baseline leaves OpenMP and torch alone."""
    # until a path takes SIGTERM as its stop, it ends this process through its finally blocks (its run
    # directory removed), not at once
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    governed = False
    if args.path != "baseline":
        from streamer.settings import omp_num_threads
        from streamer.threads import choose_spin

        governed = choose_spin(args.threads, omp_num_threads())
    import torch

    if args.path == "baseline":
        threads = torch.get_num_threads()
    else:
        from streamer.threads import apply_thread_policy

        threads = apply_thread_policy(args.threads, omp_num_threads(), govern_spin=governed).threads
    with tempfile.TemporaryDirectory() as run_dir:
        config = learn_config(args, Path(run_dir) / "bench", args.bootstrap, args.group)
        batches = kafka_path(config) if args.path == "kafka" else memory_path(config, stream(args.corpus_dir))
    wait = ", ".join(part for part in (
        f"spin {os.environ['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in os.environ else "",
        os.environ.get("OMP_WAIT_POLICY", "")) if part) or "default"
    if governed:
        from streamer.spin import govern

        wait += f", 100 while shared ({govern().switches} switches)"
    print(json.dumps({"batches": batches, "threads": threads, "wait": wait}))


# ---------------------------------------------------------------- the benchmark (the parent)

def start_child(args, model: str, path: str, bootstrap: str, group: str) -> subprocess.Popen:
    """Start one path and wait for its first batch; it is left stopped (SIGSTOP)."""
    command = [sys.executable, __file__, "--measure", path, "--model", model,
               "--hidden", str(args.hidden), "--device", args.device, "--experts", str(args.experts),
               "--gate-steps", str(args.gate_steps), "--topic", args.topic, "--bootstrap", bootstrap,
               "--group", group, "--corpus-dir", str(args.corpus_dir)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    environment = dict(os.environ)
    if path == "baseline":  # torch's and OpenMP's own defaults, as before the thread policy
        environment.pop("OMP_WAIT_POLICY", None)
        environment.pop("GOMP_SPINCOUNT", None)
        environment.pop("OMP_NUM_THREADS", None)
    errors = tempfile.TemporaryFile("w+")  # not a pipe: a stopped parent must never block a child's writes
    child = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=errors, text=True,
                             preexec_fn=die_with_parent(os.getpid()))  # killed with this process
    child.errors = errors
    try:
        ready, _, _ = select.select([child.stdout], [], [], 300)
        line = child.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise SystemExit(f"throughput: the {model} {path} run did not start:\n{stderr_of(child)}")
        os.kill(child.pid, signal.SIGSTOP)
    except BaseException:  # not yet the caller's to end (a signal, or it did not start)
        end_children([child])
        raise
    return child


def end_children(children, grace_s: float = 30) -> None:
    """SIGTERM (continued, if stopped), so each child removes its run directory, then SIGKILL after
    `grace_s`; all reaped."""
    running = [child for child in children if child.poll() is None]
    for child in running:
        child.terminate()
        child.send_signal(signal.SIGCONT)
    for child in running:
        try:
            child.communicate(timeout=grace_s)  # (reads its JSON line: a full pipe must not hold it)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def stderr_of(child: subprocess.Popen) -> str:
    child.errors.seek(0)
    return child.errors.read()[-3000:]


def finish_child(child: subprocess.Popen, model: str, path: str) -> dict:
    """SIGTERM (the learner stops cleanly) and the path's JSON line."""
    os.kill(child.pid, signal.SIGTERM)
    os.kill(child.pid, signal.SIGCONT)
    out, _ = child.communicate(timeout=300)
    if child.returncode != 0:
        raise SystemExit(f"throughput: the {model} {path} run failed:\n{stderr_of(child)}")
    return json.loads(out.strip().splitlines()[-1])


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(all threads, the main thread) CPU seconds of process `pid` (user + system, /proc)."""
    def read(stat: str) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def preemptions(pid: int) -> tuple[int, int]:
    """(all threads, the main thread): times the threads of process `pid` were taken off a CPU while
    they could run (the kernel's nonvoluntary_ctxt_switches in /proc/PID/task; threads that ended
    meanwhile are not in it)."""
    total = main = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    total += int(line.split()[1])
                    main += int(line.split()[1]) if task.name == str(pid) else 0
        except OSError:
            continue
    return total, main


def run_seconds(pid: int) -> float:
    """CPU seconds all threads of process `pid` have run, to the nanosecond (/proc/PID/task/*/schedstat;
    /proc/PID/stat counts 10 ms ticks, too coarse for the broker's share of a slice)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def benchmark_model(args, model: str, slice_s: float, bootstrap: str, broker_pid: int | None = None) -> dict:
    """Each path in --processes processes, interleaved (module docstring); each path's figures pooled
    over its processes, and each process's own tokens/s under "processes"."""
    # the paths' order rotates: each round the last path goes to the front of each set
    instances = range(args.processes)
    keys = [(path, i) for i in instances for path in ("memory", "baseline", "kafka")]
    children = {}
    try:
        for path, i in keys:
            children[path, i] = start_child(args, model, path, bootstrap, group=f"bench-{model}-{i}")
        windows = {key: [] for key in keys}
        broker_cpu = {key: 0.0 for key in keys}  # the broker's CPU seconds during each process's slices
        cpu_before = {key: cpu_seconds(child.pid) for key, child in children.items()}
        switches_before = {key: preemptions(child.pid) for key, child in children.items()}
        for round_ in range(args.rounds):
            turn = -round_ % 3
            for key in [(path, i) for i in instances for path in PATHS[turn:] + PATHS[:turn]]:
                pid = children[key].pid
                broker_before = run_seconds(broker_pid) if broker_pid else 0.0
                began = time.time()
                os.kill(pid, signal.SIGCONT)
                time.sleep(slice_s)
                ended = time.time()
                os.kill(pid, signal.SIGSTOP)
                windows[key].append((began, ended))
                broker_cpu[key] += run_seconds(broker_pid) - broker_before if broker_pid else 0.0
        cpu_after = {key: cpu_seconds(child.pid) for key, child in children.items()}
        switches = {key: tuple(after - before for after, before in zip(preemptions(child.pid), switches_before[key]))
                    for key, child in children.items()}
        measured = {key: finish_child(child, model, key[0]) for key, child in children.items()}
    finally:
        end_children(children.values())
    inside, whole = {}, {}
    for key in keys:
        batches = measured[key]["batches"]
        if not batches or batches[-1][0] < windows[key][-1][0]:
            raise SystemExit(f"throughput: the stream ran out before the {model} {key[0]} run's last slice "
                             "(fewer --rounds or a shorter --slice)")
        inside[key] = [[batch for batch in batches if began <= batch[0] <= ended] for began, ended in windows[key]]
        if not any(inside[key]):  # (its figures divided by zero: a traceback)
            flag = "--poe-slice" if model == "poe" else "--slice"
            raise SystemExit(f"throughput: no {model} {key[0]} batch finished inside its {args.rounds} slices of "
                             f"{slice_s:g} s (a machine this busy needs a longer {flag})")
        # the step's share: of the batches that started in a slice too (a cut one's step spans a stop)
        whole[key] = [[batch for batch in slice_ if batch[0] - batch[2] >= began]
                      for slice_, (began, _) in zip(inside[key], windows[key])]
    rounds = range(args.rounds)

    def tokens_per_s(keys, in_rounds=rounds) -> float:
        """The tokens of the batches that finished inside these processes' slices of these rounds over
        the slices' length."""
        tokens = sum(batch[1] for key in keys for round_ in in_rounds for batch in inside[key][round_])
        return tokens / sum(windows[key][round_][1] - windows[key][round_][0] for key in keys for round_ in in_rounds)

    figures, per_round = {}, {}
    for path in PATHS:
        mine = [(path, i) for i in instances]
        counted = [batch for key in mine for slice_ in inside[key] for batch in slice_]
        tokens = sum(batch[1] for batch in counted)
        spans = sum(slice_[-1][0] - (slice_[0][0] - slice_[0][2]) for key in mine for slice_ in whole[key] if slice_)
        stepping = sum(batch[2] for key in mine for slice_ in whole[key] for batch in slice_)
        figures[path] = {
            "tokens_per_s": tokens_per_s(mine),
            "processes": [tokens_per_s([key]) for key in mine],
            "stepping": stepping / spans if spans else float("nan"),
            "cpu_ms_per_ktoken": 1e6 * sum(cpu_after[key][0] - cpu_before[key][0] for key in mine) / tokens,
            "batches": len(counted),
            "event_loop_ms_per_batch": 1e3 * sum(cpu_after[key][1] - cpu_before[key][1] for key in mine) / len(counted),
            "preemptions_per_batch": sum(switches[key][0] for key in mine) / len(counted),
            "main_preemptions_per_batch": sum(switches[key][1] for key in mine) / len(counted),
            "broker_ms_per_batch": 1e3 * sum(broker_cpu[key] for key in mine) / len(counted) if broker_pid
            else float("nan"),
            "threads": measured[path, 0]["threads"], "wait": measured[path, 0]["wait"]}
        per_round[path] = [tokens_per_s(mine, [round_]) for round_ in rounds]  # all its processes, a round
    rate = {path: figures[path]["tokens_per_s"] for path in PATHS}
    return {"figures": figures, "kafka": rate["kafka"] / rate["memory"], "kept": rate["memory"] / rate["baseline"],
            "kafka_rounds": [k / m for k, m in zip(per_round["kafka"], per_round["memory"]) if m],
            "kept_rounds": [m / b for m, b in zip(per_round["memory"], per_round["baseline"]) if b]}


def middle_half(values: list[float]) -> str:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{quartiles[0]:.3f}-{quartiles[2]:.3f}"


def show(model: str, label: str, slice_s: float, args, result: dict) -> None:
    figures = result["figures"]
    cpu_ratio = figures["kafka"]["cpu_ms_per_ktoken"] / figures["memory"]["cpu_ms_per_ktoken"]
    processes = f"each path in {args.processes} processes, " if args.processes > 1 else ""
    print(f"{label}, {processes}{args.rounds} rounds of {slice_s:g} s slices:")
    for path in PATHS:
        f = figures[path]
        print(f"  {path:8s} {f['tokens_per_s']:9,.0f} tokens/s, {f['stepping']:4.0%} of it inside the step, "
              f"{f['cpu_ms_per_ktoken']:6.1f} CPU ms per 1k tokens  ({f['threads']} torch threads, OpenMP wait "
              f"{f['wait']}; {f['batches']} batches)")
    print(f"  kafka's event loop (fetch, decode, batching, metrics, loss log): "
          f"{figures['kafka']['event_loop_ms_per_batch']:.2f} CPU ms per batch; the broker during each path's "
          "slices: " + ", ".join(f"{path} {figures[path]['broker_ms_per_batch']:.2f}" for path in PATHS)
          + " CPU ms per batch")
    print("  threads taken off a CPU while runnable (involuntary switches) per batch, all (main thread): "
          + ", ".join(f"{path} {figures[path]['preemptions_per_batch']:.2f} "
                      f"({figures[path]['main_preemptions_per_batch']:.2f})" for path in PATHS))
    if args.processes > 1:
        print("  each process's own tokens/s: " + "; ".join(
            f"{path} " + " / ".join(f"{rate:,.0f}" for rate in figures[path]["processes"]) for path in PATHS))
    print(f"  {model}: kafka/memory {result['kafka']:.3f} (rounds' middle half {middle_half(result['kafka_rounds'])}), "
          f"memory/baseline {result['kept']:.3f} (rounds' middle half {middle_half(result['kept_rounds'])}); "
          f"CPU per token kafka/memory {cpu_ratio:.3f}", flush=True)


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, help="pin the benchmark to the first N CPUs it may use (default: all)")
    parser.add_argument("--processes", type=positive_int, default=2,
                        help="processes per path, their slices interleaved and their batches pooled (default 2)")
    parser.add_argument("--rounds", type=positive_int, default=16, help="rounds of one slice per process (default 16)")
    parser.add_argument("--slice", type=seconds, default=0.5, help="seconds a path runs per round, lstm (default 0.5)")
    parser.add_argument("--poe-slice", type=seconds, default=0.5, help="the same for poe (default 0.5)")
    parser.add_argument("--hidden", type=positive_int, default=256, help="LSTM hidden size, both models (default 256)")
    parser.add_argument("--experts", type=positive_int, default=10, help="poe's experts (default 10)")
    parser.add_argument("--gate-steps", type=positive_int, default=10, help="poe's gate steps per batch (default 10)")
    parser.add_argument("--models", default="lstm,poe", help="comma-separated: lstm, poe (default both)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                        help="the paths' device (default cpu; auto: cuda when torch sees one)")
    parser.add_argument("--threads", type=positive_int,
                        help="torch threads of memory and kafka (default: the policy's)")
    # one path, in a child process
    parser.add_argument("--measure", choices=PATHS, dest="path", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("lstm", "poe"), default="lstm", help=argparse.SUPPRESS)
    parser.add_argument("--topic", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    parser.add_argument("--group", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--corpus-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.path:
        return measure(args)
    with ended_by_signals("throughput"):
        benchmark(parser, args)


def benchmark(parser, args) -> None:
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    if not models or set(models) - {"lstm", "poe"}:
        parser.error("--models takes lstm, poe or both, comma-separated")
    try:
        cpus = pin_to_first_cpus(args.cpus)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device != "cpu":  # said here, not by each child after the broker started and the stream was written
        import torch  # (after the pinning: its OpenMP reads the CPU mask as it loads)

        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not torch.cuda.is_available():
            parser.error("--device cuda, but torch sees no CUDA device here")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="throughput-") as scratch:
        measure_models(args, models, cpus, load, Path(scratch))


def measure_models(args, models: list[str], cpus: list[int], load: float, scratch: Path) -> None:
    """Each model's paths and the headlines; a synthetic corpus, when one is needed, is written in `scratch`."""
    from producers.kafka import produce
    from streamer.broker import EmbeddedBroker

    started = time.monotonic()
    name, args.corpus_dir = corpus(scratch)
    records = stream(args.corpus_dir)
    labels = {"lstm": f"lstm-char 2x{args.hidden} (naive)",
              "poe": f"poe {args.experts} experts x 2x{args.hidden}, {args.gate_steps} gate steps"}
    slices = {"lstm": args.slice, "poe": args.poe_slice}
    print(f"CPUs {','.join(map(str, cpus))} ({len(cpus)}); load average {load:.2f} at the start; "
          f"corpus {name}; batches of 10x20 byte tokens; device {args.device}", flush=True)
    results = {}
    with EmbeddedBroker() as broker:
        asyncio.run(produce(records, broker.bootstrap_servers, args.topic))
        for model in models:
            results[model] = benchmark_model(args, model, slices[model], broker.bootstrap_servers, broker.pid)
            show(model, labels[model], slices[model], args, results[model])
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
