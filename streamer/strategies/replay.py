"""Sparse experience replay (seed 004): write rows sparsely, replay a sample every r_interval rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.strategies.base import Batch, LearnStats
from streamer.strategies.memory import ReservoirMemory, write_sparsely
from streamer.strategies.naive import Naive

__all__ = ["Replay"]


class Replay(Naive):
    """Naive fine-tuning plus sparse replay from a reservoir memory.

    Every row of a learned batch is written to memory with probability p_write. Each time the
    count of learned rows (b per batch) crosses a multiple of r_interval, one extra update is made
    on n_replay rows sampled from memory, from a zero hidden state (they are separate windows);
    the carried state of the b streams is untouched. A replay due while the memory is still empty
    is skipped. Seeds: the write draws use `seed`, the replay samples `seed + 1`, the reservoir
    `seed + 2`.
    """

    def __init__(self, model: nn.Module, lr: float = 2e-3, clip: float = 1.0, p_write: float = 0.1,
                 r_interval: int = 1000, n_replay: int = 100, memory_size: int = 10_000, seed: int = 0):
        super().__init__(model, lr=lr, clip=clip)
        self.p_write = p_write
        self.r_interval = r_interval
        self.n_replay = n_replay
        self.memory_size = memory_size
        self.seed = seed
        self._memory = ReservoirMemory(memory_size, seed=seed + 2)
        self._write_generator = torch.Generator().manual_seed(seed)
        self._sample_generator = torch.Generator().manual_seed(seed + 1)
        self._rows_learned = 0
        self._replays = 0  # replay updates made

    def __repr__(self) -> str:
        return (f"Replay(lr={self.lr}, clip={self.clip}, p_write={self.p_write}, r_interval={self.r_interval}, "
                f"n_replay={self.n_replay}, memory_size={self.memory_size}, seed={self.seed})")

    @property
    def replays(self) -> int:
        return self._replays

    @property
    def memory(self) -> ReservoirMemory:
        return self._memory

    def learn(self, batch: Batch) -> LearnStats:
        stats = super().learn(batch)
        write_sparsely(self._memory, batch, self.p_write, self._write_generator)
        before = self._rows_learned
        self._rows_learned += batch.inputs.shape[0]
        due = self._rows_learned // self.r_interval - before // self.r_interval
        for _ in range(due):
            if len(self._memory):
                self._replay()
        return stats

    def _replay(self) -> None:
        inputs, targets = self._memory.sample(self.n_replay, self._sample_generator)
        self._optimizer.zero_grad(set_to_none=True)
        zero_state = self.model.initial_state(inputs.shape[0], self._device())
        loss, _ = self._loss(Batch(inputs=inputs, targets=targets), zero_state)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self._optimizer.step()
        self._replays += 1

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "memory": self._memory.state_dict(),
            "write_generator": self._write_generator.get_state(),
            "sample_generator": self._sample_generator.get_state(),
            "rows_learned": self._rows_learned,
            "replays": self._replays,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._memory.load_state_dict(state["memory"])
        self._write_generator.set_state(state["write_generator"])
        self._sample_generator.set_state(state["sample_generator"])
        self._rows_learned = state["rows_learned"]
        self._replays = state["replays"]
