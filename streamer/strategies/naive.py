"""Naive online fine-tuning: one optimizer step per batch, nothing else."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.trainer import OnlineTrainer, adam, fine_tune

__all__ = ["Naive"]


class Naive(HyperparameterRepr):
    """Online fine-tuning with Adam and per-step gradient clipping.

    The LSTM hidden state of each of the b parallel streams carries across
    batches (truncated back-propagation through time), as in CALM. With dropout 0 the
    prediction's training-mode forward also serves the first update step (one forward a
    batch: OnlineTrainer.shares_forward); with dropout > 0 the score is an eval-mode forward.
    """

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, steps: int = 1):
        self.model = model
        self.lr = lr
        self.clip = clip
        self.steps = steps
        self._trainer = OnlineTrainer(model, adam(model.parameters(), lr), clip)

    def _device(self) -> torch.device:
        return self._trainer.device()

    def _start_state(self, batch: Batch):
        """The carried state, or a fresh one (streamer.multitask.ShuffledNaive replaces it)."""
        return self._trainer.start_state(batch)

    def predict(self, batch: Batch) -> Prediction:
        return self._trainer.predict(batch, self._start_state(batch))

    def learn(self, batch: Batch) -> LearnStats:
        return fine_tune(self._trainer, batch, self._start_state(batch), self.steps)

    def state_dict(self) -> dict[str, Any]:
        return self._trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
