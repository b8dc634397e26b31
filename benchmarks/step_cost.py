"""What one prequential batch costs streamer, split into score, update, gate fitting and overhead,
beside a plain PyTorch reference loop doing what the CALM authors' code does per batch, measured
in the same run on the same batches with one torch thread.

    .venv/bin/python benchmarks/step_cost.py [--batches 60] [--warmup 5] [--dropouts 0,0.2] [--only lstm-200,...]

Models (b=10 streams, w=20 tokens, byte vocabulary 256, embedding 200, Adam lr 1e-3, clip 1):
`lstm-200` and `lstm-742` (naive: a 2-layer LSTM of hidden 200 or 742) and `poe-10x200` (poe:
10 experts of hidden 200, 10 gate steps, no warm-up).

Per batch, each variant (built once, stepped in turn on the same batch, so a change in the
machine's load touches all of them alike):
- `streamer`: streamer.step.prequential_step on the strategy as `streamer learn` runs it. With
  dropout 0 one training-mode forward gives the score and the update (OnlineTrainer.shares_forward);
  with dropout > 0 the score is a separate eval-mode forward.
- `separate` (dropout 0 only): the same strategy made to score with a separate eval-mode forward,
  the path before the shared forward, to show what sharing saves.
- `reference`: written here for this benchmark, after germank/lifelonglm's main.py and learners
  (read, not copied): forward from the carried (detached) state, cross-entropy, backward, clip,
  Adam step, the training loss read with .item() as the batch's score; for PoE a Python loop over
  n nn.LSTM language models, the product of their logits under the detached gate weights, each
  model clipped alone, then the gate fitted by autograd and torch.optim.Adam, 10 steps on the
  detached logits.
- `forward`: the reference model's eval-mode forward alone (no graph, no update): the "one
  forward" of the bound for dropout > 0.

Columns, medians over the timed batches in ms (each column its own median, so they need not add
up): score (streamer: predict; reference: forward and loss), train fwd (streamer's training-mode
forward inside learn, the model's or the experts' own forward timed by hooks: 0 when predict's
forward serves the update, one forward with dropout > 0 and in `separate`; the reference's score is
its training forward), update (the rest of learn: backward, clip, optimizer; streamer's PoE also
its experts' combination, which the reference counts in score), gate (the plastic gate's fitting),
overhead (the rest of the step: streamer's one device read and
StepResult; the reference's carry and .item()), total (wall) and cpu (this thread's CPU time, the
steadier figure on a shared machine). The last lines give streamer/reference per model and dropout,
wall and CPU, each the median over the batches of the two variants' ratio on the same batch, against
the bound: 1.00 with dropout 0, (reference + forward)/reference (CPU, paired alike) with dropout > 0;
then the worst ratio/bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from benchmarks.command import fraction  # noqa: E402
from streamer.cli.flags import Parser, positive_int  # noqa: E402
from streamer.models import LSTMConfig, LSTMLanguageModel  # noqa: E402
from streamer.step import prequential_step  # noqa: E402
from streamer.strategies.base import Batch  # noqa: E402
from streamer.strategies.experts import PoE  # noqa: E402
from streamer.strategies.naive import Naive  # noqa: E402

MODELS = {"lstm-200": (1, 200), "lstm-742": (1, 742), "poe-10x200": (10, 200)}  # (experts, hidden); 1: naive
LR, CLIP, GATE_STEPS, GATE_LR = 1e-3, 1.0, 10, 1e-3
PARTS = ("score", "train fwd", "update", "gate", "overhead", "total", "cpu")


class ReferenceLM(nn.Module):
    """Embedding, dropout, 2-layer nn.LSTM, dropout, linear decoder: the authors' RNN language model's shape."""

    def __init__(self, vocab: int, embedding: int, hidden: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, embedding)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=2, dropout=dropout, batch_first=True)
        self.decode = nn.Linear(hidden, vocab)
        self.hidden = hidden

    def forward(self, inputs, state):
        out, state = self.lstm(self.drop(self.embed(inputs)), state)
        return self.decode(self.drop(out)), state

    def zero_state(self, rows: int):
        return (torch.zeros(2, rows, self.hidden), torch.zeros(2, rows, self.hidden))


class Reference:
    """The reference loop: n language models (1: a plain LSTM) and, for n > 1, a plastic gate."""

    def __init__(self, n: int, vocab: int, embedding: int, hidden: int, dropout: float, rows: int):
        self.models = nn.ModuleList(ReferenceLM(vocab, embedding, hidden, dropout) for _ in range(n)).train()
        self.states = [model.zero_state(rows) for model in self.models]
        self.optimizer = torch.optim.Adam(self.models.parameters(), lr=LR)
        self.gate = nn.Parameter(torch.empty(n).uniform_(-0.1, 0.1)) if n > 1 else None
        self.gate_optimizer = torch.optim.Adam([self.gate], lr=GATE_LR) if n > 1 else None

    def _logits(self, batch: Batch):
        outputs = [model(batch.inputs, tuple(s.detach() for s in state))
                   for model, state in zip(self.models, self.states)]
        if self.gate is None:
            return outputs[0][0], outputs
        stacked = torch.stack([logits for logits, _ in outputs])  # (n, b, w, V)
        return torch.tensordot(self.gate.detach(), stacked, dims=1), outputs

    def step(self, batch: Batch) -> dict[str, float]:
        marks = [time.perf_counter()]
        combined, outputs = self._logits(batch)
        loss = F.cross_entropy(combined.reshape(-1, combined.shape[-1]), batch.targets.reshape(-1))
        marks.append(time.perf_counter())
        self.optimizer.zero_grad()
        loss.backward()
        for model in self.models:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        self.optimizer.step()
        marks.append(time.perf_counter())
        if self.gate is not None:
            stacked = torch.stack([logits.detach() for logits, _ in outputs])
            for _ in range(GATE_STEPS):
                self.gate_optimizer.zero_grad()
                mixed = torch.tensordot(self.gate, stacked, dims=1)
                F.cross_entropy(mixed.reshape(-1, mixed.shape[-1]), batch.targets.reshape(-1)).backward()
                self.gate_optimizer.step()
        marks.append(time.perf_counter())
        self.states = [state for _, state in outputs]
        loss.item()  # the score, read on the host as the authors' loop does
        marks.append(time.perf_counter())
        return {"score": marks[1] - marks[0], "update": marks[2] - marks[1], "gate": marks[3] - marks[2],
                "overhead": marks[4] - marks[3]}

    @torch.no_grad()
    def forward_only(self, batch: Batch) -> dict[str, float]:
        """One eval-mode forward and loss from the carried state, changing nothing."""
        started = time.perf_counter()
        self.models.eval()
        combined, _ = self._logits(batch)
        F.cross_entropy(combined.reshape(-1, combined.shape[-1]), batch.targets.reshape(-1)).item()
        self.models.train()
        return {"score": time.perf_counter() - started}


class Streamer:
    """prequential_step on the strategy `streamer learn` builds; the gate's fitting timed by a wrapper,
    the model's forwards inside learn by hooks."""

    def __init__(self, n: int, config: LSTMConfig, shared: bool):
        model = LSTMLanguageModel(config)
        if n == 1:
            self.strategy = Naive(model, lr=LR, clip=CLIP)
        else:
            self.strategy = PoE(model, lr=LR, clip=CLIP, n_experts=n, gate_steps=GATE_STEPS, gate_lr=GATE_LR,
                                warmup_batches=0)
            gate = self.strategy._gate
            fit = gate.train

            def timed_fit(logits, targets):
                started = time.perf_counter()
                fit(logits, targets)
                self.gate_s += time.perf_counter() - started

            gate.train = timed_fit
        self.strategy._trainer.shares_forward &= shared
        self.index = 0
        self.gate_s = self.forward_s = 0.0
        self.learning = False
        self._forward_started = 0.0
        learn = self.strategy.learn

        def flagged_learn(batch):
            self.learning = True
            try:
                return learn(batch)
            finally:
                self.learning = False

        self.strategy.learn = flagged_learn
        forwarded = self.strategy.model.experts if n > 1 else self.strategy.model  # runs the LSTM(s)
        forwarded.register_forward_pre_hook(self._forward_begins)
        forwarded.register_forward_hook(self._forward_ends)

    def _forward_begins(self, *_):
        self._forward_started = time.perf_counter()

    def _forward_ends(self, *_):
        if self.learning:
            self.forward_s += time.perf_counter() - self._forward_started

    def step(self, batch: Batch) -> dict[str, float]:
        self.gate_s = self.forward_s = 0.0
        started = time.perf_counter()
        result = prequential_step(self.strategy, batch, None, self.index)
        total = time.perf_counter() - started
        self.index += 1
        return {"score": result.predict_s, "train fwd": self.forward_s,
                "update": result.learn_s - self.forward_s - self.gate_s, "gate": self.gate_s,
                "overhead": total - result.predict_s - result.learn_s}


