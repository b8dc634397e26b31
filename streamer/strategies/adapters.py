"""AdapterCL (seed 002): frozen base, one residual adapter set per detected distribution, perplexity selection.

A residual adapter computes ReLU(LN(h) W_E) W_D + h (002 Eq. 6) with a bottleneck
of `bottleneck` units. One adapter set holds an adapter on every site of the base:
- hf-causal (`decoder_layers()`): the output of each transformer block;
- an LSTM language model (`lstm`, as lstm-char and lstm-word): the LSTM's output
  features, before the decoder (nn.LSTM is one module, so one site).
The adapters sit in forward hooks on those sites; a hook is the identity unless a
call of `AdaptedLM` names the adapters to apply, so the base alone is unchanged.

The base is frozen (requires_grad False, never updated). The stream has no task
ids, so a river drift detector on the training loss (`boundary`, as EWC and L2
use) marks a new distribution: a new adapter set is spawned (W_D starts at zero,
so it starts as the base) and learning trains only it. At `max_adapters` no more
are spawned; a detected boundary then switches training to the adapter with the
lowest loss on the batch that triggered it.

Prediction picks the adapter with the lowest perplexity (002 Eq. 9-10). `predict`
scores the batch being predicted under every adapter (its targets, no gradient),
exactly as AdapterCL scores the input at test time, and records the lowest loss:
`selection="batch"` picks one adapter for the whole batch, `"row"` one per stream.
Calling the model without naming an adapter (probe scoring) selects by the
perplexity of the inputs themselves (inputs[:, 1:] given inputs[:, :-1]).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.boundary import Boundaries
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.trainer import adam, all_finite

__all__ = ["ResidualAdapter", "AdaptedLM", "Adapters"]

SELECTIONS = ("batch", "row")
_LOGITS_BUDGET = 1 << 26  # logits elements per stacked scoring pass (256 MB in float32)


class ResidualAdapter(nn.Module):
    """h + ReLU(LN(h) W_E) W_D; W_D and its bias start at zero, so a new adapter is the identity.

    W_E is drawn from `generator` (never the global RNG), so spawning an adapter in the
    middle of a stream is reproducible from a checkpoint. Computes in float32 whatever
    the base's dtype, and returns the base's dtype."""

    def __init__(self, dim: int, bottleneck: int, generator: torch.Generator | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.down = nn.utils.skip_init(nn.Linear, dim, bottleneck)
        self.up = nn.utils.skip_init(nn.Linear, bottleneck, dim)
        bound = 1.0 / math.sqrt(dim)  # nn.Linear's default range, drawn from `generator`
        with torch.no_grad():
            self.down.weight.uniform_(-bound, bound, generator=generator)
            self.down.bias.uniform_(-bound, bound, generator=generator)
            self.up.weight.zero_()
            self.up.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        delta = self.up(torch.relu(self.down(self.norm(hidden.float()))))
        return hidden + delta.to(hidden.dtype)


def _sites(base: nn.Module) -> tuple[list[nn.Module], int]:
    """The modules whose outputs get adapters, and the width of those outputs."""
    if hasattr(base, "decoder_layers"):
        return list(base.decoder_layers()), base.config.hidden
    lstm = getattr(base, "lstm", None)
    if isinstance(lstm, nn.LSTM):
        return [lstm], lstm.hidden_size
    raise ValueError(f"adapters need hf-causal or an LSTM language model, not {type(base).__name__}")


def _repeat_state(state, copies: int):
    """The carried state for `copies` stacked copies of the batch (nn.LSTM layout: (layers, b, H))."""
    if state is None or copies == 1:
        return state
    return tuple(s.repeat(1, copies, 1) for s in state)


def _stackable(state) -> bool:
    return state is None or (isinstance(state, tuple) and all(torch.is_tensor(s) and s.dim() == 3 for s in state))


class AdaptedLM(nn.Module):
    """The frozen base plus every adapter set; the same interface as the base.

    `forward(inputs, state, adapter=None)`: with `adapter` an index, the base with that
    adapter set; with None, the adapter set under which the inputs are most probable."""

    scores_rows_alone = False  # the adapter set is chosen from the whole batch: probes score each class apart

    def __init__(self, base: nn.Module, bottleneck: int = 100):
        super().__init__()
        sites, dim = _sites(base)
        self.base = base
        self.dim = dim
        self.bottleneck = bottleneck
        self.adapters = nn.ModuleList()  # one nn.ModuleList (an adapter per site) per distribution
        self._sites = sites  # a plain list: the modules stay registered under `base` only
        self._active: tuple[int, ...] | None = None  # adapter sets applied to consecutive chunks of the batch
        for index, site in enumerate(sites):
            site.register_forward_hook(functools.partial(self._adapt, index))

    @property
    def config(self):
        return self.base.config

    def _adapt(self, index: int, module, args, output):
        if self._active is None:
            return None  # the base's own output
        hidden = output[0] if isinstance(output, tuple) else output
        if len(self._active) == 1:
            adapted = self.adapters[self._active[0]][index](hidden)
        else:
            chunks = hidden.chunk(len(self._active), dim=0)
            adapted = torch.cat([self.adapters[a][index](chunk) for a, chunk in zip(self._active, chunks)])
        return (adapted, *output[1:]) if isinstance(output, tuple) else adapted

    @contextlib.contextmanager
    def using(self, adapters: Sequence[int]):
        """Apply adapter set adapters[k] to the k-th of len(adapters) equal chunks of the batch."""
        previous, self._active = self._active, tuple(adapters)
        try:
            yield
        finally:
            self._active = previous

    def add_adapter(self, generator: torch.Generator | None = None) -> int:
        """A new adapter set (the identity until trained), on the base's device; returns its index."""
        device = next(self.base.parameters()).device
        adapters = nn.ModuleList(ResidualAdapter(self.dim, self.bottleneck, generator) for _ in self._sites)
        self.adapters.append(adapters.to(device))
        return len(self.adapters) - 1

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        return self.base.initial_state(batch_size, device)

    def forward(self, inputs: torch.Tensor, state=None, adapter: int | None = None):
        if adapter is None:
            adapter = self.select(inputs, state)
        with self.using((adapter,)):
            return self.base(inputs, state)

    def features(self, inputs: torch.Tensor, state=None, adapter: int | None = None):
        if adapter is None:
            adapter = self.select(inputs, state)
        with self.using((adapter,)):
            return self.base.features(inputs, state)

    @torch.no_grad()
    def row_losses(self, inputs: torch.Tensor, targets: torch.Tensor, state=None) -> torch.Tensor:
        """(adapters, b): the mean cross-entropy of each row under each adapter set, no gradient.

        The batch is stacked once per adapter set and scored in one pass (several when the
        logits would exceed _LOGITS_BUDGET elements)."""
        count, (b, w) = len(self.adapters), targets.shape
        vocab = getattr(self.config, "vocab", 1)
        per_pass = max(1, _LOGITS_BUDGET // max(1, b * w * vocab)) if _stackable(state) else 1
        losses = []
        for first in range(0, count, per_pass):
            group = range(first, min(count, first + per_pass))
            with self.using(group):
                logits, _ = self.base(inputs.repeat(len(group), 1), _repeat_state(state, len(group)))
            flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.repeat(len(group), 1).reshape(-1),
                                   reduction="none")
            losses.append(flat.view(len(group), b, w).mean(2))
        return torch.cat(losses)

    def select(self, inputs: torch.Tensor, state=None) -> int:
        """The adapter set with the lowest perplexity of the inputs themselves (the newest when undecidable)."""
        if len(self.adapters) == 1 or inputs.shape[1] < 2:
            return len(self.adapters) - 1
        # GPU sync point: the chosen index decides which adapters run.
        return int(self.row_losses(inputs[:, :-1], inputs[:, 1:], state).mean(1).argmin())


