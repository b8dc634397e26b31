"""Held-out probe scoring: the loss of each class's probe split under the current model.

Runs between steps, off the hot path: eval mode (no dropout), no gradient, a fresh
hidden state, the model's training flag restored; no parameter, optimizer or
strategy state changes. Cost is bounded by `max_bytes` tokens per class: PROBE_MAX_BYTES by default,
so that the default demo's 43 probes (one per switch) take under 10% of its learner's wall time.

Probe texts are tokenized with the model's own `encode` (UTF-8 bytes by default, as
lstm-char reads them; a word vocabulary or a subword tokenizer otherwise). Models
without a carried state (`initial_state` gives None) score each window on its own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.nn import functional as F

__all__ = ["PROBE_MAX_BYTES", "ProbeSet", "ProbeScheduler", "load_probe_set"]

PROBE_MAX_BYTES = 1200  # tokens per class scored at each probe (the first of the held-out split)


class ProbeSet:
    """Each class's probe tokens cut into `rows` parallel rows, scored window by window.

    `encode(text)` gives the token ids (bytes or a list of ints; UTF-8 bytes by default);
    `max_bytes` caps the tokens per class (bytes with the default encoding)."""

    def __init__(self, texts: dict[str, str], *, rows: int = 10, window: int = 20, max_bytes: int = PROBE_MAX_BYTES,
                 encode=None):
        self.rows, self.window, self.max_bytes = rows, window, max_bytes
        self._grids: dict[str, torch.Tensor] = {}
        for name, text in sorted(texts.items()):
            data = (encode(text) if encode is not None else text.encode("utf-8"))[:max_bytes]
            windows = (len(data) // rows - 1) // window  # each row holds windows * window + 1 tokens
            if windows < 1:
                continue
            usable = windows * window + 1
            grid = torch.tensor(list(data[: rows * usable]), dtype=torch.long).view(rows, usable)
            self._grids[name] = grid

    @property
    def classes(self) -> list[str]:
        return list(self._grids)

    @torch.no_grad()
    def score(self, model) -> tuple[dict[str, float], float]:
        """({class: mean cross-entropy in nats}, seconds taken). Classes whose grids have the same
        length are scored together, stacked as rows of one batch (one forward per window for all of
        them: the probe's cost is a few batches, not a few per class); a model with one expert per
        class (`for_class`) scores each class with its own."""
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        losses = {}
        try:
            for names in self._groups(model):
                grid = torch.cat([self._grids[name] for name in names]).to(device)
                scorer = model.for_class(names[0]) if hasattr(model, "for_class") else model  # the oracle's own
                totals = self._score_grid(scorer, grid, device).view(len(names), self.rows).sum(dim=1)
                count = self.rows * (grid.shape[1] - 1) // self.window * self.window
                for name, total in zip(names, totals):
                    losses[name] = total / count
            values = torch.stack(list(losses.values())).tolist() if losses else []  # GPU sync point
        finally:
            model.train(was_training)
        return dict(zip(losses, values)), time.perf_counter() - started

    def _groups(self, model) -> list[list[str]]:
        """Classes scored in one batch: those with grids of one length (each alone for a per-class model,
        or one whose forward looks at the whole batch: `scores_rows_alone = False`, e.g. AdapterCL's
        adapter chosen per batch)."""
        if hasattr(model, "for_class") or not getattr(model, "scores_rows_alone", True):
            return [[name] for name in self._grids]
        groups: dict[int, list[str]] = {}
        for name, grid in self._grids.items():
            groups.setdefault(grid.shape[1], []).append(name)
        return list(groups.values())

    def _score_grid(self, scorer, grid: torch.Tensor, device) -> torch.Tensor:
        """Summed cross-entropy of each row of `grid`, read window by window from a fresh state."""
        state = scorer.initial_state(grid.shape[0], device)
        totals = torch.zeros(grid.shape[0], device=device)
        for start in range(0, grid.shape[1] - 1, self.window):
            inputs = grid[:, start:start + self.window]
            targets = grid[:, start + 1:start + self.window + 1]
            logits, state = scorer(inputs, state)
            per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            totals += per_token.view(targets.shape).sum(dim=1)
        return totals


def load_probe_set(manifest: dict, *, rows: int, window: int, max_bytes: int = PROBE_MAX_BYTES,
                   encode=None) -> ProbeSet | None:
    """The probe split the producer saved beside its manifest (None when there is none),
    tokenized with `encode` (the model's; UTF-8 bytes when None)."""
    probe = manifest.get("probe") or {}
    directory = probe.get("dir")
    if not directory or not probe.get("classes"):
        return None
    texts = {}
    for name, entry in probe["classes"].items():
        path = Path(directory) / entry["file"]
        if path.is_file():
            texts[name] = path.read_text(encoding="utf-8")
    return ProbeSet(texts, rows=rows, window=window, max_bytes=max_bytes, encode=encode) if texts else None


class ProbeScheduler:
    """When to score a probe set, and its rows in `path` (probes.jsonl).

    "start" before batch 0 (the untrained model), "switch" before the first batch of a new fragment
    (the model after the last batch of the previous one), "periodic" before every `every`-th batch,
    "end" after the last one (`score(loop, "end")`). The model is scored in the loop's worker thread
    between two steps, so a run with probes learns exactly what it learns without them."""

    def __init__(self, probe_set, path: Path, *, every: int = 0, at_switches: bool = True, unit: str | None = None):
        self.probe_set, self.path = probe_set, Path(path)
        self.every, self.at_switches, self.unit = every, at_switches, unit
        self.evaluations = 0
        self.seconds = 0.0
        self._staged: set | None = None  # classes whose first fragment a probe row has ended (read on first use)

    def _a_stage(self, trigger: str, ended: str | None) -> bool:
        """Whether a probe's representations are saved: DMI reads those of the probe that ends each class's
        first fragment (monitor.dmi), and the run's last ("end") is kept. Each probe's were saved, at every
        switch and --probe-every batch of a daemon's looped stream: a file each, never removed (about 1.6 MB
        for 900 probe utterances of a 384-wide encoder). The classes of the rows already in probes.jsonl (a
        resumed run's, cut back to its checkpoint) have theirs."""
        if self._staged is None:
            self._staged = set()
            if self.path.exists():
                for line in self.path.read_text(encoding="utf-8").splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        break  # a row torn by a crash ends the log
                    if row.get("trigger") in ("switch", "end") and row.get("ended_class"):
                        self._staged.add(row["ended_class"])
        first = ended is not None and ended not in self._staged
        if ended is not None:
            self._staged.add(ended)
        return trigger == "end" or first

    def trigger(self, index: int, upcoming, previous) -> str | None:
        """Why to score before learning batch `index` of truth `upcoming` after `previous`; None: no probe."""
        if index == 0:
            return "start"
        if self.at_switches and upcoming and previous and upcoming.fragment != previous.fragment:
            return "switch"
        if self.every and index % self.every == 0:
            return "periodic"
        return None

    def wants(self, index: int, upcoming, previous) -> bool:
        """Whether to score before batch `index` (a ReadyBatch) after truth `previous`: the loop's
        `run_ahead.snapshot_wanted` asks it before running that batch ahead of the consumer."""
        return self.trigger(index, upcoming.truth, previous) is not None

    async def before_next(self, loop) -> dict | None:
        """Score before the loop learns its next batch when a trigger says so; the row written, or None.
        Nothing while the next batch runs ahead (the loop asked `wants` before it: no trigger)."""
        if not loop.run_ahead.at_snapshot:
            return None
        upcoming = await loop.peek()
        if upcoming is None:
            return None
        trigger = self.trigger(loop.step, upcoming.truth, loop.truth)
        return None if trigger is None else await self.score(loop, trigger)

    async def score(self, loop, trigger: str) -> dict:
        previous = loop.truth
        ended = previous.class_name if trigger in ("switch", "end") and previous else None
        if getattr(self.probe_set, "saves_features", False):  # a classifier's: its representations for DMI
            scores, seconds = await loop.in_worker(self.probe_set.score, loop.strategy.model,
                                                   self._a_stage(trigger, ended))
        else:
            scores, seconds = await loop.in_worker(self.probe_set.score, loop.strategy.model)
        row = {"batch": loop.step, "trigger": trigger, "ended_class": ended,
               "scores": scores, "seconds": round(seconds, 4), "time": round(time.time(), 3)}
        if self.unit:
            row["unit"] = self.unit
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        self.evaluations += 1
        self.seconds += seconds
        return row
