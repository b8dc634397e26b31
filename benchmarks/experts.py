"""Step time of the expert strategies' batched experts (streamer.models.experts) against a Python
loop over n nn.LSTM-based modules doing the same work, over a sweep of strategies and sizes, in the
same run.

    .venv/bin/python benchmarks/experts.py [--strategies poe,moe,ensemble] [--experts 5,10,30]
        [--hidden 32,200,550] [--min-seconds 1] [--device cpu]
    .venv/bin/python benchmarks/experts.py --separate [--repeats 2]   # each variant timed in its own process

A step is one learning step of `poe`, `moe` or `ensemble`: forward of every expert, the plastic
gate phase (poe, moe: --gate-steps Adam steps on the gate vector against the detached expert
logits; the ensemble has no gate), the combined loss (product of experts; mixture; the ensemble's
uniform mixture), backward, per-expert gradient clipping and one Adam update. Per strategy and size
it times three variants: `modules` (n separate LSTMLanguageModel modules, the loop the batched
model must not be slower than), and the batched model with each of its two kernels, `fused`
(one torch.bmm per time step over stacked weights) and `loop` (one native torch.lstm per expert
on its own weights). `auto` is the kernel the strategy picks for that device and size
(streamer.models.experts.choose_kernel); the ratio is modules / auto. Achieved GFLOP/s counts
the step's matrix products (forward, backward, poe's gate phase) over its CPU time; beside it the
machine's matmul rate with the same --threads, also per CPU second, for a large product and for
the recurrence's own shape (b x H times H x 4H). Wall and process CPU time are both printed: on a shared machine the CPU
time of a one-thread run is the steadier figure.

Timing: the three variants are built in one process per size and their steps alternate
(modules, fused, loop, modules, ...), each figure the median over its timed steps, so load
that comes and goes falls on all three alike. Each variant times at least --iterations steps
and until each has stepped for at least --min-seconds (wall time; the batches are reused in
turn): three steps of a 15 ms step are 45 ms, too short a window to tell a 2% difference from
noise. With --separate each variant is timed in a child process
of its own instead (the earlier default): on the 2-core AMD host the same variant's step
differed by up to 10% from one process to the next at 5 x 32, which the alternating medians
do not see.

Memory is always measured alone: each variant runs --warmup + 1 steps in a child process of its
own (on CPU the peak resident set size minus the resident size once the model is built; on a
GPU torch.cuda.max_memory_allocated). --no-memory skips those processes.

The fused and loop kernels are the same model (tests/test_experts.py checks it at hidden 12): they
start from the same weights and learn the same batches here, so each size also compares their
training losses step by step (warm-up and timed steps; with --separate over the steps both ran), and a
line before the headline gives the largest difference of the sweep; past 1e-5 the run fails (exit
status 1, one line).

The last line is the worst ratio of the sweep (naming the sizes where the wall and the CPU ratio are
worst).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from streamer.models import LSTMConfig, LSTMLanguageModel  # noqa: E402
from streamer.models.experts import choose_kernel  # noqa: E402
from streamer.strategies.base import Batch  # noqa: E402
from benchmarks.command import counts, ended_by_signals  # noqa: E402
from streamer.cli.flags import Parser, positive_int  # noqa: E402
from streamer.broker import die_with_parent  # noqa: E402
from streamer.strategies.experts import MoE, Ensemble, PoE  # noqa: E402
from streamer.strategies.gates import (GateAdam, moe_gate_gradient, moe_log_probs, poe_gate_gradient,  # noqa: E402
                                       poe_log_probs)

VARIANTS = ("modules", "fused", "loop")
LOSS_BOUND = 1e-5  # the largest training loss difference between the fused and the loop kernel
STRATEGIES = {"poe": PoE, "moe": MoE, "ensemble": Ensemble}


class LoopedExperts:
    """The same learning step as `poe`, `moe` or `ensemble`, with the experts as n separate
    LSTMLanguageModel modules (the same closed-form gate phase, and one Adam, fused like the
    strategy's, over all modules). The ensemble: no gate, the uniform mixture (moe's with w = 0)."""

    def __init__(self, strategy: str, config: LSTMConfig, n: int, lr: float, clip: float, gate_steps: int,
                 gate_lr: float, device: torch.device):
        self.gated = strategy != "ensemble"
        self.gate = torch.empty(n).uniform_(-0.1, 0.1).to(device) if self.gated else torch.zeros(n, device=device)
        self.experts = nn.ModuleList(LSTMLanguageModel(config) for _ in range(n)).to(device)
        self.clip, self.gate_steps = clip, gate_steps
        self.log_probs = poe_log_probs if strategy == "poe" else moe_log_probs
        self.gate_gradient = poe_gate_gradient if strategy == "poe" else moe_gate_gradient
        self.optimizer = torch.optim.Adam(self.experts.parameters(), lr=lr, fused=device.type in ("cpu", "cuda"))
        self.gate_optimizer = GateAdam(self.gate, gate_lr)
        self.state = None

    def learn(self, batch: Batch) -> None:
        b = batch.inputs.shape[0]
        states = self.state or [expert.initial_state(b, batch.inputs.device) for expert in self.experts]
        outputs = [expert(batch.inputs, state) for expert, state in zip(self.experts, states)]
        logits = torch.stack([out[0] for out in outputs])  # (n, b, w, V)
        if self.gated:
            gradient = self.gate_gradient(logits.detach(), batch.targets)
            for _ in range(self.gate_steps):
                self.gate_optimizer.step(gradient(self.gate))
        combined = self.log_probs(logits, self.gate)
        loss = F.nll_loss(combined.reshape(-1, combined.shape[-1]), batch.targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for expert in self.experts:
            nn.utils.clip_grad_norm_(expert.parameters(), self.clip)
        self.optimizer.step()
        self.state = [tuple(s.detach() for s in out[1]) for out in outputs]


def _resident_kib() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() // 1024


def _peak_resident_kib() -> int:
    """This process's own peak resident size (VmHWM). Not ru_maxrss: that keeps the peak of the process
    before its exec, so a child of a parent that holds models would report the parent's size."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_flop(args, strategy: str, n: int, hidden: int) -> float:
    """Floating-point operations of one learning step's matrix products: forward (input projections,
    recurrence, decoder), backward (twice the forward: the inputs' and the weights' gradients) and
    poe's gate phase (two matrix-vector products over the n x positions x V logits per gate step; moe's
    gate step has no product over the vocabulary, the ensemble no gate)."""
    positions = args.streams * args.window
    forward = 0.0
    for layer in range(args.layers):
        inputs = args.embedding if layer == 0 else hidden
        forward += 2 * positions * (inputs + hidden) * 4 * hidden
    forward += 2 * positions * hidden * args.vocab
    gate = args.gate_steps * 4 * n * positions * args.vocab if strategy == "poe" else 0
    return n * 3 * forward + gate