class Adapters(HyperparameterRepr):
    """AdapterCL on a stream: train the current adapter set, spawn one per detected distribution.

    Not distributed: `streamer learn --nproc` refuses it (each rank's detector would spawn adapters
    at its own steps, and the models would differ)."""

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, steps: int = 1,
                 bottleneck: int = 100, max_adapters: int = 8, boundary: str = "page-hinkley",
                 selection: str = "batch", seed: int = 0):
        if bottleneck < 1:
            raise ValueError(f"bottleneck must be at least 1, got {bottleneck}")
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be at least 1, got {max_adapters}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
        self.lr = lr
        self.clip = clip
        self.steps = steps
        self.bottleneck = bottleneck
        self.max_adapters = max_adapters
        self.boundary = boundary
        self.selection = selection
        self.seed = seed
        model.requires_grad_(False)  # the base is frozen
        self.model = AdaptedLM(model, bottleneck)
        self._boundaries = Boundaries(boundary)
        self._generator = torch.Generator().manual_seed(seed)  # draws the initial weights of every adapter set
        self._current = self.model.add_adapter(self._generator)  # the adapter set learn trains
        self._spawned_at: list[int] = []  # learned batch index after which each later adapter set was spawned
        self._optimizer = self._new_optimizer()
        self._state = None  # carried hidden state (LSTM bases), detached

    @property
    def n_adapters(self) -> int:
        return len(self.model.adapters)

    @property
    def current(self) -> int:
        return self._current

    @property
    def spawned_at(self) -> tuple[int, ...]:
        return tuple(self._spawned_at)

    @property
    def boundaries_at(self) -> tuple[int, ...]:
        """Learned batch index after which each boundary was detected (spawns and, at the cap, switches)."""
        return self._boundaries.found_at

    def _new_optimizer(self) -> torch.optim.Adam:
        """One Adam, one parameter group per adapter set: a set's moments survive while others train."""
        optimizer = adam(self.model.adapters[0].parameters(), self.lr)
        for adapter in self.model.adapters[1:]:
            optimizer.add_param_group({"params": list(adapter.parameters())})
        return optimizer

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _start_state(self, batch: Batch):
        if self._state is None or self._state[0].shape[1] != batch.inputs.shape[0]:
            return self.model.initial_state(batch.inputs.shape[0], self._device())
        return self._state

    def _carry(self, next_state) -> None:
        self._state = None if next_state is None else tuple(s.detach() for s in next_state)

    def adapter_losses(self, batch: Batch, state=None) -> torch.Tensor:
        """(adapters, b): each row's loss under each adapter set (eval mode, no gradient) from
        `state`, by default the carried one; changes nothing."""
        was_training = self.model.training
        self.model.eval()
        try:
            start = self._start_state(batch) if state is None else state
            return self.model.row_losses(batch.inputs, batch.targets, start)
        finally:
            self.model.train(was_training)

    def predict(self, batch: Batch) -> Prediction:
        losses = self.adapter_losses(batch)
        if self.selection == "row":
            return Prediction(loss=losses.min(0).values.mean())
        return Prediction(loss=losses.mean(1).min())

    def learn(self, batch: Batch) -> LearnStats:
        self.model.train()
        start = self._start_state(batch)
        trained = self.model.adapters[self._current]
        for _ in range(self.steps):
            self._optimizer.zero_grad(set_to_none=True)
            logits, next_state = self.model(batch.inputs, start, adapter=self._current)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(trained.parameters(), self.clip)
            if not all_finite(loss, grad_norm):  # skipped: adapters, moments, boundaries and state stay
                self._optimizer.zero_grad(set_to_none=True)
                return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach(), skipped=True)
            self._optimizer.step()
        if self._boundaries.update(loss.detach()):
            self._new_distribution(batch, start)
        self._carry(next_state)
        return LearnStats(loss=loss.detach(), grad_norm=grad_norm.detach())

    def _new_distribution(self, batch: Batch, start) -> None:
        if self.n_adapters < self.max_adapters:
            self._current = self.model.add_adapter(self._generator)
            self._optimizer.add_param_group({"params": list(self.model.adapters[self._current].parameters())})
            self._spawned_at.append(self._boundaries.learned - 1)
            return
        # at the cap: train the adapter set that fits the batch best
        self._current = int(self.adapter_losses(batch, start).mean(1).argmin())  # GPU sync point (boundaries only)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),  # the base (frozen) and every adapter set
            "adapters": self.n_adapters,
            "current": self._current,
            "spawned_at": list(self._spawned_at),
            "optimizer": self._optimizer.state_dict(),
            "boundaries": self._boundaries.state_dict(),
            "generator": self._generator.get_state(),
            "hidden": None if self._state is None else [s.clone() for s in self._state],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del self.model.adapters[state["adapters"]:]
        while self.n_adapters < state["adapters"]:
            self.model.add_adapter(torch.Generator())  # overwritten below; leaves the global RNG alone
        self.model.load_state_dict(state["model"])
        self._current = state["current"]
        self._spawned_at = list(state["spawned_at"])
        self._optimizer = self._new_optimizer()
        self._optimizer.load_state_dict(state["optimizer"])
        self._boundaries.load_state_dict(state["boundaries"])
        self._generator.set_state(state["generator"])
        hidden = state.get("hidden")
        self._state = None if hidden is None else tuple(s.clone() for s in hidden)
