"""Step time and memory of n batched LSTM experts (streamer.models.experts) against a Python loop
over n nn.LSTM-based modules doing the same work, in the same run, and their ratio.

    .venv/bin/python benchmarks/experts.py [--experts 30] [--hidden 200] [--iterations 3] [--device cpu]

A step is one `poe` learning step: forward of every expert, the plastic gate phase
(--gate-steps Adam steps on the gate vector against the detached expert logits), the
product-of-experts loss, backward, per-expert gradient clipping and one Adam update. Each
variant runs in its own child process, so its memory is measured alone: on CPU the peak
resident set size (ru_maxrss) minus the resident size once the model and optimizer are
built; on a GPU torch.cuda.max_memory_allocated over the steps. Wall and process CPU time
are both printed: on a shared machine the CPU time of a one-thread run is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from streamer.models import LSTMConfig, LSTMLanguageModel  # noqa: E402
from streamer.strategies.base import Batch  # noqa: E402
from streamer.strategies.experts import GateAdam, PoE, poe_gate_gradient, poe_log_probs  # noqa: E402


class LoopedPoE:
    """The same learning step as `poe`, with the experts as n separate LSTMLanguageModel modules
    (the same closed-form gate phase, and one Adam, fused like the strategy's, over all modules)."""

    def __init__(self, config: LSTMConfig, n: int, lr: float, clip: float, gate_steps: int, gate_lr: float,
                 device: torch.device):
        self.experts = nn.ModuleList(LSTMLanguageModel(config) for _ in range(n)).to(device)
        self.gate = torch.empty(n, device=device).uniform_(-0.1, 0.1)
        self.clip, self.gate_steps = clip, gate_steps
        self.optimizer = torch.optim.Adam(self.experts.parameters(), lr=lr, fused=device.type in ("cpu", "cuda"))
        self.gate_optimizer = GateAdam(self.gate, gate_lr)
        self.state = None

    def learn(self, batch: Batch) -> None:
        b = batch.inputs.shape[0]
        states = self.state or [expert.initial_state(b, batch.inputs.device) for expert in self.experts]
        outputs = [expert(batch.inputs, state) for expert, state in zip(self.experts, states)]
        logits = torch.stack([out[0] for out in outputs])  # (n, b, w, V)
        gradient = poe_gate_gradient(logits.detach(), batch.targets)
        for _ in range(self.gate_steps):
            self.gate_optimizer.step(gradient(self.gate))
        combined = poe_log_probs(logits, self.gate)
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(args, variant: str) -> dict:
    """Run one variant in this process; return its mean step time and memory."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = LSTMConfig(embedding=args.embedding, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    options = dict(lr=1e-3, clip=1.0, gate_steps=args.gate_steps, gate_lr=1e-3)
    if variant == "batched":  # the strategy builds its experts from the template's config
        learner = PoE(LSTMLanguageModel(config).to(device), n_experts=args.experts, warmup_batches=0, **options)
    else:
        learner = LoopedPoE(config, args.experts, device=device, **options)
    tokens = torch.randint(0, args.vocab, (args.warmup + args.iterations, args.streams, args.window + 1),
                           device=device)
    batches = [Batch(t[:, :-1], t[:, 1:]) for t in tokens]
    baseline = _resident_kib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline_gpu = torch.cuda.memory_allocated(device)
    for batch in batches[:args.warmup]:
        learner.learn(batch)
    _synchronize(device)
    started, started_cpu = time.perf_counter(), time.process_time()
    for batch in batches[args.warmup:]:
        learner.learn(batch)
    _synchronize(device)
    step_s = (time.perf_counter() - started) / args.iterations
    cpu_s = (time.process_time() - started_cpu) / args.iterations
    result = {"variant": variant, "step_s": step_s, "cpu_s": cpu_s,
              "peak_rss_delta_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024}
    if device.type == "cuda":
        result["gpu_peak_mib"] = (torch.cuda.max_memory_allocated(device) - baseline_gpu) / 2**20
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=30)
    p.add_argument("--hidden", type=int, default=200)
    p.add_argument("--embedding", type=int, default=200)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--streams", type=int, default=10, help="b")
    p.add_argument("--window", type=int, default=20, help="w")
    p.add_argument("--gate-steps", type=int, default=100)
    p.add_argument("--iterations", type=int, default=3, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=1,
                   help="child processes per variant, alternating; the fastest counts")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a small shared machine more threads made both variants "
                        "slower; 0: torch's default)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--only", choices=["batched", "loop"], help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        print(json.dumps(measure(args, args.only)))
        return
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                 if name not in ("only", "repeats")]
    results = {}
    for _ in range(args.repeats):
        for variant in ("batched", "loop"):
            child = subprocess.run([sys.executable, __file__, *forwarded, "--only", variant],
                                   check=True, capture_output=True, text=True)
            result = json.loads(child.stdout.strip().splitlines()[-1])
            if variant not in results or result["step_s"] < results[variant]["step_s"]:
                results[variant] = result
    print(f"{args.experts} experts, hidden {args.hidden}, embedding {args.embedding}, vocab {args.vocab}, "
          f"{args.layers} layers, b={args.streams}, w={args.window}, {args.gate_steps} gate steps, "
          f"device {args.device}, {torch.get_num_threads()} threads, {args.iterations} timed steps")
    for variant in ("batched", "loop"):
        r = results[variant]
        line = (f"  {variant:8s} step {r['step_s'] * 1e3:9.1f} ms wall {r['cpu_s'] * 1e3:9.1f} ms CPU   "
                f"peak RSS delta {r['peak_rss_delta_mib']:8.1f} MiB")
        if "gpu_peak_mib" in r:
            line += f"   GPU peak {r['gpu_peak_mib']:8.1f} MiB"
        print(line)
    print(f"  loop / batched step time: {results['loop']['step_s'] / results['batched']['step_s']:.2f}x wall, "
          f"{results['loop']['cpu_s'] / results['batched']['cpu_s']:.2f}x CPU")


if __name__ == "__main__":
    main()
