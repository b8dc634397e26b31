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

from typing import Any

import torch
from torch import nn

from streamer.distributed import average_gradients, mean_over_ranks
from streamer.models.experts import LSTMExperts
from streamer.models.lstm import LSTMConfig
from streamer.models.mos import MixtureOfSoftmaxes
from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.gates import GateLSTM, LSTMGate, PlasticGate, UniformGate, combine, nll
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.trainer import OnlineTrainer, adam, all_finite, fine_tune

__all__ = ["ExpertMixture", "Ensemble", "PoE", "MoE", "PoELSTM", "MoELSTM", "MoS"]


def _template(model: nn.Module) -> tuple[LSTMConfig, torch.device]:
    config = getattr(model, "config", None)
    if not isinstance(config, LSTMConfig):
        raise ValueError(f"expert strategies build LSTMs from an LSTM language model's config; "
                         f"{type(model).__name__} has none (use --model lstm-char)")
    return config, next(model.parameters()).device


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


class _Experts(HyperparameterRepr):
    """n batched LSTM experts trained by one Adam on the combined loss, clipped per expert, and a gate.

    The gate is a component (UniformGate, PlasticGate, LSTMGate) that gives the combination
    weights and trains itself on the experts' detached logits before the experts' update. The
    first `warmup_batches` learned batches (and their predictions) use fixed uniform weights:
    1/n each for poe (the geometric mean of the experts), softmax(0) = 1/n for moe; the gate
    already trains during the warm-up. Subclasses only choose the kind and the gate.

    Ranks (streamer.distributed): synchronised, so N ranks equal one process on the global batch:
    the plastic gate's gradient is averaged over the ranks at each gate step, the LSTM gate's and
    the experts' gradients before their step (the experts' before the per-expert clip); only the
    hidden states of the rank's own rows are per rank.
    """

    kind = "moe"

    def _build(self, model: nn.Module, lr: float, clip: float, n_experts: int, warmup_batches: int,
               make_gate) -> None:
        """The gate first (its initial weights are drawn before the experts'), then the experts."""
        config, device = _template(model)
        self._gate = make_gate(config, device)
        self.model = ExpertMixture(LSTMExperts(n_experts, config), self._gate.module).to(device)
        self.lr = lr
        self.clip = clip
        self.n_experts = n_experts
        self.warmup_batches = warmup_batches
        # fused (trainer.adam): one pass over the stacked parameters (on CPU, 30 experts of hidden 200: 36 ms
        # a step against 136)
        self._trainer = OnlineTrainer(self.model, adam(self.model.experts.parameters(), lr), clip)
        self._learned = 0  # batches learned so far
        self.model.mix = self._mix

    def _mix(self, logits: torch.Tensor, inputs: torch.Tensor, gate_state):
        weights, gate_state = self._weights(inputs, gate_state)
        return self.combine(logits, weights), gate_state

    @property
    def warming_up(self) -> bool:
        return self._learned < self.warmup_batches

    def uniform_weights(self) -> torch.Tensor:
        n = self.n_experts
        value = 1.0 / n if self.kind == "poe" else 0.0
        return torch.full((n,), value, device=self._trainer.device())

    def combine(self, logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine(self.kind, logits, weights)

    def shown(self, weights: torch.Tensor) -> torch.Tensor:
        """The (n,) weights reported in LearnStats.gates: w for poe, softmax(w) for moe, mean over positions
        (ranks: over the global batch's; an LSTM gate's per-position weights were this rank's rows' mean)."""
        shown = weights if self.kind == "poe" else weights.softmax(0)
        shown = shown.reshape(self.n_experts, -1).mean(1).detach().clone()
        return mean_over_ranks(shown) if weights.dim() > 1 else shown  # (rows per rank: equal)

    def _start_state(self, batch: Batch):
        return self._trainer.start_state(batch, dim=-2)

    def _weights(self, inputs: torch.Tensor, state) -> tuple[torch.Tensor, tuple]:
        """Combination weights for this batch and the gate's next state (() for stateless gates)."""
        return self._gate.weights(inputs, state, self.uniform_weights, self.warming_up)

    def predict(self, batch: Batch) -> Prediction:
        """The mixture's loss under the current weights, before the update. With a mode-free model
        (OnlineTrainer.shares_forward: dropout 0) the experts' forward runs in training mode and is
        kept for `learn` on the same batch, so one forward serves the score and the update;
        otherwise it is a separate eval-mode forward without a graph."""
        start = self._start_state(batch)
        with self._trainer.scoring():
            logits, expert_state = self.model.experts(batch.inputs, start[:2])
            if self._trainer.shares_forward:
                self._trainer.keep(batch, start, (logits, expert_state))
            with torch.no_grad():
                weights, _ = self._weights(batch.inputs, start[2:])
                loss = nll(self.combine(logits.detach(), weights), batch.targets)
        return Prediction(loss=loss)

    def train_gates(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Plastic gates: gate_steps Adam steps on w alone against the experts' logits (n, b, w, V),
        taken as constants (PlasticGate.train)."""
        self._gate.train(logits, targets)

    def learn(self, batch: Batch) -> LearnStats:
        self.model.train()
        start = self._start_state(batch)
        shared = self._trainer.take(batch, start)  # predict's forward of this batch, when it kept one
        logits, expert_state = shared if shared is not None else self.model.experts(batch.inputs, start[:2])
        kept = self._gate.backup()
        weights, gate_state = self._gate.update(logits.detach(), batch.targets, batch.inputs, start[2:],
                                                self.uniform_weights, self.warming_up)
        loss = nll(self.combine(logits, weights.detach()), batch.targets)
        optimizer = self._trainer.optimizer
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(self.model.experts.parameters())  # ranks: the global batch's gradient, then clipped
        norms = self.model.experts.clip_grad_norms_(self.clip)
        if not all_finite(loss, norms):  # skipped: the gate fitted on it is put back; experts, state stay
            optimizer.zero_grad(set_to_none=True)
            self._gate.restore(kept)
            return LearnStats(loss=loss.detach(), grad_norm=norms.norm(), skipped=True)
        optimizer.step()
        self._trainer.carry(expert_state + gate_state)
        self._learned += 1  # grad_norm: over all experts together, as clip_grad_norm_ of the whole module
        return LearnStats(loss=loss.detach(), grad_norm=norms.norm(), gates=self.shown(weights))

    def state_dict(self) -> dict[str, Any]:
        return self._trainer.state_dict() | {"gate_optimizer": self._gate.state_dict(), "learned": self._learned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
        self._gate.load_state_dict(state["gate_optimizer"])
        self._learned = state["learned"]


class Ensemble(_Experts):
    """A mixture of n experts with fixed uniform weights (no gate)."""

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, n_experts: int = 30):
        self._build(model, lr, clip, n_experts, 0, lambda config, device: UniformGate())


_PLASTIC = """Plastic gates (`PlasticGate`): a free vector w fitted by gate_steps Adam steps on each batch
    against the experts' detached outputs of the learning forward (no recomputation). The gate
    steps run first; the experts are then trained with the fitted w (detached), which also scores
    the next batch. The gates train from the first batch on, also during the warm-up, when the
    experts are trained and scored with uniform weights: the first prediction with plastic
    weights then uses weights fitted to the warmed-up experts."""

_LSTM_GATED = """A GateLSTM (hidden gate_hidden, `LSTMGate`) reads the input window and gives per-position
    weights; one Adam step (gate_lr) per batch on the detached expert outputs; the experts are
    trained with the weights of that same forward, detached. During warm-up the experts are
    trained and scored with uniform weights while the gate already trains."""


def _plastic(strategy: _Experts, model, lr, clip, n_experts, gate_steps, gate_lr, warmup_batches) -> None:
    strategy.gate_steps = gate_steps
    strategy.gate_lr = gate_lr
    strategy._build(model, lr, clip, n_experts, warmup_batches,
                    lambda config, device: PlasticGate(strategy.kind, n_experts, gate_steps, gate_lr, device))


def _lstm_gated(strategy: _Experts, model, lr, clip, n_experts, gate_hidden, gate_lr, warmup_batches) -> None:
    strategy.gate_hidden = gate_hidden
    strategy.gate_lr = gate_lr
    strategy._build(model, lr, clip, n_experts, warmup_batches, lambda config, device: LSTMGate(
        strategy.kind, config.vocab, n_experts, gate_hidden, gate_lr, device))


class PoE(_Experts):
    __doc__ = "Product of experts (poe) with plastic gates.\n\n    " + _PLASTIC
    kind = "poe"

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, n_experts: int = 30,
                 gate_steps: int = 100, gate_lr: float = 1e-3, warmup_batches: int = 250):
        _plastic(self, model, lr, clip, n_experts, gate_steps, gate_lr, warmup_batches)


class MoE(_Experts):
    __doc__ = "Mixture of experts (moe) with plastic gates.\n\n    " + _PLASTIC
    kind = "moe"

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, n_experts: int = 30,
                 gate_steps: int = 100, gate_lr: float = 1e-3, warmup_batches: int = 250):
        _plastic(self, model, lr, clip, n_experts, gate_steps, gate_lr, warmup_batches)


class PoELSTM(_Experts):
    __doc__ = "Product of experts (poe) with an LSTM gate.\n\n    " + _LSTM_GATED
    kind = "poe"

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, n_experts: int = 30,
                 gate_hidden: int = 50, gate_lr: float = 1e-3, warmup_batches: int = 250):
        _lstm_gated(self, model, lr, clip, n_experts, gate_hidden, gate_lr, warmup_batches)


class MoELSTM(_Experts):
    __doc__ = "Mixture of experts (moe) with an LSTM gate.\n\n    " + _LSTM_GATED
    kind = "moe"

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, n_experts: int = 30,
                 gate_hidden: int = 50, gate_lr: float = 1e-3, warmup_batches: int = 250):
        _lstm_gated(self, model, lr, clip, n_experts, gate_hidden, gate_lr, warmup_batches)


class MoS(HyperparameterRepr):
    """Naive online training of a mixture of softmaxes (streamer.models.mos) built from the template's config.

    Ranks (streamer.distributed): synchronised (gradients averaged before clipping), as naive."""

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, steps: int = 1, n_components: int = 5):
        config, device = _template(model)
        self.model = MixtureOfSoftmaxes(config, n_components).to(device)
        self.lr = lr
        self.clip = clip
        self.steps = steps
        self.n_components = n_components
        self._trainer = OnlineTrainer(self.model, adam(self.model.parameters(), lr), clip)

    def predict(self, batch: Batch) -> Prediction:
        return self._trainer.predict(batch, self._trainer.start_state(batch))

    def learn(self, batch: Batch) -> LearnStats:
        return fine_tune(self._trainer, batch, self._trainer.start_state(batch), self.steps)

    def state_dict(self) -> dict[str, Any]:
        return self._trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
