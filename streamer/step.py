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


def prequential_step(strategy: Strategy, batch: Batch, truth: BatchTruth | None, index: int) -> StepResult:
    started = time.perf_counter()
    prediction = strategy.predict(batch)
    predicted = time.perf_counter()
    stats = strategy.learn(batch)
    learned = time.perf_counter()
    # GPU sync point: the one read of device values per step.
    loss, train_loss, grad_norm = torch.stack(
        [prediction.loss.detach().float(), stats.loss.float(), stats.grad_norm.float()]
    ).tolist()
    return StepResult(
        index=index, loss=loss, train_loss=train_loss, grad_norm=grad_norm,
        tokens=batch.tokens, truth=truth, predict_s=predicted - started,
        learn_s=learned - predicted, finished_at=time.time(),
        gpu_memory_bytes=torch.cuda.memory_allocated() if batch.inputs.is_cuda else None,
    )


def run(strategy: Strategy, batches: Iterable[tuple[Batch, BatchTruth | None]]) -> Iterator[StepResult]:
    """Prequential evaluation over an in-memory sequence of batches."""
    for index, (batch, truth) in enumerate(batches):
        yield prequential_step(strategy, batch, truth, index)
