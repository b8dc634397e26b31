"""Sparse experience replay (seed 004): write rows sparsely, replay a sample every r_interval rows."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from streamer import distributed
from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.boundary import Boundaries
from streamer.strategies.memory import HerdingMemory, ReservoirMemory, window_features, write_sparsely
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.trainer import OnlineTrainer, adam, fine_tune

__all__ = ["Replay", "SparseReplay", "close_segment", "learn_and_replay", "SELECTIONS"]

SELECTIONS = ("reservoir", "herding")


class SparseReplay(HyperparameterRepr):
    """The replay component: sparse writes to a bounded memory, a replay update each r_interval rows.

    Every row of a learned batch is written with probability p_write. Each time the count of
    learned rows (b per batch) crosses a multiple of r_interval, one extra update is made on
    n_replay rows sampled from memory; a replay due while the memory is empty is skipped. Seeds:
    the write draws use `seed`, the replay samples `seed + 1`, the memory's own draws `seed + 2`.

    Ranks (streamer.distributed): the hyperparameters are the learner's, not a rank's. Each of N
    ranks counts the global batch's rows (its own b/N times N), so the replays fall at one process's
    steps; it samples its share of n_replay rows (n_replay/N, at least 1) and its gradient is averaged
    with the others', so an update is made on n_replay rows in all; and it keeps memory_size/N rows of
    its own streams (each row held with one process's probability). Its generators are seeded alike
    on every rank: their write draws match, so every rank's memory fills (and a replay is due or
    skipped) at the same steps, and the gradient averages meet. (Before, N ranks replayed N times
    less often, on N x n_replay rows, from N x memory_size.)
    """

    def __init__(self, p_write: float, r_interval: int, n_replay: int, memory_size: int,
                 selection: str = "reservoir", seed: int = 0):
        if selection not in SELECTIONS:
            raise ValueError(f"unknown selection {selection!r}; choose from {', '.join(SELECTIONS)}")
        self.p_write = p_write
        self.r_interval = r_interval
        self.n_replay = n_replay
        self.memory_size = memory_size
        self.selection = selection
        self.seed = seed
        ranks = distributed.current()
        self._world, rank = (ranks.world, ranks.rank) if ranks is not None else (1, 0)
        self._n_sampled = max(1, _share(n_replay, self._world, rank))  # this rank's share of a replay's rows
        memory = HerdingMemory if selection == "herding" else ReservoirMemory
        self.memory = memory(max(1, _share(memory_size, self._world, rank)), seed=seed + 2)
        self.write_generator = torch.Generator().manual_seed(seed)
        self.sample_generator = torch.Generator().manual_seed(seed + 1)
        self.rows_learned = 0
        self.replays = 0  # replay updates made

    def write(self, batch: Batch) -> None:
        write_sparsely(self.memory, batch, self.p_write, self.write_generator)

    def after_learn(self, batch: Batch, trainer: OnlineTrainer,
                    replay_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
        """Count the batch's rows and make the replay updates now due, on replay_loss(inputs, targets);
        True when one of them was skipped (not finite: OnlineTrainer.clip_and_step)."""
        skipped = False
        before = self.rows_learned
        self.rows_learned += batch.inputs.shape[0] * self._world  # ranks: the global batch's rows
        due = self.rows_learned // self.r_interval - before // self.r_interval
        for _ in range(due):
            if len(self.memory):
                inputs, targets = self.memory.sample(self._n_sampled, self.sample_generator)
                trainer.step_on(replay_loss(inputs, targets))
                skipped |= trainer.skipped
                self.replays += not trainer.skipped
        return skipped

    def state_dict(self) -> dict[str, Any]:
        return {
            "memory": self.memory.state_dict(),
            "write_generator": self.write_generator.get_state(),
            "sample_generator": self.sample_generator.get_state(),
            "rows_learned": self.rows_learned,
            "replays": self.replays,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state["memory"])
        self.write_generator.set_state(state["write_generator"])
        self.sample_generator.set_state(state["sample_generator"])
        self.rows_learned = state["rows_learned"]
        self.replays = state["replays"]


def _share(total: int, world: int, rank: int) -> int:
    """Rank `rank`'s part of `total` split over `world` ranks as evenly as whole numbers go."""
    return total // world + (rank < total % world)


