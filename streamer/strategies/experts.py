"""Expert architectures of CALM (Sec. 4): products and mixtures of LSTM experts with plastic or
LSTM gates, the uniform ensemble, and naive training of a mixture of softmaxes.

Every strategy here ignores the template model's weights and builds its own module from the
template's `LSTMConfig` (its hidden size is each expert's hidden size). Combinations, for
expert logits y_i (n, b, w, V) and a weight vector w:

    poe:  log_softmax(sum_i w_i y_i)                                  (weighted product of experts)
    moe:  log sum_i softmax(w)_i softmax(y_i)                         (mixture, via logsumexp)

`LearnStats.gates` reports the weights the experts were trained with on the batch: w itself
for poe, softmax(w) for moe and ensemble; the LSTM-gated variants report their mean over the
batch's positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from streamer.models.experts import LSTMExperts
from streamer.models.lstm import LSTMConfig
from streamer.models.mos import MixtureOfSoftmaxes
from streamer.strategies.base import Batch, LearnStats
from streamer.strategies.naive import Naive

__all__ = ["poe_log_probs", "moe_log_probs", "poe_gate_gradient", "moe_gate_gradient", "ExpertMixture", "GateLSTM",
           "GateAdam", "Ensemble", "PoE", "MoE", "PoELSTM", "MoELSTM", "MoS"]


def _per_expert(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Weights (n,) or (n, b, w) shaped to broadcast against (n, b, w, V)."""
    return weights.reshape(weights.shape + (1,) * (like.dim() - weights.dim()))


