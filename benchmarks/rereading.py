"""What --keep-windows costs while the learning waits for a stream: the records read again and the
learner's CPU time, beside the same stream learned with no stream over its bound (--keep-windows
above what any stream holds), measured in the same run.

    .venv/bin/python benchmarks/rereading.py [--keep 4,16,64] [--pause 3000] [--hidden 64]

The topic, in the embedded broker: one partition, three streams, records of 10 bytes (a window of
--window 10). The streams send in turn; then stream 0 pauses for --pause rounds in which stream 2
sends five records for each of stream 1's; then the three send in turn again. A batch needs a
window of each stream, so none is cut during the pause: streams 1 and 2 fill up to --keep-windows
windows, their further records stay in Kafka (read past), and once stream 0 is back each batch
makes room and the partition is read again from the first record left there. The backlogs of
streams 1 and 2 then lie far apart in the partition.

Each run is `streamer learn` in a process of its own, one torch thread, a consumer group of its
own, learning the unbounded run's batches. Its line gives the records read again per record of the
topic (`read_again` in its checkpoint, the counter `streamer_records_read_again_total`), its
process's CPU time (user and system, all threads) from its first batch logged to its exit (so not
the process start, the torch import nor the group's join, which every run pays alike and which
moved by a second from run to run) and the wall time between, each against the unbounded run's
(the mean of one run before the others and one after: the machine drifts), and whether its losses
equal the unbounded run's (the rereading must not change what is learned). Linux only (/proc).

Last lines: `records read again per record: X` and `cpu keep/unbounded: X` (the worst of the
--keep values). SIGTERM or Ctrl-C ends it with its learner and broker, its scratch directory removed
(benchmarks.command.ended_by_signals).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.command import ended_by_signals  # noqa: E402
from producers.kafka import produce  # noqa: E402
from producers.wire import Record  # noqa: E402
from streamer.batching import Batcher  # noqa: E402
from streamer.broker import EmbeddedBroker, die_with_parent  # noqa: E402
from streamer.checkpoint import CheckpointView, load  # noqa: E402
from streamer.cli.flags import Parser  # noqa: E402

UNBOUNDED = 1 << 20  # --keep-windows of the baseline: above what any stream holds here
TOPIC = "rereading"


def order(pause: int) -> list[Record]:
    """The topic's records (see the module's docstring)."""
    def record(stream: int, k: int) -> Record:
        return Record(str(stream), "0123456789"[k % 10:] + "0123456789"[:k % 10])
    records = [record(s, i) for i in range(30) for s in (0, 2, 1)]
    records += [record(s, 100 + i) for i in range(20) for s in (0, 2)]
    records += [record(s, 200 + i) for i in range(pause) for s in (2, 2, 2, 2, 2, 1)]
    records += [record(s, 400 + i) for i in range(pause // 3) for s in (0, 1, 2)]
    return records


def whole_batches(records: list[Record]) -> int:
    """The batches of 3 streams x 10 bytes the records make."""
    batcher, batches = Batcher(3, 10), 0
    for record in records:
        batcher.add(record)
        while batcher.ready():
            batcher.pop()
            batches += 1
    return batches


def learn(bootstrap: str, run_dir: Path, keep: int, hidden: int, batches: int, timeout_s: float = 600) -> dict:
    """One learner process: its wall and CPU seconds from its first batch, checkpoint figures and losses."""
    command = [sys.executable, "-m", "streamer", "learn", "--bootstrap-servers", bootstrap, "--topic", TOPIC,
               "--group", run_dir.name, "--run-dir", str(run_dir), "--streams", "3", "--window", "10",
               "--hidden", str(hidden), "--keep-windows", str(keep), "--threads", "1", "--no-view", "--no-probe",
               "--max-batches", str(batches)]
    log = run_dir / "losses.jsonl"
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True,
                                   preexec_fn=die_with_parent(os.getpid()))  # killed with this process
        at_first, started, deadline, late = None, None, time.monotonic() + timeout_s, False
        try:
            while True:  # (reaped here, not by Popen: wait4 gives this child's own CPU time)
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    break
                if at_first is None and log.exists() and log.stat().st_size:
                    at_first, started = cpu_seconds(process.pid), time.perf_counter()
                if time.monotonic() > deadline:
                    late = True
                    process.kill()
                    _, status, usage = os.wait4(process.pid, 0)
                    break
                time.sleep(0.005 if at_first is None else 0.01)
        except BaseException:  # a signal stops the benchmark: the learner ends before its directory goes
            process.kill()
            with contextlib.suppress(ChildProcessError):  # (unless wait4 had reaped it)
                os.wait4(process.pid, 0)
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - (started or 0.0)
        if process.returncode != 0 or at_first is None:
            output.seek(0)
            why = f"ran past {timeout_s:g} s" if late else f"exited {process.returncode}"
            raise SystemExit(f"streamer learn --keep-windows {keep} {why} (before its first batch: "
                             f"{at_first is None}):\n{output.read()[-2000:]}")
    saved = CheckpointView(load(run_dir / "checkpoint.pt"))
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime - at_first,
            "batches": saved.step, "read_again": saved.part().loop["read_again"], "losses": losses}


def cpu_seconds(pid: int) -> float | None:
    """The user and system CPU seconds process `pid` has used so far (Linux's /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", default="4,16,64", help="comma-separated --keep-windows values (default 4,16,64)")
    parser.add_argument("--pause", type=int, default=3000,
                        help="rounds of stream 0's pause, 6 records each (default 3000)")
    parser.add_argument("--hidden", type=int, default=64, help="the LSTM's hidden size (default 64)")
    args = parser.parse_args()
    try:
        keeps = [int(keep) for keep in args.keep.split(",")]
    except ValueError:
        keeps = []
    if not keeps or min(keeps) < 1 or args.pause < 3 or args.hidden < 1:
        parser.error(f"--keep {args.keep} --pause {args.pause} --hidden {args.hidden}: --keep takes whole numbers "
                     "of windows of at least 1, comma-separated; --pause at least 3 rounds, --hidden at least 1")
    with ended_by_signals("rereading"):
        measure(args, keeps)


def measure(args, keeps: list[int]) -> None:
    records = order(args.pause)
    batches = whole_batches(records)
    with tempfile.TemporaryDirectory() as scratch, EmbeddedBroker() as broker:
        asyncio.run(produce(records, broker.bootstrap_servers, TOPIC))
        print(f"topic {TOPIC}: {len(records):,} records ({batches:,} batches), stream 0 paused for "
              f"{args.pause * 6:,} of them; hidden {args.hidden}, one torch thread")
        runs = {}
        named = [(f"keep{keep}-{index}", keep) for index, keep in enumerate(keeps)]  # (a value given twice: two runs)
        for name, keep in [("unbounded", UNBOUNDED), *named, ("unbounded again", UNBOUNDED)]:
            runs[name] = learn(broker.bootstrap_servers, Path(scratch) / name.replace(" ", "-"), keep, args.hidden,
                               batches)
        base = runs["unbounded"]
        last = runs["unbounded again"]
        cpu_base, wall_base = (base["cpu"] + last["cpu"]) / 2, (base["wall"] + last["wall"]) / 2
        print(f"  unbounded: {base['batches']:,} batches, read again {base['read_again']:,}, cpu {base['cpu']:.2f} "
              f"and {last['cpu']:.2f} s, wall {base['wall']:.2f} and {last['wall']:.2f} s (first and last)")
        worst_again, worst_cpu = 0.0, 0.0
        for name, keep in named:
            run = runs[name]
            again, cpu, wall = run["read_again"] / len(records), run["cpu"] / cpu_base, run["wall"] / wall_base
            diff = max((abs(a - b) for a, b in zip(run["losses"], base["losses"])), default=0.0)
            same = len(run["losses"]) == len(base["losses"]) and diff <= 1e-6
            print(f"  --keep-windows {keep}: {run['batches']:,} batches, read again {run['read_again']:,} "
                  f"({again:.2f} per record), cpu {run['cpu']:.2f} s ({cpu:.3f}x unbounded), wall {run['wall']:.2f} s "
                  f"({wall:.3f}x), "
                  f"losses {'equal' if same else 'DIFFER'} (max diff {diff:.1e})")
            worst_again, worst_cpu = max(worst_again, again), max(worst_cpu, cpu)
    print(f"records read again per record: {worst_again:.2f}")
    print(f"cpu keep/unbounded: {worst_cpu:.3f}")


if __name__ == "__main__":
    main()