def close_segment(memory: ReservoirMemory | HerdingMemory, model: nn.Module) -> None:
    """Herding closes the segment on the current model's features of its candidates (reservoir: nothing)."""
    if isinstance(memory, HerdingMemory):
        candidates = memory.candidates()
        if candidates is not None:
            memory.close_segment(window_features(model, candidates[0]))


def learn_and_replay(trainer: OnlineTrainer, replay: SparseReplay, batch: Batch, replay_loss: Callable, *,
                     write: Callable[[Batch], None] | None = None, boundaries: Boundaries | None = None,
                     at_boundary: Callable[[], None] | None = None) -> LearnStats:
    """The learn step of replay and of the strategies built on its memory (kd-logit, kd-rep, mbpa): one
    fine-tuning update on the batch; unless it was skipped (a non-finite update: nothing of the batch is
    kept, no boundary looked for), the batch offered to the memory (`write`, default replay.write), a replay
    update when one is due (its loss: `replay_loss`), and `at_boundary()` where `boundaries` find one on the
    batch's loss. The stats' `skipped` then says whether the replay update was."""
    stats = fine_tune(trainer, batch, trainer.start_state(batch), 1)
    if stats.skipped:
        return stats
    (write or replay.write)(batch)
    replay_skipped = replay.after_learn(batch, trainer, replay_loss)
    if boundaries is not None and boundaries.update(stats.loss):
        at_boundary()
    return replace(stats, skipped=replay_skipped)


class Replay(HyperparameterRepr):
    """Naive fine-tuning plus sparse replay from a bounded memory (`SparseReplay`).

    Ranks (streamer.distributed): the model and optimizer are one (every update's gradient is averaged
    over the ranks); the memory and its generators are kept per rank, filled from the rank's own rows
    (the same seeds: the ranks make their replay updates at the same steps, each from its own memory);
    r_interval, n_replay and memory_size are the learner's, split over the ranks (`SparseReplay`).

    Replay updates start the sampled rows from a zero hidden state (they are separate
    windows); the carried state of the b streams is untouched.

    selection="reservoir" (default): a uniform reservoir of memory_size rows; `boundary` is unused.
    selection="herding" (seed 001, iCaRL): segments end at boundaries found on the training loss
    (`boundary`, as for EWC: page-hinkley | adwin | kswin | every:N); at each, the segment's
    candidate rows are herded on the current model's window features (`HerdingMemory`) and the
    memory_size exemplars are split evenly across segments.
    """

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, p_write: float = 0.1,
                 r_interval: int = 1000, n_replay: int = 100, memory_size: int = 10_000,
                 selection: str = "reservoir", boundary: str = "page-hinkley", seed: int = 0):
        self.model = model
        self.lr = lr
        self.clip = clip
        self._trainer = OnlineTrainer(model, adam(model.parameters(), lr), clip)
        self._replay = SparseReplay(p_write, r_interval, n_replay, memory_size, selection, seed)
        self.p_write = p_write
        self.r_interval = r_interval
        self.n_replay = n_replay
        self.memory_size = memory_size
        self.selection = selection
        self.boundary = boundary
        self.seed = seed
        self._boundaries = Boundaries(boundary) if selection == "herding" else None

    @property
    def replays(self) -> int:
        return self._replay.replays

    @property
    def memory(self) -> ReservoirMemory | HerdingMemory:
        return self._replay.memory

    @property
    def boundaries_at(self) -> tuple[int, ...]:
        """0-based learn index after which each boundary fell (empty when none are looked for)."""
        return () if self._boundaries is None else self._boundaries.found_at

    def predict(self, batch: Batch) -> Prediction:
        return self._trainer.predict(batch, self._trainer.start_state(batch))

    def learn(self, batch: Batch) -> LearnStats:
        return learn_and_replay(self._trainer, self._replay, batch, self._trainer.zero_state_loss,
                                boundaries=self._boundaries,
                                at_boundary=lambda: close_segment(self._replay.memory, self.model))

    def state_dict(self) -> dict[str, Any]:
        state = self._trainer.state_dict() | self._replay.state_dict()
        if self._boundaries is not None:
            state["boundaries"] = self._boundaries.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
        self._replay.load_state_dict(state)
        if self._boundaries is not None:
            self._boundaries.load_state_dict(state["boundaries"])