def build(args, strategy: str, variant: str, n: int, hidden: int):
    """A learner of one strategy and variant (seed 0) and its batches (seed 1: the same for every variant)."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = LSTMConfig(embedding=args.embedding, hidden=hidden, layers=args.layers, vocab=args.vocab)
    options = dict(lr=1e-3, clip=1.0)
    gate = dict(gate_steps=args.gate_steps, gate_lr=1e-3)
    if variant == "modules":
        learner = LoopedExperts(strategy, config, n, device=device, **options, **gate)
    else:  # the strategy builds its experts from the template's config
        if strategy != "ensemble":
            options |= gate | {"warmup_batches": 0}
        learner = STRATEGIES[strategy](LSTMLanguageModel(config).to(device), n_experts=n, **options)
        learner.model.experts.kernel = variant
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.warmup + args.iterations, args.streams, args.window + 1),
                           generator=generator).to(device)
    return learner, [Batch(t[:, :-1], t[:, 1:]) for t in tokens]


def timed_batch(args, batches: list, index: int) -> Batch:
    """The batch of timed step `index`: those after the warm-up ones, reused in turn (alike for every variant)."""
    timed = batches[args.warmup:]
    return timed[index % len(timed)]


def measure(args, strategy: str, variant: str, n: int, hidden: int) -> dict:
    """Run one variant in this process; return its mean step time and memory."""
    device = torch.device(args.device)
    learner, batches = build(args, strategy, variant, n, hidden)
    baseline = _resident_kib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline_gpu = torch.cuda.memory_allocated(device)
    losses = [learner.learn(batch) for batch in batches[:args.warmup]]
    _synchronize(device)
    started, started_cpu = time.perf_counter(), time.process_time()
    steps = 0
    while steps < args.iterations or time.perf_counter() - started < args.min_seconds:
        losses.append(learner.learn(timed_batch(args, batches, steps)))
        steps += 1
        _synchronize(device)
    result = {"variant": variant, "step_s": (time.perf_counter() - started) / steps,
              "cpu_s": (time.process_time() - started_cpu) / steps, "steps": steps,
              "peak_rss_delta_mib": (_peak_resident_kib() - baseline) / 1024, "losses": training_losses(losses)}
    if device.type == "cuda":
        result["gpu_peak_mib"] = (torch.cuda.max_memory_allocated(device) - baseline_gpu) / 2**20
    return result


def training_losses(stats: list) -> list[float]:
    """The training losses of a variant's learning steps (the strategies' LearnStats; the module loop gives
    none), read after the timing."""
    return [stats_.loss.item() for stats_ in stats if stats_ is not None]


def loss_difference(row: dict) -> float:
    """The largest |fused - loop| training loss of a size, over the steps both took."""
    return max((abs(f - l) for f, l in zip(row["fused"]["losses"], row["loop"]["losses"])), default=0.0)


def alternate(args, strategy: str, n: int, hidden: int) -> dict[str, dict]:
    """All variants in this process, their learning steps alternating; median step time of each."""
    device = torch.device(args.device)
    built = {variant: build(args, strategy, variant, n, hidden) for variant in VARIANTS}
    wall = {variant: [] for variant in VARIANTS}
    cpu = {variant: [] for variant in VARIANTS}
    losses = {variant: [] for variant in VARIANTS}

    def step_all(batch_of) -> None:
        for variant, (learner, batches) in built.items():
            _synchronize(device)
            started, started_cpu = time.perf_counter(), time.process_time()
            stats = learner.learn(batch_of(batches))
            _synchronize(device)
            wall[variant].append(time.perf_counter() - started)
            cpu[variant].append(time.process_time() - started_cpu)
            losses[variant].append(stats)

    for step in range(args.warmup):
        step_all(lambda batches: batches[step])
    for variant in VARIANTS:
        wall[variant].clear()
        cpu[variant].clear()
    steps = 0  # rounds (each variant steps once a round) until every variant has had --min-seconds
    while steps < args.iterations or min(sum(wall[variant]) for variant in VARIANTS) < args.min_seconds:
        step_all(lambda batches: timed_batch(args, batches, steps))
        steps += 1
    return {variant: {"variant": variant, "step_s": statistics.median(wall[variant]),
                      "cpu_s": statistics.median(cpu[variant]), "peak_rss_delta_mib": float("nan"), "steps": steps,
                      "losses": training_losses(losses[variant])}
            for variant in VARIANTS}


def matmul_gflops(device: torch.device, m: int, k: int, n: int, seconds: float = 0.3) -> float:
    """One (m x k) @ (k x n) product repeated for about `seconds` of CPU time (wall time on a GPU)."""
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    best = 0.0
    for _ in range(3):
        count, started = 0, clock()
        while clock() - started < seconds / 3:
            a @ b
            count += 1
        _synchronize(device)
        best = max(best, 2 * m * k * n * count / (clock() - started))
    return best / 1e9


def _strategies(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or set(names) - set(STRATEGIES):
        raise argparse.ArgumentTypeError(f"takes {', '.join(STRATEGIES)}, comma-separated; got {text!r}")
    return names


def _child(args, strategy: str, variant: str, n: int, hidden: int, **overrides) -> dict:
    settings = {**vars(args), **overrides}
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in settings.items() if name not in (
        "only", "repeats", "strategies", "experts", "hidden", "separate", "no_memory", "json")]
    child = subprocess.run([sys.executable, __file__, *forwarded, f"--strategies={strategy}", f"--experts={n}",
                            f"--hidden={hidden}", "--only", variant], check=True, capture_output=True, text=True,
                           preexec_fn=die_with_parent(os.getpid()))  # killed with this process
    return json.loads(child.stdout.strip().splitlines()[-1])


def sweep(args) -> list[dict]:
    """Per strategy and size, the fastest of --repeats timings of each variant (alternating in one process,
    or with --separate in child processes), and each variant's memory from a child process of its own."""
    rows, shape_gflops = [], {}
    for strategy, n, hidden in itertools.product(args.strategies, args.experts, args.hidden):
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            results = {variant: _child(args, strategy, variant, n, hidden) for variant in VARIANTS} \
                if args.separate else alternate(args, strategy, n, hidden)
            for variant, result in results.items():
                if variant not in best or result["cpu_s"] < best[variant]["cpu_s"]:
                    best[variant] = result
        if not args.separate and not args.no_memory:  # memory alone: warm-up and one step, no timing
            for variant in VARIANTS:
                alone = _child(args, strategy, variant, n, hidden, iterations=1, min_seconds=0)
                best[variant] = {**best[variant], **{key: value for key, value in alone.items()
                                                     if key in ("peak_rss_delta_mib", "gpu_peak_mib")}}
        auto = choose_kernel(torch.device(args.device), n, hidden)
        if hidden not in shape_gflops:
            shape_gflops[hidden] = matmul_gflops(torch.device(args.device), args.streams, hidden, 4 * hidden)
        rows.append({"strategy": strategy, "experts": n, "hidden": hidden, "auto": auto,
                     "flop": step_flop(args, strategy, n, hidden), "shape_gflops": shape_gflops[hidden],
                     **{variant: best[variant] for variant in VARIANTS}})
    return rows


