"""The prequential step: predict, record the loss, learn, return a StepResult."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from streamer.batching import BatchTruth
from streamer.strategies.base import Batch, Strategy

__all__ = ["StepResult", "prequential_step", "run"]


@dataclass(frozen=True)
class StepResult:
    index: int
    loss: float  # recorded loss in nats, from the parameters before learning on this batch
    train_loss: float
    grad_norm: float
    tokens: int
    truth: BatchTruth | None
    predict_s: float
    learn_s: float
    finished_at: float  # wall clock, seconds since the epoch
    gpu_memory_bytes: int | None = None  # allocated by torch, when on a GPU
    gates: tuple[float, ...] | None = None  # mixtures: the expert weights of this batch
    predicted: tuple[int, ...] | None = None  # classifiers: predicted label id per row
    labels: tuple[int, ...] | None = None  # classifiers: the revealed label id per row


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
