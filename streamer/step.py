"""The prequential step: predict, record the loss, learn, return a StepResult."""

from __future__ import annotations

import math
import time
from typing import Iterable, Iterator

import torch

from monitor.results import BatchTruth, StepResult
from streamer.distributed import mean_over_ranks, ranks_count
from streamer.strategies.base import Batch, Strategy

__all__ = ["prequential_step", "run"]


def prequential_step(strategy: Strategy, batch: Batch, truth: BatchTruth | None, index: int,
                     last_loss: float = math.nan) -> StepResult:
    """Predict, record the loss, learn. A strategy never applies a non-finite update (a NaN or infinite
    loss or gradient): it leaves its parameters and optimizer state as they were and says so in
    LearnStats.skipped; a non-finite training loss or gradient norm is a skipped update too. A loss
    that is not finite is not recorded: `last_loss` (the previous batch's recorded loss) stands in for
    it, and for a non-finite training loss, so that the tracker, CALM's metrics and the loss log stay
    finite; the result says skipped=True.

    Ranks of a distributed learner (streamer.distributed) each learn their rows of the global batch:
    the recorded losses are the means over the ranks (equal tokens each: the global batch's mean),
    and `tokens` counts every rank's."""
    route = getattr(strategy, "route", None)
    if route is not None:  # only the `independent` oracle reads the ground truth, and says so
        route(truth)
    started = time.perf_counter()
    prediction = strategy.predict(batch)
    predicted_at = time.perf_counter()
    stats = strategy.learn(batch)
    learned = time.perf_counter()
    # GPU sync point: the step's wait for the device (ranks: one all-reduce before it). The strategy may
    # have waited already (Trainer's finiteness check, a drift boundary's loss.item()); the gates and
    # labels read below are copies of values this read has already waited for, not a second wait.
    loss, train_loss, grad_norm = mean_over_ranks(torch.stack(
        [prediction.loss.detach().float(), stats.loss.float(), stats.grad_norm.float()]
    )).tolist()
    skipped = bool(stats.skipped) or not (math.isfinite(train_loss) and math.isfinite(grad_norm))
    if not math.isfinite(loss):
        loss, skipped = last_loss, True
    if not math.isfinite(train_loss):
        train_loss = loss
    gates = None if stats.gates is None else tuple(stats.gates.detach().float().tolist())  # GPU copy (see above)
    predicted = labels = None
    if prediction.predicted is not None:
        predicted = tuple(prediction.predicted.tolist())  # GPU copy (see above)
        labels = tuple(batch.targets.reshape(-1).tolist())
    return StepResult(
        index=index, loss=loss, train_loss=train_loss, grad_norm=grad_norm,
        tokens=batch.tokens * ranks_count(), truth=truth, predict_s=predicted_at - started,
        learn_s=learned - predicted_at, finished_at=time.time(),
        gpu_memory_bytes=torch.cuda.memory_allocated() if batch.inputs.is_cuda else None,
        gates=gates, predicted=predicted, labels=labels, skipped=skipped,
    )


def run(strategy: Strategy, batches: Iterable[tuple[Batch, BatchTruth | None]]) -> Iterator[StepResult]:
    """Prequential evaluation over an in-memory sequence of batches."""
    last_loss = math.nan
    for index, (batch, truth) in enumerate(batches):
        result = prequential_step(strategy, batch, truth, index, last_loss)
        last_loss = result.loss
        yield result
