"""How much a second torch job on the same CPUs slows the learner's step under the thread policy.

    python benchmarks/contention.py [--seconds 20] [--threads N] [--spins governed,500,1000,300000]

Runs the default naive step (lstm-char, b 10, w 20, predict then learn) in a loop for --seconds,
each run in its own process started the way the `streamer` command starts (streamer.threads'
policy, OpenMP's spin as streamer.settings chooses it, governed by streamer.spin): alone, beside a
second learner with the same policy, and beside a plain torch job with torch's own defaults (all
cores, OpenMP's default wait). Prints steps/s and the slowdown of each against the alone run
measured in the same invocation (the daemon issue's bound: at most 2.5x).

--spins runs the same three for each OpenMP spin count given (GOMP_SPINCOUNT in the learners'
environment, as a user would set it: the command keeps it, fixed, with OMP_WAIT_POLICY=ACTIVE beside it;
300000 is libgomp's own count, about 3 ms here; the word governed is the command's own: 300,000
turns, and 100 while other work shares the CPUs) and ends with a table: the trade-off between the
step's speed alone (a longer spin catches more of the step's parallel regions before the helper
thread sleeps) and its slowdown beside another job (a longer spin wastes the learner's share of
contended CPUs). The alone rate at each count over the alone rate at the largest is, without the
loop around the step, what benchmarks/throughput.py's memory/baseline measures.

SIGTERM or Ctrl-C ends it with its learners and torch job (benchmarks.command.ended_by_signals).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.command import ended_by_signals, seconds  # noqa: E402
from streamer.broker import die_with_parent  # noqa: E402
from streamer.cli.flags import Parser, positive_int  # noqa: E402

CHILDREN: list[subprocess.Popen] = []  # every process started, ended and reaped when the benchmark stops

LEARNER = """
import sys, time
sys.path.insert(0, {root!r})
from streamer.settings import omp_num_threads
from streamer.threads import apply_thread_policy, choose_spin
governed = choose_spin({threads}, omp_num_threads())
policy = apply_thread_policy({threads}, omp_num_threads(), govern_spin=governed)
import torch
from streamer.models import LSTMLanguageModel
from streamer.models.catalog import LSTMConfig
from streamer.strategies import STRATEGIES
from streamer.strategies.base import Batch
torch.manual_seed(0)
strategy = STRATEGIES["naive"](LSTMLanguageModel(LSTMConfig()), lr=2e-3)
tokens = torch.randint(0, 256, (10, 21))
batch = Batch(tokens[:, :-1], tokens[:, 1:], None)
for _ in range(5):
    strategy.predict(batch); strategy.learn(batch)
steps, started = 0, time.monotonic()
while time.monotonic() - started < {seconds}:
    strategy.predict(batch); strategy.learn(batch); steps += 1
from streamer.spin import govern
print(policy.threads, steps / (time.monotonic() - started), govern().switches if governed else -1)
"""

PLAIN_JOB = """
import time, torch
a = torch.randn(512, 512)
started = time.monotonic()
while time.monotonic() - started < {seconds}:
    a = torch.tanh(a @ a * 1e-3)
"""


def learner(seconds: float, threads: int | None, spins: int | None = None) -> subprocess.Popen:
    """One learner process; `spins`: its GOMP_SPINCOUNT as a user would set it (None: the command's)."""
    code = LEARNER.format(root=str(ROOT), threads=threads, seconds=seconds)
    environment = dict(os.environ)
    if spins is not None:
        environment["GOMP_SPINCOUNT"] = str(spins)
    return child([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=environment)


def child(command: list[str], **options) -> subprocess.Popen:
    """A process killed with this one (its parent-death signal) and remembered, so a stop ends it too."""
    CHILDREN.append(subprocess.Popen(command, preexec_fn=die_with_parent(os.getpid()), **options))
    return CHILDREN[-1]


def end_children() -> None:
    for process in CHILDREN:
        if process.poll() is None:
            process.kill()
        process.wait()


def steps_per_second(process: subprocess.Popen) -> tuple[int, float, str]:
    """A learner's torch threads, steps/s and its spins: "fixed" or the governor's switches."""
    out, _ = process.communicate()
    threads, rate, switches = out.split()
    if int(switches) < 0:
        return int(threads), float(rate), "fixed"
    return int(threads), float(rate), f"governed, {switches} switch{'' if switches == '1' else 'es'}"


def measure(seconds: float, threads: int | None, spins: int | None = None) -> tuple[float, float, float]:
    """Alone, beside a second learner (the slower of the two) and beside a plain torch job, in steps/s;
    each said in a line as it is measured."""
    used, alone, spun = steps_per_second(learner(seconds, threads, spins))
    print(f"torch threads: {used}" + ("" if spins is None else f", GOMP_SPINCOUNT={spins}"))
    print(f"alone: {alone:.2f} steps/s (spins {spun})")
    first, second = learner(seconds, threads, spins), learner(seconds, threads, spins)
    (_, one, spun_one), (_, other, spun_other) = steps_per_second(first), steps_per_second(second)
    rates = [one, other]
    print(f"beside a second learner: {one:.2f} and {other:.2f} steps/s (slowdown {alone / min(rates):.2f}x; "
          f"spins {spun_one} and {spun_other})")
    plain = child([sys.executable, "-c", PLAIN_JOB.format(seconds=seconds + 5)])
    time.sleep(1.0)
    _, beside_plain, spun = steps_per_second(learner(seconds, threads, spins))
    plain.wait()
    print(f"beside a plain torch job: {beside_plain:.2f} steps/s (slowdown {alone / beside_plain:.2f}x; spins {spun})")
    return alone, min(rates), beside_plain


def spin_counts(text: str) -> list[int | None]:
    """Whole numbers from 0 and the word "governed" (the command's own spins: None), comma-separated."""
    counts: list[int | None] = []
    for part in text.split(","):
        if part == "governed":
            counts.append(None)
        elif part.isdigit():
            counts.append(int(part))
        else:
            raise argparse.ArgumentTypeError(
                f"{text!r}: spin counts are whole numbers from 0 or the word governed, comma-separated")
    return counts


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=seconds, default=20.0, help="length of each timed run (default 20 s)")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: the policy's)")
    parser.add_argument("--spins", type=spin_counts,
                        help="OpenMP spin counts to compare, e.g. governed,250,500,1000,300000 (governed: the "
                             "command's own, streamer.spin; default: only that)")
    args = parser.parse_args()
    with ended_by_signals("contention"):
        try:
            compare(args)
        finally:
            end_children()


def compare(args) -> None:
    if not args.spins:
        alone, beside_learner, beside_plain = measure(args.seconds, args.threads)
        print(f"worst slowdown: {max(alone / beside_learner, alone / beside_plain):.2f}x (bound 2.5x)")
        return
    rows = {}
    for spins in args.spins:
        rows["governed" if spins is None else spins] = measure(args.seconds, args.threads, spins)
    longest = max((spins for spins in rows if spins != "governed"), default="governed")
    print(f"\n{'spins':>8} {'alone steps/s':>14} {'of ' + str(longest):>15} {'beside learner':>15} "
          f"{'beside torch':>13} {'worst':>7}")
    for spins, (alone, beside_learner, beside_plain) in rows.items():
        worst = max(alone / beside_learner, alone / beside_plain)
        print(f"{spins:>8} {alone:>14.2f} {alone / rows[longest][0]:>15.3f} {alone / beside_learner:>14.2f}x "
              f"{alone / beside_plain:>12.2f}x {worst:>6.2f}x{'' if worst <= 2.5 else '  over the 2.5x bound'}")


if __name__ == "__main__":
    main()
