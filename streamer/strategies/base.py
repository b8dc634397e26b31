"""The Strategy protocol and the values that cross it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Batch", "Prediction", "LearnStats", "Strategy"]


@dataclass(frozen=True)
class Batch:
    """b x w windows of token ids; targets are the inputs shifted by one.

    A batch carries no ground truth: the model path never sees headers.
    """

    inputs: torch.Tensor  # (b, w) int64; for classifiers (b, L) token ids, padded with the model's pad id
    targets: torch.Tensor  # (b, w) int64; for classifiers (b,) label ids, revealed after the prediction
    labels_known: int | None = None  # classifiers: labels seen so far in the stream (the head's width)

    @property
    def tokens(self) -> int:
        return self.targets.numel()


@dataclass(frozen=True)
class Prediction:
    loss: torch.Tensor  # scalar: mean cross-entropy in nats, still on the device
    predicted: torch.Tensor | None = None  # classifiers: (b,) predicted label ids


@dataclass(frozen=True)
class LearnStats:
    loss: torch.Tensor  # scalar training loss of the update (not the recorded loss)
    grad_norm: torch.Tensor  # scalar, before clipping
    gates: torch.Tensor | None = None  # mixtures: (n,) expert weights used for this batch, for CALM Fig. 1d
    skipped: bool = False  # an update was not applied: its loss or gradients were not finite


@runtime_checkable
class Strategy(Protocol):
    """predict scores without changing anything; learn updates from the batch."""

    def predict(self, batch: Batch) -> Prediction: ...

    def learn(self, batch: Batch) -> LearnStats: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