def poe_log_probs(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log_softmax(sum_i w_i logits_i): logits (n, b, w, V), weights (n,) or (n, b, w) -> (b, w, V)."""
    if weights.dim() == 1:
        return torch.tensordot(weights, logits, dims=1).log_softmax(-1)
    return (_per_expert(weights, logits) * logits).sum(0).log_softmax(-1)


def moe_log_probs(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log sum_i softmax(w)_i softmax(logits_i): logits (n, b, w, V), weights (n,) or (n, b, w) -> (b, w, V)."""
    log_prior = _per_expert(weights.log_softmax(0), logits)
    return torch.logsumexp(logits.log_softmax(-1) + log_prior, dim=0)


def poe_gate_gradient(logits: torch.Tensor, targets: torch.Tensor):
    """For detached logits (n, b, w, V): w -> dL/dw of L(w) = nll(poe_log_probs(logits, w), targets).

    dL/dw_i = mean over positions of E_p[y_i] - y_i[target], p the product's distribution."""
    n, vocab = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(n, -1, vocab)
    positions = flat.shape[1]
    at_targets = flat.gather(2, targets.reshape(1, -1, 1).expand(n, -1, 1)).mean((1, 2))
    flat = flat.reshape(n, -1)
    flat_t = flat.t()

    def gradient(weights: torch.Tensor) -> torch.Tensor:
        product = torch.mv(flat_t, weights).view(positions, vocab).softmax(-1).view(-1)
        return torch.addmv(at_targets, flat, product, beta=-1.0, alpha=1.0 / positions)

    return gradient


def moe_gate_gradient(logits: torch.Tensor, targets: torch.Tensor):
    """For detached logits (n, b, w, V): w -> dL/dw of L(w) = nll(moe_log_probs(logits, w), targets).

    dL/dw_i = softmax(w)_i - mean over positions of r_i, r the posterior responsibility of
    expert i for the target (softmax over i of log softmax(w)_i + log p_i[target])."""
    n, vocab = logits.shape[0], logits.shape[-1]
    log_probs = logits.log_softmax(-1).reshape(n, -1, vocab)
    at_targets = log_probs.gather(2, targets.reshape(1, -1, 1).expand(n, -1, 1)).squeeze(2)  # (n, positions)

    def gradient(weights: torch.Tensor) -> torch.Tensor:
        log_prior = weights.log_softmax(0)
        return log_prior.exp() - (at_targets + log_prior.unsqueeze(1)).softmax(0).mean(1)

    return gradient


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(log_probs.reshape(-1, log_probs.shape[-1]), targets.reshape(-1))


def _template(model: nn.Module) -> tuple[LSTMConfig, torch.device]:
    config = getattr(model, "config", None)
    if not isinstance(config, LSTMConfig):
        raise ValueError(f"expert strategies build LSTMs from an LSTM language model's config; "
                         f"{type(model).__name__} has none (use --model lstm-char)")
    return config, next(model.parameters()).device


class GateLSTM(nn.Module):
    """One-layer LSTM reading the input tokens and giving n unnormalised expert weights per position."""

    def __init__(self, vocab: int, n: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, n)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        shape = (1, batch_size, self.hidden)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def forward(self, inputs: torch.Tensor, state):
        """inputs (b, w) -> weights (n, b, w), next state."""
        hidden, state = self.lstm(self.embed(inputs), state)
        return self.out(hidden).permute(2, 0, 1), state


class ExpertMixture(nn.Module):
    """Every trainable parameter of an expert strategy: the experts and the gate (a free
    vector, a GateLSTM, or None). The carried state is the experts' (h, c) followed by the
    gate LSTM's, each with the batch on dimension -2."""

    def __init__(self, experts: LSTMExperts, gate: nn.Parameter | nn.Module | None = None):
        super().__init__()
        self.experts = experts
        self.gate = gate
        self.mix = None  # set by the owning strategy: (logits, inputs, gate state) -> (log-probs, gate state)

    def forward(self, inputs: torch.Tensor, state):
        """The mixture's log-probabilities (b, w, V) under the owning strategy's current weights,
        so held-out probes score the mixture the stream is scored with."""
        logits, expert_state = self.experts(inputs, state[:2])
        log_probs, gate_state = self.mix(logits, inputs, state[2:])
        return log_probs, expert_state + gate_state

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        state = self.experts.initial_state(batch_size, device)
        if isinstance(self.gate, GateLSTM):
            state = state + self.gate.initial_state(batch_size, device)
        return state


class GateAdam:
    """Adam (torch.optim.Adam's update and defaults: betas 0.9, 0.999, eps 1e-8) for the plastic gate vector.

    A gate phase makes gate_steps updates of one n-vector per batch; torch.optim's per-call
    bookkeeping then costs more than the arithmetic (measured on CPU: about 2.5x a step in
    these few in-place operations). The tests check it against torch.optim.Adam."""

    def __init__(self, param: torch.Tensor, lr: float):
        self.param = param
        self.lr = lr
        self.steps = 0
        self.exp_avg = torch.zeros_like(param.detach())
        self.exp_avg_sq = torch.zeros_like(param.detach())

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        self.steps += 1
        self.exp_avg.lerp_(grad, 1 - 0.9)
        self.exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=1 - 0.999)
        denom = self.exp_avg_sq.sqrt().div_(math.sqrt(1 - 0.999 ** self.steps)).add_(1e-8)
        self.param.addcdiv_(self.exp_avg, denom, value=-self.lr / (1 - 0.9 ** self.steps))

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


