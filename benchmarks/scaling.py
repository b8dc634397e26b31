"""Tokens per second and peak memory of `streamer learn` against stream length, streams b, hidden
size and ranks: cost must grow linearly with the stream, memory not at all.

    .venv/bin/python benchmarks/scaling.py [--batches 1000] [--cpus N] [--parts length,streams,hidden,ranks]

One embedded broker; each stream is written by `streamer produce` (CALM schedule, the calm-multilingual
corpus or a synthetic one, seed 0) and each run is `streamer learn --no-view` as a process of its
own, otherwise with the command's defaults (lstm-char 2x256, naive, probes, checkpoints, the loss
log, the thread policy), so its memory is its own. For each run:

- tokens/s from its first learned batch to its last (the loss log's wall stamps: process start,
  torch import, the group's join and the final checkpoint excluded), and the whole wall time;
- peak RSS: the kernel's high-water mark of the learner process (ru_maxrss from wait4); with
  --nproc, the peak of the sum of VmRSS over its process tree (the launcher and its ranks),
  sampled twice a second.

Parts (--parts, all by default):
  length   the 1x stream (--batches of b 10 x w 20 bytes) and a 10x one (10 times the fragments,
           the same mean length), learned to exactly 1x and 10x the batches: the headline. The 1x
           run goes before and after the 10x one and the 10x time and peak RSS are compared with
           their means (a host whose speed drifts within the minutes of the 10x run moves both);
           the 10x run's tokens/s by blocks of 1x batches shows whether it slows as it goes
  streams  b 10, 20, 40 on a stream of the 1x tokens (so fewer, larger batches)
  hidden   128, 256, 512 on the 1x stream
  ranks    --nproc 1 and 2 on the 1x stream written to 10 partitions

Headline: `10x stream: X.XXx the time, Y.YYx the peak RSS (targets <= 10.5x, <= 1.1x)`.
--cpus N pins the benchmark and every process it starts to the first N CPUs it may use.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.command import ended_by_signals  # noqa: E402
from streamer.cli.flags import Parser, positive_int  # noqa: E402
from streamer.broker import die_with_parent  # noqa: E402
from streamer.threads import pin_to_first_cpus  # noqa: E402

WINDOW = 20
MEAN_TOKENS = 10_000  # --lambda: mean bytes of a fragment per stream
PARTS = ("length", "streams", "hidden", "ranks")


@dataclass(frozen=True)
class Stream:
    topic: str
    manifest: Path
    batches: int  # whole b x w batches in the stream
    streams: int


@dataclass(frozen=True)
class Measured:
    batches: int
    tokens_per_s: float
    span_s: float  # first learned batch to last
    wall_s: float  # the whole process
    peak_rss_mb: float
    block_rates: tuple = ()  # tokens/s of each run of `block` batches, in order (a trend shows here)


def streamer(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamer", *args]


def produce(bootstrap: str, root: Path, topic: str, fragments: int, streams: int, partitions: int = 1) -> Stream:
    manifest = root / f"{topic}.manifest.json"
    done = subprocess.run(streamer("produce", "--bootstrap-servers", bootstrap, "--topic", topic,
                                   "--fragments", str(fragments), "--lambda", str(MEAN_TOKENS),
                                   "--streams", str(streams), "--window", str(WINDOW), "--seed", "0",
                                   "--partitions", str(partitions), "--manifest", str(manifest)),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scaling: streamer produce failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    total = json.loads(manifest.read_text())["total_batches"]
    return Stream(topic, manifest, total, streams)


def fragments_for(batches: int) -> int:
    """Fragments whose expected length is `batches` of 10 x w bytes (--lambda counts over all streams),
    plus half: the lengths are drawn, and the runs stop at --max-batches."""
    return max(2, math.ceil(batches * 10 * WINDOW * 1.5 / MEAN_TOKENS))


def tree_rss_mb(root: int) -> float:
    """The sum of VmRSS over `root` and its descendants, in MB (0 for processes gone meanwhile)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    total = 0.0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def learn(bootstrap: str, stream: Stream, run_dir: Path, *, hidden: int = 256, batches: int | None = None,
          nproc: int = 1, block: int | None = None) -> Measured:
    command = streamer("learn", "--bootstrap-servers", bootstrap, "--topic", stream.topic,
                       "--manifest", str(stream.manifest), "--run-dir", str(run_dir), "--group", run_dir.name,
                       "--fresh", "--no-view", "--hidden", str(hidden))
    if batches:
        command += ["--max-batches", str(batches)]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    peak_tree, stop = [0.0], threading.Event()
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=die_with_parent(os.getpid()))  # killed with this process

        def sample() -> None:  # the process tree's RSS, for the ranks
            while not stop.wait(0.5):
                peak_tree[0] = max(peak_tree[0], tree_rss_mb(process.pid))

        if nproc > 1:
            threading.Thread(target=sample, daemon=True).start()
        try:
            _, status, usage = os.wait4(process.pid, 0)  # wait4: this child's own peak RSS (ru_maxrss, kB)
        except BaseException:  # a signal stops the benchmark: the learner first, before its files go
            end(process)
            raise
        finally:
            stop.set()
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    if process.returncode != 0:
        raise SystemExit(f"scaling: {' '.join(command[2:])} failed (status {process.returncode}):\n"
                         + log_path.read_text()[-3000:])
    lines = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    span = lines[-1]["time"] - lines[0]["time"]
    tokens = sum(line["tokens"] for line in lines[1:])
    peak = max(peak_tree[0], usage.ru_maxrss / 1024) if nproc > 1 else usage.ru_maxrss / 1024
    # every block to the last batch (the last may be shorter): each block's rate over its own intervals
    blocks = [lines[start:start + block + 1] for start in range(0, len(lines) - 1, block)] if block else []
    rates = tuple(sum(line["tokens"] for line in part[1:]) / (part[-1]["time"] - part[0]["time"]) for part in blocks)
    return Measured(len(lines), tokens / span, span, wall, peak, rates)


