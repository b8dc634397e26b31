"""Sparse experience replay (seed 004): write rows sparsely, replay a sample every r_interval rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.strategies.base import Batch, LearnStats
from streamer.strategies.boundary import Boundaries
from streamer.strategies.memory import HerdingMemory, ReservoirMemory, window_features, write_sparsely
from streamer.strategies.naive import Naive

__all__ = ["Replay", "SELECTIONS"]

SELECTIONS = ("reservoir", "herding")


class Replay(Naive):
    """Naive fine-tuning plus sparse replay from a bounded memory.

    Every row of a learned batch is written to memory with probability p_write. Each time the
    count of learned rows (b per batch) crosses a multiple of r_interval, one extra update is made
    on n_replay rows sampled from memory, from a zero hidden state (they are separate windows);
    the carried state of the b streams is untouched. A replay due while the memory is still empty
    is skipped. Seeds: the write draws use `seed`, the replay samples `seed + 1`, the memory's
    own draws `seed + 2`.

    selection="reservoir" (default): a uniform reservoir of memory_size rows; `boundary` is unused.
    selection="herding" (seed 001, iCaRL): segments end at boundaries found on the training loss
    (`boundary`, as for EWC: page-hinkley | adwin | kswin | every:N); at each, the segment's
    candidate rows are herded on the current model's window features (`HerdingMemory`) and the
    memory_size exemplars are split evenly across segments.
    """

    _needs_boundaries = False  # subclasses that act at boundaries whatever the selection set this

    def __init__(self, model: nn.Module, lr: float = 2e-3, clip: float = 1.0, p_write: float = 0.1,
                 r_interval: int = 1000, n_replay: int = 100, memory_size: int = 10_000,
                 selection: str = "reservoir", boundary: str = "page-hinkley", seed: int = 0):
        super().__init__(model, lr=lr, clip=clip)
        if selection not in SELECTIONS:
            raise ValueError(f"unknown selection {selection!r}; choose from {', '.join(SELECTIONS)}")
        self.p_write = p_write
        self.r_interval = r_interval
        self.n_replay = n_replay
        self.memory_size = memory_size
        self.selection = selection
        self.boundary = boundary
        self.seed = seed
        memory = HerdingMemory if selection == "herding" else ReservoirMemory
        self._memory = memory(memory_size, seed=seed + 2)
        uses_boundaries = selection == "herding" or self._needs_boundaries
        self._boundaries = Boundaries(boundary) if uses_boundaries else None
        self._write_generator = torch.Generator().manual_seed(seed)
        self._sample_generator = torch.Generator().manual_seed(seed + 1)
        self._rows_learned = 0
        self._replays = 0  # replay updates made

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(lr={self.lr}, clip={self.clip}, p_write={self.p_write}, "
                f"r_interval={self.r_interval}, n_replay={self.n_replay}, memory_size={self.memory_size}, "
                f"selection={self.selection!r}, boundary={self.boundary!r}, seed={self.seed})")

    @property
    def replays(self) -> int:
        return self._replays

    @property
    def memory(self) -> ReservoirMemory | HerdingMemory:
        return self._memory

    @property
    def boundaries_at(self) -> tuple[int, ...]:
        """0-based learn index after which each boundary fell (empty when none are looked for)."""
        return () if self._boundaries is None else self._boundaries.found_at

    def learn(self, batch: Batch) -> LearnStats:
        stats = super().learn(batch)
        self._write(batch)
        before = self._rows_learned
        self._rows_learned += batch.inputs.shape[0]
        due = self._rows_learned // self.r_interval - before // self.r_interval
        for _ in range(due):
            if len(self._memory):
                self._replay()
        if self._boundaries is not None and self._boundaries.update(stats.loss):
            self._at_boundary()
        return stats

    def _write(self, batch: Batch) -> None:
        write_sparsely(self._memory, batch, self.p_write, self._write_generator)

    def _at_boundary(self) -> None:
        """Herding closes the segment on the current model's features of its candidates."""
        if self.selection == "herding":
            candidates = self._memory.candidates()
            if candidates is not None:
                self._memory.close_segment(window_features(self.model, candidates[0]))

    def _replay_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        zero_state = self.model.initial_state(inputs.shape[0], self._device())
        loss, _ = self._loss(Batch(inputs=inputs, targets=targets), zero_state)
        return loss

    def _replay(self) -> None:
        inputs, targets = self._memory.sample(self.n_replay, self._sample_generator)
        self._optimizer.zero_grad(set_to_none=True)
        self._replay_loss(inputs, targets).backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self._optimizer.step()
        self._replays += 1

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict() | {
            "memory": self._memory.state_dict(),
            "write_generator": self._write_generator.get_state(),
            "sample_generator": self._sample_generator.get_state(),
            "rows_learned": self._rows_learned,
            "replays": self._replays,
        }
        if self._boundaries is not None:
            state["boundaries"] = self._boundaries.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._memory.load_state_dict(state["memory"])
        self._write_generator.set_state(state["write_generator"])
        self._sample_generator.set_state(state["sample_generator"])
        self._rows_learned = state["rows_learned"]
        self._replays = state["replays"]
        if self._boundaries is not None:
            self._boundaries.load_state_dict(state["boundaries"])
