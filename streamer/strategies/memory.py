"""A bounded episodic memory of (input window, target window) rows, kept by reservoir sampling."""

from __future__ import annotations

import random
from typing import Any

import torch

from streamer.strategies.base import Batch

__all__ = ["ReservoirMemory", "write_sparsely"]


class ReservoirMemory:
    """Vitter's algorithm R: after t offers, every offered row is held with probability capacity / t.

    Rows are stored in two preallocated (capacity, w) tensors on the device of the first row offered.
    The replacement draws come from a private `random.Random(seed)`, saved in `state_dict`, so a
    restored memory makes the same next choices.
    """

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.seed = seed
        self._rng = random.Random(seed)
        self._seen = 0  # rows offered so far
        self._inputs: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"ReservoirMemory(capacity={self.capacity}, seed={self.seed})"

    def __len__(self) -> int:
        return min(self._seen, self.capacity)

    @property
    def seen(self) -> int:
        return self._seen

    def offer(self, inputs_row: torch.Tensor, targets_row: torch.Tensor) -> None:
        if self._inputs is None:
            self._inputs = inputs_row.new_empty((self.capacity, *inputs_row.shape))
            self._targets = targets_row.new_empty((self.capacity, *targets_row.shape))
        if self._seen < self.capacity:
            slot = self._seen
        else:
            slot = self._rng.randrange(self._seen + 1)  # uniform over 0..seen inclusive
        self._seen += 1
        if slot < self.capacity:
            self._inputs[slot] = inputs_row
            self._targets[slot] = targets_row

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n rows, without replacement when the memory holds at least n (CPU generator)."""
        size = len(self)
        if size == 0:
            raise ValueError("cannot sample from an empty memory")
        if n <= size:
            index = torch.randperm(size, generator=generator)[:n]
        else:
            index = torch.randint(size, (n,), generator=generator)
        index = index.to(self._inputs.device)
        return self._inputs[index], self._targets[index]

    def state_dict(self) -> dict[str, Any]:
        size = len(self)
        return {
            "seen": self._seen,
            "rng": self._rng.getstate(),
            "inputs": None if self._inputs is None else self._inputs[:size].clone(),
            "targets": None if self._targets is None else self._targets[:size].clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seen = state["seen"]
        self._rng.setstate(state["rng"])
        if state["inputs"] is None:
            self._inputs = self._targets = None
            return
        inputs, targets = state["inputs"], state["targets"]
        self._inputs = inputs.new_empty((self.capacity, *inputs.shape[1:]))
        self._targets = targets.new_empty((self.capacity, *targets.shape[1:]))
        self._inputs[: len(inputs)] = inputs
        self._targets[: len(targets)] = targets


def write_sparsely(memory: ReservoirMemory, batch: Batch, p_write: float, generator: torch.Generator) -> None:
    """Offer each row of the batch to the memory with probability p_write (one CPU draw per row)."""
    chosen = (torch.rand(batch.inputs.shape[0], generator=generator) < p_write).nonzero().flatten().tolist()
    for row in chosen:
        memory.offer(batch.inputs[row], batch.targets[row])