def _mib(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def print_table(args, rows: list[dict], peak: float) -> None:
    print(f"embedding {args.embedding}, vocab {args.vocab}, {args.layers} layers, b={args.streams}, w={args.window}, "
          f"{args.gate_steps} gate steps, device {args.device}, {torch.get_num_threads()} threads, "
          f"at least {args.iterations} timed steps and {args.min_seconds:g} s a variant, "
          f"best of {args.repeats} (by CPU time), "
          + ("each variant in its own process (means)" if args.separate
             else "variants alternating in one process (medians)"))
    per = "GFLOP per second" if args.device == "cuda" else "GFLOP per CPU second, as the table's"
    print(f"machine matmul, {torch.get_num_threads()} thread(s): {peak:.1f} GFLOP/s (1024 x 1024 x 1024; {per})")
    print("| strategy | experts | hidden | GFLOP/step | modules ms | fused ms | loop ms | auto | modules/auto wall | "
          "modules/auto CPU | auto GFLOP/s | mm b x H x 4H GFLOP/s | peak RSS MiB modules/auto |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for row in rows:
        modules, chosen = row["modules"], row[row["auto"]]
        print(f"| {row['strategy']} | {row['experts']} | {row['hidden']} | {row['flop'] / 1e9:.2f} | "
              f"{modules['cpu_s'] * 1e3:.0f} | "
              f"{row['fused']['cpu_s'] * 1e3:.0f} | {row['loop']['cpu_s'] * 1e3:.0f} | {row['auto']} | "
              f"{modules['step_s'] / chosen['step_s']:.2f}x | {modules['cpu_s'] / chosen['cpu_s']:.2f}x | "
              f"{row['flop'] / chosen['cpu_s'] / 1e9:.1f} | {row['shape_gflops']:.1f} | "
              f"{_mib(modules['peak_rss_delta_mib'])}/{_mib(chosen['peak_rss_delta_mib'])} |")
    print("(ms: CPU time per step; on a GPU read the wall ratio)")
    apart = max(rows, key=loss_difference)
    print(f"fused / loop kernels: largest training loss difference {loss_difference(apart):.1e} "
          f"({_size(apart)}; bound {LOSS_BOUND:g})")
    worst = min(rows, key=lambda row: _ratio(row, "cpu_s"))
    worst_wall = min(rows, key=lambda row: _ratio(row, "step_s"))
    print(f"  loop / batched step time: {_ratio(worst_wall, 'step_s'):.2f}x wall, {_ratio(worst, 'cpu_s'):.2f}x CPU "
          f"(worst of the sweep; wall: {_size(worst_wall)}; CPU: {_size(worst)})")


def _ratio(row: dict, clock: str) -> float:
    """modules / the chosen kernel, in wall ("step_s") or CPU ("cpu_s") time a step."""
    return row["modules"][clock] / row[row["auto"]][clock]


def _size(row: dict) -> str:
    return f"{row['strategy']}, {row['experts']} experts, hidden {row['hidden']}"


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", type=_strategies, default="poe,moe,ensemble",
                   help="comma-separated: " + ", ".join(STRATEGIES) + " (default all)")
    p.add_argument("--experts", type=counts, default="5,10,30",
                   help="comma-separated expert counts (default %(default)s)")
    p.add_argument("--hidden", type=counts, default="32,200,550",
                   help="comma-separated hidden sizes, units per layer (default %(default)s)")
    p.add_argument("--embedding", type=positive_int, default=200, help="embedding dimensions (default %(default)s)")
    p.add_argument("--vocab", type=positive_int, default=256, help="vocabulary size (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=2, help="LSTM layers (default %(default)s)")
    p.add_argument("--streams", type=positive_int, default=10, help="b: rows of a batch (default %(default)s)")
    p.add_argument("--window", type=positive_int, default=20, help="w: tokens per row (default %(default)s)")
    p.add_argument("--gate-steps", type=int, default=100,
                   help="poe's and moe's gate steps per batch (default %(default)s)")
    p.add_argument("--iterations", type=positive_int, default=3,
                   help="timed steps per variant, at least (default %(default)s)")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="time at least this many seconds of steps per variant (more steps for small sizes; "
                        "default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="timings per variant and size (with --separate: child processes); "
                        "the fastest (CPU time) counts (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a small shared machine more threads made both variants "
                        "slower; 0: torch's default)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="where the steps run (default %(default)s; auto: cuda when torch sees one)")
    p.add_argument("--separate", action="store_true",
                   help="time each variant in a child process of its own (the earlier default) instead of "
                        "alternating their steps in one process")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the child processes that measure each variant's memory")
    p.add_argument("--json", type=Path, help="also write the rows here (after the table)")
    p.add_argument("--only", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    for name in ("gate_steps", "warmup", "threads", "min_seconds"):
        if not getattr(args, name) >= 0:  # (nan too)
            p.error(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if not math.isfinite(args.min_seconds):  # (its steps never ended)
        p.error(f"--min-seconds must be finite, got {args.min_seconds}")
    if args.json and (args.json.is_dir() or not os.access(args.json.parent, os.W_OK)):  # said now, not after the sweep
        p.error(f"--json {args.json}: not a file in a writable directory")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        print(json.dumps(measure(args, args.strategies[0], args.only, args.experts[0], args.hidden[0])))
        return
    with ended_by_signals("experts"):
        rows = sweep(args)
    print_table(args, rows, matmul_gflops(torch.device(args.device), 1024, 1024, 1024))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    apart = max(rows, key=loss_difference)
    if loss_difference(apart) > LOSS_BOUND:
        sys.exit(f"experts: the fused and loop kernels' training losses differ by {loss_difference(apart):.1e} at "
                 f"{_size(apart)}, past {LOSS_BOUND:g}: they are meant to be the same model")


if __name__ == "__main__":
    main()
