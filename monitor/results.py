"""What monitor/ consumes: torch-free values a learner hands over after each learned batch.

The learner builds a `StepResult` per batch; every consumer in monitor/ (the CALM tracker,
the Prometheus sink, the loss log, the view, the reports) reads only these plain values.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchTruth", "StepResult"]


@dataclass(frozen=True)
class BatchTruth:
    """The majority class of a batch's input tokens and its largest fragment, from headers
    (evaluation only: the model path never sees it)."""

    class_name: str
    fragment: int


@dataclass(frozen=True)
class StepResult:
    """One prequentially learned batch: scored first, then learned."""

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
    skipped: bool = False  # the update was skipped (non-finite loss or gradients); the parameters stayed
