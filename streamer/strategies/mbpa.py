"""MbPA++ (de Masson d'Autume et al. 2019; seed 004): sparse replay in training, local adaptation at prediction."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.distill import frozen_copy
from streamer.strategies.memory import sparse_rows, window_features
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.replay import SparseReplay, learn_and_replay
from streamer.strategies.trainer import OnlineTrainer, adam

__all__ = ["MbPA"]


class MbPA(HyperparameterRepr):
    """Sparse experience replay while learning; memory-based local adaptation while predicting.

    Ranks (streamer.distributed): the episodic memory and its keys are kept per rank (its own rows);
    learning updates are averaged over the ranks (one model); each rank adapts locally from its own
    memory when it predicts, and the recorded loss is the ranks' mean. The replay schedule and sizes are
    the learner's, split over the ranks (`SparseReplay`: memory_size/N rows a rank).

    Learning is Replay's (a `SparseReplay` component: reservoir memory, p_write, r_interval, n_replay, seeds). Each written row
    is stored with a key: the mean over its window of the top-layer features of a key network, a
    frozen copy of the model taken at construction and never trained (the paper's frozen BERT
    key encoder; a fixed encoder keeps stored keys comparable with new ones forever), run from a
    zero state.

    predict, once the memory holds a row: the batch's key is the mean of its rows' keys (one
    adaptation per batch: the b streams of a CALM batch share their class); its `neighbours`
    nearest memory rows (Euclidean distance between keys, all rows if fewer) are the local
    training set. `local_steps` plain gradient steps (rate `local_lr`, gradient clipped at `clip`)
    on their loss, from a zero state, plus local_lambda * ||theta - theta_base||^2, give adapted
    weights; the batch is scored with them from the carried state, then the base weights are
    copied back exactly. The steps use torch.autograd.grad (no .grad is touched, no optimizer
    state), run in training mode (cuDNN's LSTM backward needs it) under torch.random.fork_rng, so
    a prediction changes nothing, the global RNG included. With an empty memory it is Naive's.

    Paper settings (seed 004): neighbours = 25, local_steps = 10, local_lambda = 1e-3. local_lr
    is not given there; 0.1 was measured (one seed, not tuned further) on a 401-batch stream of
    three word-salad languages (b=4, w=20, 2x64 LSTM, replay p_write=0.2, r_interval=40,
    n_replay=16, memory 400): mean prequential loss 3.32 without local steps, 3.28 / 3.18 / 3.12 /
    3.07 / 3.37 with local_lr 0.01 / 0.05 / 0.1 / 0.2 / 1.0 (1.0 overshoots early on). Predicting
    then costs local_steps forward-backward passes over the neighbours: about 20x Replay's time.
    """

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, p_write: float = 0.1,
                 r_interval: int = 1000, n_replay: int = 100, memory_size: int = 10_000, neighbours: int = 25,
                 local_steps: int = 10, local_lambda: float = 1e-3, local_lr: float = 0.1, seed: int = 0):
        self.model = model
        self.lr = lr
        self.clip = clip
        self._trainer = OnlineTrainer(model, adam(model.parameters(), lr), clip)
        self._replay = SparseReplay(p_write, r_interval, n_replay, memory_size, "reservoir", seed)
        self.p_write = p_write
        self.r_interval = r_interval
        self.n_replay = n_replay
        self.memory_size = memory_size
        self.seed = seed
        if not callable(getattr(model, "features", None)):
            raise ValueError(f"mbpa needs a model with features(inputs, state); {type(model).__name__} has none")
        if neighbours < 1:
            raise ValueError(f"neighbours must be at least 1, got {neighbours}")
        self.neighbours = neighbours
        self.local_steps = local_steps
        self.local_lambda = local_lambda
        self.local_lr = local_lr
        self._key_network = frozen_copy(model)
        self._keys: torch.Tensor | None = None  # (memory_size, d): row i is the key of memory slot i

    @property
    def replays(self) -> int:
        return self._replay.replays

    @property
    def memory(self):
        return self._replay.memory

    def keys(self, inputs: torch.Tensor) -> torch.Tensor:
        """(n, w) windows -> (n, d) keys from the frozen key network."""
        return window_features(self._key_network, inputs)

    def _write(self, batch: Batch) -> None:
        rows = sparse_rows(batch.inputs.shape[0], self.p_write, self._replay.write_generator)
        if not rows:
            return
        keys = self.keys(batch.inputs[torch.tensor(rows, device=batch.inputs.device)])
        for key, row in zip(keys, rows):
            slot = self._replay.memory.offer(batch.inputs[row], batch.targets[row])
            if slot is not None:
                if self._keys is None:
                    self._keys = keys.new_empty((self.memory_size, keys.shape[1]))
                self._keys[slot] = key

    def nearest(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory rows (inputs, targets) nearest to the batch's mean key, nearest first."""
        held = len(self._replay.memory)
        query = self.keys(batch.inputs).mean(dim=0)
        distance = ((self._keys[:held] - query) ** 2).sum(dim=1)
        index = torch.topk(distance, min(self.neighbours, held), largest=False).indices
        return self._replay.memory.rows(index)

    def _predict_base(self, batch: Batch) -> Prediction:
        return self._trainer.predict(batch, self._trainer.start_state(batch))

    def predict(self, batch: Batch) -> Prediction:
        if len(self._replay.memory) == 0 or self.local_steps == 0:
            return self._predict_base(batch)
        inputs, targets = self.nearest(batch)
        params = [p for p in self.model.parameters() if p.requires_grad]
        base = [p.detach().clone() for p in params]
        try:
            self._adapt(params, base, inputs, targets)
            return self._predict_base(batch)
        finally:
            with torch.no_grad():
                for p, saved in zip(params, base):
                    p.copy_(saved)

    def _adapt(self, params: list[nn.Parameter], base: list[torch.Tensor], inputs: torch.Tensor,
               targets: torch.Tensor) -> None:
        """local_steps gradient steps on the neighbours' loss + local_lambda * ||theta - base||^2, in place."""
        device = self._trainer.device()
        was_training = self.model.training
        forked = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked), torch.enable_grad():
            self.model.train()
            zero_state = self.model.initial_state(inputs.shape[0], device)
            for _ in range(self.local_steps):
                loss, _ = self._trainer.loss(Batch(inputs=inputs, targets=targets), zero_state)
                drift = sum(((p - b) ** 2).sum() for p, b in zip(params, base))
                grads = torch.autograd.grad(loss + self.local_lambda * drift, params,
                                            allow_unused=True, materialize_grads=True)
                with torch.no_grad():
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                    scale = self.local_lr * (self.clip / (norm + 1e-6)).clamp(max=1.0)
                    finite = torch.isfinite(norm) & torch.isfinite(loss)  # a non-finite local step is skipped
                    for p, g in zip(params, grads):
                        p.sub_(torch.where(finite, scale * g, 0.0))  # on the device: no sync per local step
        self.model.train(was_training)

    def learn(self, batch: Batch) -> LearnStats:
        return learn_and_replay(self._trainer, self._replay, batch, self._trainer.zero_state_loss, write=self._write)

    def state_dict(self) -> dict[str, Any]:
        held = len(self._replay.memory)
        return self._trainer.state_dict() | self._replay.state_dict() | {
            "keys": None if self._keys is None else self._keys[:held].clone(),
            "key_network": {k: v.clone() for k, v in self._key_network.state_dict().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
        self._replay.load_state_dict(state)
        self._key_network.load_state_dict(state["key_network"])
        keys = state["keys"]
        if keys is None:
            self._keys = None
            return
        self._keys = keys.new_empty((self.memory_size, keys.shape[1]))
        self._keys[: len(keys)] = keys
