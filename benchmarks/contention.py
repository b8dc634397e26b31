"""How much a second torch job on the same CPUs slows the learner's step under the thread policy.

    python benchmarks/contention.py [--seconds 20] [--threads N]

Runs the default naive step (lstm-char, b 10, w 20, predict then learn) in a loop for --seconds,
each run in its own process started the way the `streamer` command starts (OpenMP's short spin,
streamer.threads' policy): alone, beside a second learner with the same policy, and beside a plain
torch job with torch's own defaults (all cores, OpenMP's default wait). Prints steps/s and the
slowdown of each against the alone run measured in the same invocation (the daemon issue's bound:
at most 2.5x).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LEARNER = """
import sys, time
sys.path.insert(0, {root!r})
from streamer.settings import bound_openmp_spin
bound_openmp_spin()
from streamer.threads import apply_thread_policy
policy = apply_thread_policy({threads})
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
print(policy.threads, steps / (time.monotonic() - started))
"""

PLAIN_JOB = """
import time, torch
a = torch.randn(512, 512)
started = time.monotonic()
while time.monotonic() - started < {seconds}:
    a = torch.tanh(a @ a * 1e-3)
"""


def learner(seconds: float, threads: int | None) -> subprocess.Popen:
    code = LEARNER.format(root=str(ROOT), threads=threads, seconds=seconds)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def steps_per_second(process: subprocess.Popen) -> tuple[int, float]:
    out, _ = process.communicate()
    threads, rate = out.split()
    return int(threads), float(rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each timed run (default 20 s)")
    parser.add_argument("--threads", type=int, help="torch threads (default: the policy's)")
    args = parser.parse_args()
    threads, alone = steps_per_second(learner(args.seconds, args.threads))
    print(f"torch threads: {threads}")
    print(f"alone: {alone:.2f} steps/s")
    first, second = learner(args.seconds, args.threads), learner(args.seconds, args.threads)
    rates = [steps_per_second(first)[1], steps_per_second(second)[1]]
    print(f"beside a second learner: {rates[0]:.2f} and {rates[1]:.2f} steps/s "
          f"(slowdown {alone / min(rates):.2f}x)")
    plain = subprocess.Popen([sys.executable, "-c", PLAIN_JOB.format(seconds=args.seconds + 5)])
    time.sleep(1.0)
    beside_plain = steps_per_second(learner(args.seconds, args.threads))[1]
    plain.wait()
    print(f"beside a plain torch job: {beside_plain:.2f} steps/s (slowdown {alone / beside_plain:.2f}x)")
    worst = max(alone / min(rates), alone / beside_plain)
    print(f"worst slowdown: {worst:.2f}x (bound 2.5x)")


if __name__ == "__main__":
    main()
