"""The MULTI reference: the stream's own batches, shuffled i.i.d., learned offline by a naive learner.

No Kafka: the batches are rebuilt from the producer's records (or from its manifest and
corpus) through the model's batcher, exactly as the learner would cut them; their order
is a permutation seeded by the run's seed; the prequential step (predict, record, learn)
runs over that order. The loss log is written back in *stream* order, each row keeping
its batch's original class, fragment and position (`batch`) and adding `trained_at` (its
place in the shuffled order), so ppl, ppl@sw and rec are computed at the original
positions: ppl@sw is the loss of the batches that followed a switch in the stream, which
the shuffled learner met at random times. It has no switches to recover from, so it is a
reference, not a competitor. A shuffled batch follows an unrelated one, so by default
each batch starts from a zero hidden state (`carry_state=True` carries it anyway).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from monitor.files import replace_text
from monitor.live import LiveMonitor
from monitor.losslog import LossLogWriter
from streamer import checkpoint
from streamer.strategies.base import Batch
from streamer.strategies.naive import Naive

__all__ = ["ShuffledNaive", "shuffled_order", "stream_batches", "records_from_manifest", "run_multitask"]


class ShuffledNaive(Naive):
    """Naive fine-tuning for batches in shuffled order: a zero hidden state per batch unless carry_state."""

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, steps: int = 1, carry_state: bool = False):
        super().__init__(model, lr=lr, clip=clip, steps=steps)
        self.carry_state = carry_state
        self._zero: tuple[Batch, Any] | None = None  # (batch, its zero state): predict's and learn's

    def _start_state(self, batch: Batch):
        """The carried state, or a zero one: the same object for predict and learn of one batch, so that
        with dropout 0 learn reuses predict's forward (OnlineTrainer.take) instead of running another."""
        if self.carry_state:
            return super()._start_state(batch)
        if self._zero is None or self._zero[0] is not batch:
            self._zero = (batch, self.model.initial_state(batch.inputs.shape[0], self._device()))
        return self._zero[1]


def shuffled_order(n: int, seed: int) -> list[int]:
    """A permutation of range(n), the same for the same seed."""
    return np.random.default_rng(seed).permutation(n).tolist()


def stream_batches(records, built, streams: int, window: int, device) -> list:
    """(Batch, BatchTruth) of every batch the learner's batcher cuts from `records`, in stream order."""
    batcher = built.make_batcher(streams, window, device)
    batches = []
    for record in records:
        batcher.add(record)
        while batcher.ready():
            ready = batcher.pop()
            batches.append((ready.batch, ready.truth))
    return batches


def records_from_manifest(manifest: dict, *, probe_examples: int = 50):
    """The producer's records, rebuilt from its manifest (corpus path and schedule); checked
    against the manifest's class list and batch count."""
    from producers.schedule import Schedule
    from producers.stream import prepare_stream

    fields = {f.name: manifest[f.name] for f in dataclasses.fields(Schedule) if f.name in manifest}
    if "kind" not in fields and "schedule" in manifest:
        fields["kind"] = manifest["schedule"]
    if manifest.get("corpus_level") == "word" and manifest.get("bytes_per_corpus_token"):
        fields["mean_tokens"] = max(1, round(fields["mean_tokens"] / manifest["bytes_per_corpus_token"]))
    for key in ("given_order",):
        if key in fields:
            fields[key] = tuple(fields[key])
    records, rebuilt = prepare_stream(Path(manifest["corpus"]), Schedule(**fields), probe_examples=probe_examples)
    for key in ("classes", "total_batches", "n_fragments"):
        if key in manifest and rebuilt.get(key) != manifest[key]:
            raise ValueError(f"the stream rebuilt from the manifest differs in {key}: "
                             f"{rebuilt.get(key)!r} instead of {manifest[key]!r}")
    return records


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _write_config(config, device, strategy, built, n: int) -> None:
    config.run_dir.mkdir(parents=True, exist_ok=True)
    data = asdict(config)
    parameters = sum(p.numel() for p in strategy.model.parameters())
    data.update(run_dir=str(config.run_dir), device=str(device), parameters=parameters,
                model_kind=built.kind, model_details=built.details, started=time.time(),
                reference=True, oracle=False, learner=repr(strategy), torch_threads=torch.get_num_threads(),
                order=f"i.i.d.: the stream's {n} batches in a permutation seeded by seed {config.seed}")
    replace_text(config.run_dir / "config.json", json.dumps(data, indent=2, default=str))  # (read by reports)


def run_multitask(config, manifest: dict, records=None, *, detector: str = "page-hinkley", on_step=None):
    """Learn the stream's batches in shuffled order; write losses.jsonl (stream order), config.json
    and checkpoint.pt into config.run_dir; return a streamer.config.RunSummary.

    `config` is a streamer.config.LearnConfig (its strategy is recorded as given, "multitask";
    strategy_options are ShuffledNaive's hyperparameters); `records` default to those rebuilt
    from the manifest. `max_batches` keeps the first batches of the stream, then shuffles them."""
    from streamer.config import RunSummary
    from streamer.learner import resolve_device
    from streamer.models import ModelRequest, build_model
    from streamer.step import prequential_step

    started = time.monotonic()
    device = resolve_device(config.device)
    _seed(config.seed)
    built = build_model(ModelRequest(config.model_name, config.model, config.model_options, manifest, device))
    try:
        strategy = ShuffledNaive(built.model, lr=config.resolved_lr, clip=config.clip, **dict(config.strategy_options))
    except TypeError as exc:
        raise ValueError(f"--set for strategy 'multitask': {exc}") from None
    if records is None:
        records = records_from_manifest(manifest)
    batches = stream_batches(records, built, config.streams, config.window, device)
    if config.max_batches:
        batches = batches[: config.max_batches]
    order = shuffled_order(len(batches), config.seed)
    _write_config(config, device, strategy, built, len(batches))
    results, trained_at = [None] * len(batches), [0] * len(batches)
    for step, index in enumerate(order):
        batch, truth = batches[index]
        results[index] = prequential_step(strategy, batch, truth, index)
        trained_at[index] = step
        if on_step:
            on_step()
    monitor = LiveMonitor(run=config.run_name, strategy=config.strategy, classes=config.classes, k=config.k,
                          from_fragment=config.from_fragment, total_batches=len(batches), detector=detector)
    with LossLogWriter(config.run_dir / "losses.jsonl") as log:
        for index, result in enumerate(results):
            log.write({**monitor.observe(result), "trained_at": trained_at[index]})
    checkpoint.save(config.run_dir / "checkpoint.pt", checkpoint.reference_checkpoint(
        config, model=strategy.model.state_dict(), strategy=strategy.state_dict(), rng=checkpoint.rng_state(),
        step=len(batches), order=order))
    return RunSummary(len(batches), sum(r.tokens for r in results), time.monotonic() - started,
                      "end_of_stream", {}, config.run_dir)
