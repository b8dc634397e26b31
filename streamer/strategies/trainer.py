"""The online trainer every gradient strategy holds: scoring, the carried hidden state, one clipped step.

The LSTM hidden state of each of the b parallel streams carries across batches
(truncated back-propagation through time), as in CALM. A strategy holds an
`OnlineTrainer` (its model, optimizer, clip and carried state) and calls it inside
`predict` and `learn`; it overrides nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from streamer.strategies.base import Batch, LearnStats, Prediction

__all__ = ["OnlineTrainer", "all_finite", "batch_rows_changed", "fine_tune"]


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when every value of every tensor is finite (no NaN, no infinity).

    GPU sync point: whether an update may be applied is decided on the host."""
    return bool(torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all())


def batch_rows_changed(state, rows: int, dim: int = 1) -> bool:
    """True when there is no carried state or it was carried for another number of streams."""
    return state is None or state[0].shape[dim] != rows


class OnlineTrainer:
    """The model, its optimizer and gradient clip, and the carried (detached) hidden state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, clip: float):
        self.model = model
        self.optimizer = optimizer
        self.clip = clip
        self.hidden = None  # carried hidden state, detached; None for stateless models and before the first batch
        self.labels_known = None  # classifiers: the head columns scored (labels seen so far)
        self.skipped = False  # the last clip_and_step applied nothing (non-finite loss or gradients)

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def zero_state(self, rows: int):
        return self.model.initial_state(rows, self.device())

    def start_state(self, batch: Batch, dim: int = 1):
        """The carried state, or a fresh one; models without a recurrent state use None."""
        if batch_rows_changed(self.hidden, batch.inputs.shape[0], dim):
            return self.zero_state(batch.inputs.shape[0])
        return self.hidden

    def carry(self, next_state) -> None:
        """Keep the state after this batch, detached (truncated BPTT); None for stateless models."""
        self.hidden = None if next_state is None else tuple(s.detach() for s in next_state)

    def scored(self, batch: Batch, state):
        """(loss, next state, logits). A classifier's (b, capacity) logits keep the first labels_known
        columns (memory batches carry no count: the latest), so unseen labels' rows get no gradient."""
        logits, next_state = self.model(batch.inputs, state)
        if logits.dim() == 2:
            self.labels_known = batch.labels_known or self.labels_known
            logits = logits[:, : self.labels_known]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))
        return loss, next_state, logits

    def loss(self, batch: Batch, state):
        loss, next_state, _ = self.scored(batch, state)
        return loss, next_state

    @torch.no_grad()
    def predict(self, batch: Batch, state) -> Prediction:
        """The batch's loss from `state` in eval mode (a classifier's predicted labels too); changes nothing."""
        was_training = self.model.training
        self.model.eval()
        predicted = None
        if batch.labels_known is None:
            loss, _ = self.loss(batch, state)
        else:  # a classifier: also each row's predicted label
            loss, _, logits = self.scored(batch, state)
            predicted = logits.argmax(-1)
        self.model.train(was_training)
        return Prediction(loss=loss, predicted=predicted)

    def zero_state_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of separate windows (memory rows) from a zero state."""
        loss, _ = self.loss(Batch(inputs=inputs, targets=targets), self.zero_state(inputs.shape[0]))
        return loss

    def clip_and_step(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Clip the accumulated gradients, step the optimizer; the norm before clipping. When `loss` or
        the gradients are not finite the update is skipped: the gradients are dropped, parameters and
        optimizer state stay as they were, and `skipped` says so."""
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.skipped = not all_finite(grad_norm, *(() if loss is None else (loss,)))
        if self.skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        return grad_norm

    def step_on(self, loss: torch.Tensor) -> torch.Tensor:
        """One clipped update on `loss` alone (replay updates), skipped when not finite; the norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return self.clip_and_step(loss)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "hidden": None if self.hidden is None else [s.clone() for s in self.hidden],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        hidden = state.get("hidden")
        self.hidden = None if hidden is None else tuple(s.clone() for s in hidden)


def fine_tune(trainer: OnlineTrainer, batch: Batch, start, steps: int) -> LearnStats:
    """`steps` clipped updates on the batch from `start`, then carry the state after it. A non-finite
    update is skipped and ends the batch's updates (skipped=True); the carried state then stays too."""
    trainer.model.train()
    for _ in range(steps):
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, next_state = trainer.loss(batch, start)
        loss.backward()
        grad_norm = trainer.clip_and_step(loss)
        if trainer.skipped:
            return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach(), skipped=True)
    trainer.carry(next_state)
    return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach())