def timed(step, batch: Batch) -> dict[str, float]:
    started, started_cpu = time.perf_counter(), time.thread_time()
    parts = step(batch)
    return parts | {"total": time.perf_counter() - started, "cpu": time.thread_time() - started_cpu}


def make_batches(count: int, rows: int, window: int, vocab: int) -> list[Batch]:
    """Consecutive windows of `rows` seeded byte streams (targets: the inputs shifted by one)."""
    generator = torch.Generator().manual_seed(0)
    streams = torch.randint(0, vocab, (rows, count * window + 1), generator=generator)
    return [Batch(streams[:, i * window:(i + 1) * window], streams[:, i * window + 1:(i + 1) * window + 1])
            for i in range(count)]


def measure(args, name: str, dropout: float) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Median ms of each part per variant, all variants stepped in turn on each batch; and the paired
    ratios: medians over the batches of streamer/reference and (reference + forward)/reference, CPU time."""
    n, hidden = MODELS[name]
    config = LSTMConfig(embedding=args.embedding, hidden=hidden, layers=2, dropout=dropout, vocab=args.vocab)
    torch.manual_seed(0)
    variants = {"streamer": Streamer(n, config, shared=True)}
    if dropout == 0:
        torch.manual_seed(0)
        variants["separate"] = Streamer(n, config, shared=False)
    torch.manual_seed(0)
    reference = Reference(n, args.vocab, args.embedding, hidden, dropout, args.streams)
    steps = {name: variant.step for name, variant in variants.items()}
    steps |= {"reference": reference.step, "forward": reference.forward_only}
    samples: dict[str, list[dict[str, float]]] = {key: [] for key in steps}
    for index, batch in enumerate(make_batches(args.warmup + args.batches, args.streams, args.window, args.vocab)):
        order = list(steps) if index % 2 == 0 else list(reversed(steps))  # neither always first
        for key in order:
            parts = timed(steps[key], batch)
            if index >= args.warmup:
                samples[key].append(parts)
    table = {key: {part: 1e3 * statistics.median(s.get(part, 0.0) for s in rows) for part in PARTS}
             for key, rows in samples.items()}
    table["streamer"]["shared"] = variants["streamer"].strategy._trainer.shares_forward
    pairs = list(zip(samples["streamer"], samples["reference"], samples["forward"]))
    ratios = {"wall": statistics.median(s["total"] / r["total"] for s, r, _ in pairs),
              "cpu": statistics.median(s["cpu"] / r["cpu"] for s, r, _ in pairs),
              "bound": statistics.median((r["cpu"] + f["cpu"]) / r["cpu"] for _, r, f in pairs) if dropout else 1.0}
    return table, ratios


def print_rows(name: str, dropout: float, table: dict[str, dict[str, float]]) -> None:
    for key, row in table.items():
        cells = " | ".join(f"{row[part]:.1f}" for part in PARTS)
        if key == "streamer":
            key += " (one forward)" if row["shared"] else " (eval-mode score)"
        print(f"| {name} | {dropout:g} | {key} | {cells} |", flush=True)


def fractions(text: str) -> list[float]:
    """Comma-separated dropout values, each at least 0 and below 1."""
    values = [fraction(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no values in {text!r}")
    return values


def main(argv=None) -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=positive_int, default=60,
                        help="timed batches per model (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches first (default %(default)s)")
    parser.add_argument("--dropouts", type=fractions, default="0,0.2",
                        help="dropout values, comma-separated (default %(default)s)")
    parser.add_argument("--only", default=",".join(MODELS), help="models, comma-separated (default: all)")
    parser.add_argument("--streams", type=positive_int, default=10, help="b: rows of a batch (default %(default)s)")
    parser.add_argument("--window", type=positive_int, default=20, help="w: bytes per row (default %(default)s)")
    parser.add_argument("--embedding", type=positive_int, default=200,
                        help="embedding dimensions (default %(default)s)")
    parser.add_argument("--vocab", type=positive_int, default=256, help="vocabulary size (default %(default)s)")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    torch.set_num_threads(1)
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        parser.error(f"unknown model {unknown[0]!r} (choose from {', '.join(MODELS)})" if unknown
                     else f"--only names no model (choose from {', '.join(MODELS)})")
    dropouts = args.dropouts
    print(f"b={args.streams}, w={args.window}, embedding {args.embedding}, vocab {args.vocab}, 1 torch thread, "
          f"median of {args.batches} batches after {args.warmup}; ms per batch")
    print(f"| model | dropout | variant | {' | '.join(PARTS)} |")
    print("|---|---:|---|" + "---:|" * len(PARTS))
    ratios = []
    for name in names:
        for dropout in dropouts:
            table, paired = measure(args, name, dropout)
            print_rows(name, dropout, table)
            ratios.append((name, dropout, paired["wall"], paired["cpu"], paired["bound"]))
    for name, dropout, wall, cpu, bound in ratios:
        print(f"  streamer/reference {name} dropout {dropout:g}: {wall:.2f} wall, {cpu:.2f} CPU (bound {bound:.2f})")
    worst = max(ratios, key=lambda row: row[3] / row[4])
    print(f"  worst streamer/bound: {worst[3] / worst[4]:.2f} CPU, {worst[2] / worst[4]:.2f} wall "
          f"({worst[0]}, dropout {worst[1]:g})")


if __name__ == "__main__":
    main()
