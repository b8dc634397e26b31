"""The online trainer every gradient strategy holds: scoring, the carried hidden state, one clipped step.

The LSTM hidden state of each of the b parallel streams carries across batches
(truncated back-propagation through time), as in CALM. A strategy holds an
`OnlineTrainer` (its model, optimizer, clip and carried state) and calls it inside
`predict` and `learn`; it overrides nothing.

With dropout 0 (forward_is_mode_free) one training-mode forward serves both the score,
taken before the update, and the update: `predict` keeps it with its graph and learn's
first `loss` on the same batch takes it, as the CALM authors' loop scores a batch with its
training forward. With dropout > 0 the score is a separate eval-mode forward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from streamer.distributed import average_gradients, true_on_every_rank
from streamer.strategies.base import Batch, LearnStats, Prediction

__all__ = ["OnlineTrainer", "adam", "all_finite", "batch_rows_changed", "fine_tune", "forward_is_mode_free"]

# torch.nn modules whose forward never reads the train/eval mode
_MODE_FREE_TORCH = (nn.Embedding, nn.EmbeddingBag, nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.Identity,
                    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict,
                    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Softmax, nn.LogSoftmax)


def _module_is_mode_free(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p == 0
    if isinstance(module, nn.RNNBase):  # dropout acts between layers only
        return module.dropout == 0 or module.num_layers == 1
    if isinstance(module, _MODE_FREE_TORCH):
        return True
    if type(module).__module__.split(".")[0] == "streamer":  # ours read the mode only for config.dropout
        return getattr(getattr(module, "config", None), "dropout", 0) == 0
    return False  # batch norm, attention, any other library's module (a Hugging Face model's)


def forward_is_mode_free(model: nn.Module) -> bool:
    """True when `model` computes the same in train and eval mode (to float rounding), so that one
    training-mode forward gives both the prequential score, taken before the update, and the update.

    Every module must be: dropout with p 0; a recurrent layer with no dropout between layers; one of
    torch.nn's modules that never read the mode (embeddings, linear layers, layer norm, activations,
    containers); or one of streamer's own, which read the mode only for dropout: their config.dropout
    must be 0. Any other module (batch norm, attention, a Hugging Face model's layers) is taken to
    depend on the mode, and the score stays a separate eval-mode forward."""
    return all(_module_is_mode_free(module) for module in model.modules())


def adam(parameters, lr: float) -> torch.optim.Adam:
    """torch.optim.Adam with its defaults (betas 0.9, 0.999, eps 1e-8), fused where torch has the kernel
    for the parameters' device (CPU, CUDA): one call updates every tensor. The per-tensor loop, torch's
    default on CPU, made the step dispatch about ten operations per parameter from Python, each large
    one a parallel region that wakes the other OpenMP threads: the default LSTM's step took 7.9 ms
    against 6.9 fused (2 threads). Same update to float rounding; the state_dict is the same (a
    checkpoint of either loads into the other)."""
    parameters = list(parameters)
    devices = {p.device.type for p in parameters}
    return torch.optim.Adam(parameters, lr=lr, fused=bool(parameters) and devices <= {"cpu", "cuda"})


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when every value of every tensor is finite (no NaN, no infinity), on every rank.

    GPU sync point: whether an update may be applied is decided on the host. Ranks
    (streamer.distributed): decided together (one all-reduce), so a rank whose own loss is not
    finite skips with the others instead of leaving them waiting in the next collective; every
    rank must ask at the same point."""
    return true_on_every_rank(bool(torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()))


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
        # with dropout 0 (and nothing else reading the mode) predict's training-mode forward serves the update too
        self.shares_forward = forward_is_mode_free(model)
        self._kept = None  # (batch, start state, parameter versions, outputs) of predict's forward, until taken
        self._parameters = list(model.parameters())  # whose versions `take` compares (as the optimizer, fixed)
        self._fresh = None  # the zero state handed out while none is carried: one object, so `take` finds it

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def zero_state(self, rows: int):
        return self.model.initial_state(rows, self.device())

    def start_state(self, batch: Batch, dim: int = 1):
        """The carried state, or a fresh one (the same object until a state is carried: nothing writes
        into a state in place); models without a recurrent state use None."""
        rows = batch.inputs.shape[0]
        if batch_rows_changed(self.hidden, rows, dim):
            if batch_rows_changed(self._fresh, rows, dim):
                self._fresh = self.zero_state(rows)
            return self._fresh
        return self.hidden

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._parameters)  # bumped by every in-place change

    def keep(self, batch: Batch, state, outputs) -> None:
        """Hold predict's training-mode forward from `state` (outputs with their graph) for learn on `batch`."""
        self._kept = (batch, state, self._versions(), outputs)

    def take(self, batch: Batch, state):
        """The outputs `keep` held for this batch object and this start state, when no parameter changed in
        place since; else None. Either way they are let go: the first forward of learn takes them."""
        kept, self._kept = self._kept, None
        if kept is None or kept[0] is not batch or kept[1] is not state or kept[2] != self._versions():
            return None
        return kept[3]

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
        """(loss, next state): predict's kept forward when it scored this batch from this state, else a new one."""
        kept = self.take(batch, state)
        if kept is not None:
            return kept[0], kept[1]
        loss, next_state, _ = self.scored(batch, state)
        return loss, next_state

    @contextlib.contextmanager
    def scoring(self):
        """The modes predict's forward runs in: training mode with a graph when `shares_forward`, else eval
        mode without; the model's mode is put back after (switched only where it differs: a switch walks
        every module)."""
        was_training = self.model.training
        if was_training != self.shares_forward:
            self.model.train(self.shares_forward)
        try:
            with torch.set_grad_enabled(self.shares_forward):
                yield
        finally:
            if self.model.training != was_training:
                self.model.train(was_training)

    def predict(self, batch: Batch, state) -> Prediction:
        """The batch's loss from `state` (a classifier's predicted labels too); changes nothing. When
        `shares_forward`, the forward runs in training mode with its graph, kept for the first `loss`
        of learn on the same batch: one forward serves the score and the update. Otherwise it is a
        separate eval-mode forward without a graph (dropout > 0: the score sees no dropout)."""
        with self.scoring():
            loss, next_state, logits = self.scored(batch, state)
        if self.shares_forward:
            self.keep(batch, state, (loss, next_state))
        predicted = None if batch.labels_known is None else logits.argmax(-1)  # a classifier: each row's label
        return Prediction(loss=loss.detach(), predicted=predicted)

    def zero_state_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of separate windows (memory rows) from a zero state."""
        loss, _ = self.loss(Batch(inputs=inputs, targets=targets), self.zero_state(inputs.shape[0]))
        return loss

    def clip_and_step(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Clip the accumulated gradients, step the optimizer; the norm before clipping. When `loss` or
        the gradients are not finite the update is skipped: the gradients are dropped, parameters and
        optimizer state stay as they were, and `skipped` says so. Ranks (streamer.distributed): the
        gradients are first averaged over them (DistributedDataParallel's math), so all clip alike."""
        average_gradients(self.model.parameters())  # a no-op in one process
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
        self._kept = None
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
