"""The prequential step: predict, record the loss, learn, return a StepResult."""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from monitor.results import BatchTruth, StepResult
from streamer.strategies.base import Batch, Strategy

__all__ = ["prequential_step", "run"]


def prequential_step(strategy: Strategy, batch: Batch, truth: BatchTruth | None, index: int) -> StepResult:
    route = getattr(strategy, "route", None)
    if route is not None:  # only the `independent` oracle reads the ground truth, and says so
        route(truth)
    started = time.perf_counter()
    prediction = strategy.predict(batch)
    predicted_at = time.perf_counter()
    stats = strategy.learn(batch)
    learned = time.perf_counter()
    # GPU sync point: the one read of device values per step.
    loss, train_loss, grad_norm = torch.stack(
        [prediction.loss.detach().float(), stats.loss.float(), stats.grad_norm.float()]
    ).tolist()
    gates = None if stats.gates is None else tuple(stats.gates.detach().float().tolist())
    predicted = labels = None
    if prediction.predicted is not None:
        predicted = tuple(prediction.predicted.tolist())
        labels = tuple(batch.targets.reshape(-1).tolist())
    return StepResult(
        index=index, loss=loss, train_loss=train_loss, grad_norm=grad_norm,
        tokens=batch.tokens, truth=truth, predict_s=predicted_at - started,
        learn_s=learned - predicted_at, finished_at=time.time(),
        gpu_memory_bytes=torch.cuda.memory_allocated() if batch.inputs.is_cuda else None,
        gates=gates, predicted=predicted, labels=labels,
    )


def run(strategy: Strategy, batches: Iterable[tuple[Batch, BatchTruth | None]]) -> Iterator[StepResult]:
    """Prequential evaluation over an in-memory sequence of batches."""
    for index, (batch, truth) in enumerate(batches):
        yield prequential_step(strategy, batch, truth, index)