class _Experts(Naive):
    """n batched LSTM experts trained by one Adam on the combined loss, clipped per expert.

    Subclasses set `kind` ("poe" | "moe") and define `_weights` (the combination weights for
    a batch) and `_update_gate`. The first `warmup_batches` learned batches (and their
    predictions) use fixed uniform weights: 1/n each for poe (the geometric mean of the
    experts), softmax(0) = 1/n for moe.
    """

    kind = "moe"

    def __init__(self, model: nn.Module, lr: float, clip: float, n_experts: int, warmup_batches: int,
                 gate: nn.Parameter | nn.Module | None = None, gate_lr: float = 1e-3):
        config, device = _template(model)
        super().__init__(ExpertMixture(LSTMExperts(n_experts, config), gate).to(device), lr=lr, clip=clip)
        self.n_experts = n_experts
        self.warmup_batches = warmup_batches
        self.gate_lr = gate_lr
        # fused: one pass over the stacked parameters (on CPU, 30 experts of hidden 200: 36 ms a step against 136)
        fused = self._device().type in ("cpu", "cuda")
        self._optimizer = torch.optim.Adam(self.model.experts.parameters(), lr=lr, fused=fused)
        self._gate_optimizer = self._make_gate_optimizer()
        self._learned = 0  # batches learned so far
        self.model.mix = self._mix

    def _mix(self, logits: torch.Tensor, inputs: torch.Tensor, gate_state):
        weights, gate_state = self._weights(inputs, gate_state)
        return self.combine(logits, weights), gate_state

    def _make_gate_optimizer(self):
        gate = self.model.gate
        return None if gate is None else torch.optim.Adam(gate.parameters(), lr=self.gate_lr)

    @property
    def warming_up(self) -> bool:
        return self._learned < self.warmup_batches

    def uniform_weights(self) -> torch.Tensor:
        n = self.n_experts
        value = 1.0 / n if self.kind == "poe" else 0.0
        return torch.full((n,), value, device=self._device())

    def combine(self, logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (poe_log_probs if self.kind == "poe" else moe_log_probs)(logits, weights)

    def shown(self, weights: torch.Tensor) -> torch.Tensor:
        """The (n,) weights reported in LearnStats.gates: w for poe, softmax(w) for moe, mean over positions."""
        shown = weights if self.kind == "poe" else weights.softmax(0)
        return shown.reshape(self.n_experts, -1).mean(1).detach().clone()

    def _start_state(self, batch: Batch):
        if self._state is None or self._state[0].shape[-2] != batch.inputs.shape[0]:
            return self.model.initial_state(batch.inputs.shape[0], self._device())
        return self._state

    def _weights(self, inputs: torch.Tensor, state) -> tuple[torch.Tensor, tuple]:
        """Combination weights for this batch and the gate's next state (() for stateless gates)."""
        return self.uniform_weights(), ()

    def _loss(self, batch: Batch, state):
        logits, expert_state = self.model.experts(batch.inputs, state[:2])
        weights, gate_state = self._weights(batch.inputs, state[2:])
        return _nll(self.combine(logits, weights), batch.targets), expert_state + gate_state

    def _update_gate(self, logits: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor, state):
        """Train the gate on detached expert logits; return (weights for the experts, gate state)."""
        return self.uniform_weights(), ()

    def learn(self, batch: Batch) -> LearnStats:
        self.model.train()
        start = self._start_state(batch)
        logits, expert_state = self.model.experts(batch.inputs, start[:2])
        weights, gate_state = self._update_gate(logits.detach(), batch.targets, batch.inputs, start[2:])
        loss = _nll(self.combine(logits, weights.detach()), batch.targets)
        self._optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norms = self.model.experts.clip_grad_norms_(self.clip)
        self._optimizer.step()
        self._carry(expert_state + gate_state)
        self._learned += 1  # grad_norm: over all experts together, as clip_grad_norm_ of the whole module
        return LearnStats(loss=loss.detach(), grad_norm=norms.norm(), gates=self.shown(weights))

    def state_dict(self) -> dict[str, Any]:
        gate = None if self._gate_optimizer is None else self._gate_optimizer.state_dict()
        return super().state_dict() | {"gate_optimizer": gate, "learned": self._learned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self._gate_optimizer is not None:
            self._gate_optimizer.load_state_dict(state["gate_optimizer"])
        self._learned = state["learned"]


class Ensemble(_Experts):
    """A mixture of n experts with fixed uniform weights (no gate)."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, clip: float = 1.0, n_experts: int = 30):
        super().__init__(model, lr=lr, clip=clip, n_experts=n_experts, warmup_batches=0)

    def __repr__(self) -> str:
        return f"Ensemble(lr={self.lr}, clip={self.clip}, n_experts={self.n_experts})"


class _Plastic(_Experts):
    """Plastic gates: a free vector w (init U(-0.1, 0.1)) fitted by gate_steps Adam steps on each
    batch against the experts' detached outputs of the learning forward (no recomputation).
    The gate steps run first; the experts are then trained with the fitted w (detached), which
    also scores the next batch. The gates train from the first batch on, also during the
    warm-up, when the experts are trained and scored with uniform weights: the first prediction
    with plastic weights then uses weights fitted to the warmed-up experts."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, clip: float = 1.0, n_experts: int = 30,
                 gate_steps: int = 100, gate_lr: float = 1e-3, warmup_batches: int = 250):
        gate = nn.Parameter(torch.empty(n_experts).uniform_(-0.1, 0.1))
        super().__init__(model, lr=lr, clip=clip, n_experts=n_experts, warmup_batches=warmup_batches,
                         gate=gate, gate_lr=gate_lr)
        self.gate_steps = gate_steps

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(lr={self.lr}, clip={self.clip}, n_experts={self.n_experts}, "
                f"gate_steps={self.gate_steps}, gate_lr={self.gate_lr}, warmup_batches={self.warmup_batches})")

    def _make_gate_optimizer(self) -> GateAdam:
        return GateAdam(self.model.gate, self.gate_lr)

    def _weights(self, inputs: torch.Tensor, state):
        return (self.uniform_weights() if self.warming_up else self.model.gate), ()

    @torch.no_grad()
    def train_gates(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """gate_steps Adam steps on w alone against the experts' logits (n, b, w, V), taken as constants.

        The gradient is in closed form (poe_gate_gradient, moe_gate_gradient; the tests check
        it against autograd): a step is then three tensor operations and a GateAdam update,
        several times faster than autograd and torch.optim on these small problems."""
        gradient = (poe_gate_gradient if self.kind == "poe" else moe_gate_gradient)(logits, targets)
        for _ in range(self.gate_steps):
            self._gate_optimizer.step(gradient(self.model.gate))

    def _update_gate(self, logits, targets, inputs, state):
        self.train_gates(logits, targets)
        return self._weights(inputs, state)


class PoE(_Plastic):
    kind = "poe"


class MoE(_Plastic):
    kind = "moe"


class _LSTMGated(_Experts):
    """A GateLSTM (hidden gate_hidden) reads the input window and gives per-position weights; one
    Adam step (gate_lr) per batch on the detached expert outputs; the experts are trained with
    the weights of that same forward, detached. During warm-up the experts are trained and
    scored with uniform weights while the gate already trains."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, clip: float = 1.0, n_experts: int = 30,
                 gate_hidden: int = 50, gate_lr: float = 1e-3, warmup_batches: int = 250):
        config, _ = _template(model)
        super().__init__(model, lr=lr, clip=clip, n_experts=n_experts, warmup_batches=warmup_batches,
                         gate=GateLSTM(config.vocab, n_experts, gate_hidden), gate_lr=gate_lr)
        self.gate_hidden = gate_hidden

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(lr={self.lr}, clip={self.clip}, n_experts={self.n_experts}, "
                f"gate_hidden={self.gate_hidden}, gate_lr={self.gate_lr}, warmup_batches={self.warmup_batches})")

    def _weights(self, inputs, state):
        weights, gate_state = self.model.gate(inputs, state)
        return (self.uniform_weights() if self.warming_up else weights), gate_state

    def _update_gate(self, logits, targets, inputs, state):
        weights, gate_state = self.model.gate(inputs, state)
        self._gate_optimizer.zero_grad(set_to_none=True)
        _nll(self.combine(logits, weights), targets).backward()
        self._gate_optimizer.step()
        return (self.uniform_weights() if self.warming_up else weights.detach()), gate_state


class PoELSTM(_LSTMGated):
    kind = "poe"


class MoELSTM(_LSTMGated):
    kind = "moe"


class MoS(Naive):
    """Naive online training of a mixture of softmaxes (streamer.models.mos) built from the template's config."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, clip: float = 1.0, steps: int = 1, n_components: int = 5):
        config, device = _template(model)
        super().__init__(MixtureOfSoftmaxes(config, n_components).to(device), lr=lr, clip=clip, steps=steps)
        self.n_components = n_components

    def __repr__(self) -> str:
        return f"MoS(lr={self.lr}, clip={self.clip}, steps={self.steps}, n_components={self.n_components})"
