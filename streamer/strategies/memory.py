"""Bounded episodic memories of (input window, target window) rows: reservoir sampling, or herding per segment."""

from __future__ import annotations

import random
from typing import Any

import torch

from streamer.strategies.base import Batch
from streamer.strategies.params import HyperparameterRepr

__all__ = ["ReservoirMemory", "HerdingMemory", "herding_order", "window_features", "sparse_rows",
           "write_sparsely"]


class ReservoirMemory(HyperparameterRepr):
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

    def __len__(self) -> int:
        return min(self._seen, self.capacity)

    @property
    def seen(self) -> int:
        return self._seen

    def offer(self, inputs_row: torch.Tensor, targets_row: torch.Tensor) -> int | None:
        """Offer one row; returns the slot it was written to, or None when it was not kept."""
        if self._inputs is None:
            self._inputs = inputs_row.new_empty((self.capacity, *inputs_row.shape))
            self._targets = targets_row.new_empty((self.capacity, *targets_row.shape))
        if self._seen < self.capacity:
            slot = self._seen
        else:
            slot = self._rng.randrange(self._seen + 1)  # uniform over 0..seen inclusive
        self._seen += 1
        if slot >= self.capacity:
            return None
        self._inputs[slot] = inputs_row
        self._targets[slot] = targets_row
        return slot

    def rows(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held rows at `index` (slots), or all of them; views are not handed out."""
        size = len(self)
        if size == 0:
            raise ValueError("the memory is empty")
        if index is None:
            return self._inputs[:size].clone(), self._targets[:size].clone()
        index = index.to(self._inputs.device)
        return self._inputs[index], self._targets[index]

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n rows, without replacement when the memory holds at least n (CPU generator)."""
        return self.rows(_sample_index(len(self), n, generator))

    def clear(self) -> None:
        """Forget every row; the replacement draws continue where they were."""
        self._seen = 0

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


def _sample_index(size: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """n indices into `size` rows, without replacement when size >= n (CPU generator)."""
    if size == 0:
        raise ValueError("cannot sample from an empty memory")
    if n <= size:
        return torch.randperm(size, generator=generator)[:n]
    return torch.randint(size, (n,), generator=generator)


def herding_order(features: torch.Tensor, m: int) -> torch.Tensor:
    """Greedy herding (iCaRL, Rebuffi et al. 2017, Alg. 4): m distinct row indices of `features` (n, d).

    The k-th pick is the row x minimising || mean - (x + sum of the k-1 earlier picks) / k ||, so
    the running mean of the picks follows the mean of all rows; ties go to the lowest index. Any
    prefix of the order is the herding choice of that size. Runs on the features' device, no sync.
    """
    n = features.shape[0]
    m = min(m, n)
    target = features.mean(dim=0)
    picked_sum = torch.zeros_like(target)
    taken = torch.zeros(n, dtype=torch.bool, device=features.device)
    order = []
    for k in range(1, m + 1):
        distance = ((target - (picked_sum + features) / k) ** 2).sum(dim=1)
        pick = distance.masked_fill(taken, float("inf")).argmin()
        order.append(pick)
        taken[pick] = True
        picked_sum = picked_sum + features[pick]
    return torch.stack(order) if order else torch.zeros(0, dtype=torch.int64, device=features.device)


@torch.no_grad()
def window_features(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """(n, w) windows -> (n, d): the mean over each window of `model.features` from a zero state.

    Run in eval mode (no dropout, so no global RNG draw); the model's mode is restored.
    """
    was_training = model.training
    model.eval()
    try:
        hidden, _ = model.features(inputs, model.initial_state(inputs.shape[0], inputs.device))
    finally:
        model.train(was_training)
    return hidden.mean(dim=1) if hidden.dim() == 3 else hidden


class HerdingMemory(HyperparameterRepr):
    """Exemplars chosen by herding within each segment of the stream, split evenly across segments.

    The stream has no classes to herd within, so segments (between boundaries the strategy finds)
    stand in for them. Rows offered while a segment is open go to a candidate reservoir of
    `capacity` rows. `close_segment(features)` (features of the candidates, in `candidates()`
    order) L2-normalises the features as iCaRL does, keeps m = capacity // segments candidates in
    herding order and cuts every earlier segment to the first m of its own herding order (its
    best m), so at most `capacity` exemplars plus `capacity` candidates are held. `sample` draws
    from the exemplars once a segment has closed, from the candidates before. A segment with no
    candidate is not counted; when segments outnumber capacity, the oldest are dropped.
    """

    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.seed = seed
        self._candidates = ReservoirMemory(capacity, seed=seed)
        self._inputs: torch.Tensor | None = None  # exemplars, segment after segment, each in herding order
        self._targets: torch.Tensor | None = None
        self._sizes: list[int] = []  # exemplars per closed segment, oldest first

    def __len__(self) -> int:
        """Rows that `sample` draws from."""
        return self.exemplars if self._sizes else len(self._candidates)

    @property
    def exemplars(self) -> int:
        return sum(self._sizes)

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        return tuple(self._sizes)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The open segment's candidate rows (copies), or None when it has none."""
        return self._candidates.rows() if len(self._candidates) else None

    def exemplar_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self._inputs is None else (self._inputs.clone(), self._targets.clone())

    def offer(self, inputs_row: torch.Tensor, targets_row: torch.Tensor) -> int | None:
        return self._candidates.offer(inputs_row, targets_row)

    def close_segment(self, features: torch.Tensor) -> None:
        candidates = self.candidates()
        if candidates is None:
            return
        if features.shape[0] != candidates[0].shape[0]:
            raise ValueError(f"{features.shape[0]} features for {candidates[0].shape[0]} candidates")
        per_segment = max(1, self.capacity // (len(self._sizes) + 1))
        unit = features / features.norm(dim=1, keepdim=True).clamp_min(1e-12)
        order = herding_order(unit, per_segment).to(candidates[0].device)
        inputs, targets, sizes, start = [], [], [], 0
        for size in self._sizes:  # each older segment keeps the prefix of its herding order
            keep = min(size, per_segment)
            inputs.append(self._inputs[start: start + keep])
            targets.append(self._targets[start: start + keep])
            sizes.append(keep)
            start += size
        inputs.append(candidates[0][order])
        targets.append(candidates[1][order])
        sizes.append(len(order))
        while sum(sizes) > self.capacity:  # only when segments outnumber capacity
            inputs.pop(0), targets.pop(0), sizes.pop(0)
        self._inputs, self._targets, self._sizes = torch.cat(inputs), torch.cat(targets), sizes
        self._candidates.clear()

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n rows, without replacement when there are at least n (CPU generator)."""
        if not self._sizes:
            return self._candidates.sample(n, generator)
        index = _sample_index(self.exemplars, n, generator).to(self._inputs.device)
        return self._inputs[index], self._targets[index]

    def state_dict(self) -> dict[str, Any]:
        return {
            "candidates": self._candidates.state_dict(),
            "inputs": None if self._inputs is None else self._inputs.clone(),
            "targets": None if self._targets is None else self._targets.clone(),
            "sizes": list(self._sizes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._candidates.load_state_dict(state["candidates"])
        self._inputs = None if state["inputs"] is None else state["inputs"].clone()
        self._targets = None if state["targets"] is None else state["targets"].clone()
        self._sizes = list(state["sizes"])


def sparse_rows(rows: int, p_write: float, generator: torch.Generator) -> list[int]:
    """The rows of a batch chosen for writing, each with probability p_write (one CPU draw per row)."""
    return (torch.rand(rows, generator=generator) < p_write).nonzero().flatten().tolist()


def write_sparsely(memory: ReservoirMemory | HerdingMemory, batch: Batch, p_write: float,
                   generator: torch.Generator) -> None:
    """Offer each row of the batch to the memory with probability p_write."""
    for row in sparse_rows(batch.inputs.shape[0], p_write, generator):
        memory.offer(batch.inputs[row], batch.targets[row])