def end(process: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a learner as a user would (SIGTERM: its last checkpoint) and reap it; SIGKILL after grace_s."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def length_headline(before: Measured, long_run: Measured, after: Measured) -> tuple[float, float]:
    """(time, peak RSS) of the 10x run over the 1x runs', each against the 1x runs' mean (the RSS was against
    their larger, which made its ratio look lower than the time's reference would). Time is seconds a batch
    (the spans are between the first and the last batch: batches - 1 apart), and the ratio that of 10x the
    batches to 1x."""
    short = (before.span_s / (before.batches - 1) + after.span_s / (after.batches - 1)) / 2
    return (10 * long_run.span_s / (long_run.batches - 1) / short,
            long_run.peak_rss_mb / ((before.peak_rss_mb + after.peak_rss_mb) / 2))


def row(label: str, measured: Measured) -> str:
    return (f"  {label:12s} {measured.batches:7,d} batches  {measured.tokens_per_s:9,.0f} tokens/s  "
            f"{measured.span_s:7.1f} s learning  {measured.wall_s:7.1f} s wall  {measured.peak_rss_mb:6.0f} MB peak RSS")




def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=positive_int, default=1000,
                        help="batches of the 1x stream (default 1000; at least 10)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    parser.add_argument("--cpus", type=int, help="pin to the first N CPUs this process may use (default: all)")
    args = parser.parse_args()
    if args.batches < 10:
        parser.error(f"--batches {args.batches}: at least 10 (a rate is taken over the span between batches)")
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}, comma-separated")
    try:
        cpus = pin_to_first_cpus(args.cpus)
    except ValueError as exc:
        parser.error(str(exc))
    with ended_by_signals("scaling"):
        measure(args, parts, cpus)


def measure(args, parts: list[str], cpus: list[int]) -> None:
    from streamer.broker import EmbeddedBroker

    started = time.monotonic()
    print(f"CPUs {','.join(map(str, cpus))} ({len(cpus)}); load average {os.getloadavg()[0]:.2f} at the start; "
          f"1x = {args.batches:,} batches of 10 x {WINDOW} bytes", flush=True)
    headline = None
    with tempfile.TemporaryDirectory() as scratch, EmbeddedBroker() as broker:
        root, bootstrap = Path(scratch), broker.bootstrap_servers
        base = produce(bootstrap, root, "scale-b10", fragments_for(args.batches), 10)
        one = min(args.batches, base.batches)
        if one < args.batches:
            print(f"  the 1x stream holds {base.batches:,} batches: 1x is {one:,}, not {args.batches:,}", flush=True)
        if "length" in parts:
            long = produce(bootstrap, root, "scale-b10-10x", fragments_for(10 * args.batches), 10)
            ten = min(10 * one, long.batches)
            print("stream length (lstm-char 2x256, b 10):", flush=True)
            # the 1x run before and after the 10x one: a host whose speed drifts over the minutes
            # the 10x run takes moves both alike, and their mean is the reference
            before = learn(bootstrap, base, root / "length-1x", batches=one)
            print(row("1x", before), flush=True)
            long_run = learn(bootstrap, long, root / "length-10x", batches=ten, block=one)
            print(row(f"{ten / one:.1f}x", long_run), flush=True)
            after = learn(bootstrap, base, root / "length-1x-again", batches=one)
            print(row("1x again", after), flush=True)
            rates = long_run.block_rates
            print(f"  the {ten / one:.1f}x run by 1x blocks: " + " ".join(f"{rate:,.0f}" for rate in rates)
                  + f" tokens/s (last/first {rates[-1] / rates[0]:.3f})", flush=True)
            headline = length_headline(before, long_run, after)
        if "streams" in parts:
            print("streams b (lstm-char 2x256, the 1x tokens):", flush=True)
            for streams in (10, 20, 40):
                stream = base if streams == 10 else produce(bootstrap, root, f"scale-b{streams}",
                                                            fragments_for(args.batches), streams)
                batches = min(one * 10 // streams, stream.batches)
                print(row(f"b {streams}", learn(bootstrap, stream, root / f"streams-{streams}", batches=batches)),
                      flush=True)
        if "hidden" in parts:
            print("hidden size (lstm-char 2 layers, b 10, 1x):", flush=True)
            for hidden in (128, 256, 512):
                print(row(f"hidden {hidden}", learn(bootstrap, base, root / f"hidden-{hidden}", hidden=hidden,
                                                    batches=one)), flush=True)
        if "ranks" in parts:
            print("ranks (lstm-char 2x256, b 10 over 10 partitions, 1x; peak RSS of all processes):", flush=True)
            parted = produce(bootstrap, root, "scale-b10-p10", fragments_for(args.batches), 10, partitions=10)
            for nproc in (1, 2):
                print(row(f"--nproc {nproc}", learn(bootstrap, parted, root / f"ranks-{nproc}",
                                                    batches=min(one, parted.batches), nproc=nproc)), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end; {time.monotonic() - started:.0f} s in all")
    if headline:
        print(f"10x stream: {headline[0]:.2f}x the time, {headline[1]:.2f}x the peak RSS "
              "(targets <= 10.5x, <= 1.1x)")


if __name__ == "__main__":
    main()
