"""Naive online fine-tuning: one optimizer step per batch, nothing else."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from streamer.strategies.base import Batch, LearnStats, Prediction

__all__ = ["Naive"]


class Naive:
    """Online fine-tuning with Adam and per-step gradient clipping.

    The LSTM hidden state of each of the b parallel streams carries across
    batches (truncated back-propagation through time), as in CALM.
    """

    def __init__(self, model: nn.Module, lr: float = 2e-3, clip: float = 1.0, steps: int = 1):
        self.model = model
        self.lr = lr
        self.clip = clip
        self.steps = steps
        self._optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self._state = None  # carried hidden state, detached
        self._labels_known = None  # classifiers: the head columns scored (labels seen so far)

    def __repr__(self) -> str:
        return f"Naive(lr={self.lr}, clip={self.clip}, steps={self.steps})"

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _start_state(self, batch: Batch):
        """The carried state, or a fresh one; models without a recurrent state use None."""
        if self._state is None or self._state[0].shape[1] != batch.inputs.shape[0]:
            return self.model.initial_state(batch.inputs.shape[0], self._device())
        return self._state

    def _carry(self, next_state) -> None:
        """Keep the state after this batch, detached (truncated BPTT); None for stateless models."""
        self._state = None if next_state is None else tuple(s.detach() for s in next_state)

    def _loss(self, batch: Batch, state):
        loss, next_state, _ = self._scored(batch, state)
        return loss, next_state

    def _scored(self, batch: Batch, state):
        """(loss, next state, logits). A classifier's (b, capacity) logits keep the first labels_known
        columns (memory batches carry no count: the latest), so unseen labels' rows get no gradient."""
        logits, next_state = self.model(batch.inputs, state)
        if logits.dim() == 2:
            self._labels_known = batch.labels_known or self._labels_known
            logits = logits[:, : self._labels_known]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))
        return loss, next_state, logits

    @torch.no_grad()
    def predict(self, batch: Batch) -> Prediction:
        was_training = self.model.training
        self.model.eval()
        predicted = None
        if batch.labels_known is None:
            loss, _ = self._loss(batch, self._start_state(batch))
        else:  # a classifier: also each row's predicted label
            loss, _, logits = self._scored(batch, self._start_state(batch))
            predicted = logits.argmax(-1)
        self.model.train(was_training)
        return Prediction(loss=loss, predicted=predicted)

    def learn(self, batch: Batch) -> LearnStats:
        self.model.train()
        start = self._start_state(batch)
        for _ in range(self.steps):
            self._optimizer.zero_grad(set_to_none=True)
            loss, next_state = self._loss(batch, start)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self._optimizer.step()
        self._carry(next_state)
        return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach())

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "hidden": None if self._state is None else [s.clone() for s in self._state],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        hidden = state.get("hidden")
        self._state = None if hidden is None else tuple(s.clone() for s in hidden)
