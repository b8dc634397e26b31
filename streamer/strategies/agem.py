"""A-GEM (seeds 002/004): keep the update from raising the loss on a reference batch from memory."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.memory import ReservoirMemory, write_sparsely
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.trainer import OnlineTrainer, adam, all_finite

__all__ = ["AGEM", "project"]


def project(g: torch.Tensor, g_ref: torch.Tensor) -> torch.Tensor:
    """g - (g.g_ref / g_ref.g_ref) g_ref when g.g_ref < 0, else g (flat vectors, no device sync)."""
    dot = torch.dot(g, g_ref)
    scale = torch.where(dot < 0, dot / torch.dot(g_ref, g_ref).clamp_min(1e-30), torch.zeros_like(dot))
    return g - scale * g_ref


class AGEM(HyperparameterRepr):
    """Naive fine-tuning whose gradient is projected against a reference gradient from memory.

    Ranks (streamer.distributed): the memory is kept per rank (its own rows) and each rank projects
    its own gradient against its own reference; the projected gradients are then averaged, so the
    model stays one (not equal to one process's A-GEM, which projects the global gradient).

    After the gradient g on the current batch (carried hidden state), n_ref rows are sampled from
    the reservoir memory and their gradient g_ref is computed from a zero hidden state. If
    g.g_ref < 0, g becomes g - (g.g_ref / g_ref.g_ref) g_ref over all parameters flattened; then
    it is clipped and applied. `grad_norm` is the norm of the applied gradient before clipping.
    The batch's rows are written to memory afterwards (probability p_write each), so the reference
    never contains the batch itself. Seeds: writes `seed`, reference samples `seed + 1`, reservoir
    `seed + 2`.
    """

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, p_write: float = 0.1,
                 n_ref: int = 64, memory_size: int = 10_000, seed: int = 0):
        self.model = model
        self.lr = lr
        self.clip = clip
        self._trainer = OnlineTrainer(model, adam(model.parameters(), lr), clip)
        self.p_write = p_write
        self.n_ref = n_ref
        self.memory_size = memory_size
        self.seed = seed
        self._memory = ReservoirMemory(memory_size, seed=seed + 2)
        self._write_generator = torch.Generator().manual_seed(seed)
        self._sample_generator = torch.Generator().manual_seed(seed + 1)
        self._projections = torch.zeros((), dtype=torch.int64)  # on the device after the first step

    @property
    def projections(self) -> int:
        """How many updates were projected. Reading it syncs with the device."""
        return int(self._projections.item())

    @property
    def memory(self) -> ReservoirMemory:
        return self._memory

    def _gradient(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.model.parameters()])

    def _set_gradient(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.model.parameters():
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def predict(self, batch: Batch) -> Prediction:
        return self._trainer.predict(batch, self._trainer.start_state(batch))

    def learn(self, batch: Batch) -> LearnStats:
        trainer = self._trainer
        self.model.train()
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, next_state = trainer.loss(batch, trainer.start_state(batch))
        loss.backward()
        if not all_finite(loss):  # before the reference sample draws: a skipped batch changes nothing
            trainer.optimizer.zero_grad(set_to_none=True)
            return LearnStats(loss=loss.detach(), grad_norm=torch.full((), math.nan), skipped=True)
        if len(self._memory):
            g = self._gradient()
            inputs, targets = self._memory.sample(self.n_ref, self._sample_generator)
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.zero_state_loss(inputs, targets).backward()
            g_ref = self._gradient()
            self._projections = self._projections.to(g.device) + (torch.dot(g, g_ref) < 0)
            self._set_gradient(project(g, g_ref))
        grad_norm = trainer.clip_and_step(loss)
        if trainer.skipped:
            return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach(), skipped=True)
        trainer.carry(next_state)
        write_sparsely(self._memory, batch, self.p_write, self._write_generator)
        return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach())

    def state_dict(self) -> dict[str, Any]:
        return self._trainer.state_dict() | {
            "memory": self._memory.state_dict(),
            "write_generator": self._write_generator.get_state(),
            "sample_generator": self._sample_generator.get_state(),
            "projections": self._projections.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
        self._memory.load_state_dict(state["memory"])
        self._write_generator.set_state(state["write_generator"])
        self._sample_generator.set_state(state["sample_generator"])
        self._projections = state["projections"].clone()
