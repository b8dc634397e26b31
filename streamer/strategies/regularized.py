"""Quadratic penalties to consolidated weights: L2 and online EWC.

Consolidation happens at task boundaries. The stream has none, so each strategy
finds its own (streamer.strategies.boundary): a river drift detector watching the
strategy's own training loss (`boundary="page-hinkley" | "adwin" | "kswin"`), a
fixed schedule (`boundary="every:N"`, after every N-th learned batch) or never
(`"none"`). Headers never reach a strategy, so boundaries cannot come from them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.boundary import Boundaries
from streamer.strategies.params import HyperparameterRepr
from streamer.strategies.trainer import OnlineTrainer, adam

__all__ = ["L2", "EWC", "L2Penalty", "FisherPenalty"]


def _clone(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {name: t.detach().clone() for name, t in tensors.items()}


class L2Penalty:
    """(l2_lambda / 2) * sum_i (theta_i - anchor_i)^2 to the weights at the last consolidation (none before)."""

    def __init__(self, l2_lambda: float):
        self.l2_lambda = l2_lambda
        self.anchor: dict[str, torch.Tensor] | None = None

    def observe(self, params: dict[str, torch.Tensor]) -> None:
        """Nothing: the L2 penalty does not watch gradients."""

    def measure(self, params: dict[str, torch.Tensor]) -> None:
        """Nothing to measure (see FisherPenalty.measure)."""

    def accumulate(self, measured) -> None:
        """Nothing to accumulate."""

    def __call__(self, params: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        if self.anchor is None:
            return torch.zeros((), device=device)
        squared = sum(((p - self.anchor[name]) ** 2).sum() for name, p in params.items())
        return (self.l2_lambda / 2) * squared

    def consolidate(self, params: dict[str, torch.Tensor]) -> None:
        self.anchor = _clone(params)

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": _clone(self.anchor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor = _clone(state["anchor"])


class FisherPenalty:
    """Online EWC's penalty: a running Fisher from squared gradients, consolidated with decay gamma."""

    def __init__(self, ewc_lambda: float, fisher_decay: float, gamma: float):
        self.ewc_lambda = ewc_lambda
        self.fisher_decay = fisher_decay
        self.gamma = gamma
        self.fisher: dict[str, torch.Tensor] | None = None  # running, decayed mean of squared gradients
        self.anchor: dict[str, torch.Tensor] | None = None
        self.consolidated_fisher: dict[str, torch.Tensor] | None = None

    def observe(self, params: dict[str, torch.Tensor]) -> None:
        """After the data loss's backward, before the penalty's gradient is added: measure and accumulate."""
        self.accumulate(self.measure(params))

    @torch.no_grad()
    def measure(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The squared gradients of the data loss (after its backward, before the penalty's), not yet
        accumulated: a skipped (non-finite) update never reaches the Fisher."""
        return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach() ** 2 for name, p in params.items()}

    @torch.no_grad()
    def accumulate(self, squared: dict[str, torch.Tensor]) -> None:
        """Fold measured squared gradients into the running Fisher."""
        if self.fisher is None:
            self.fisher = squared
            return
        for name, value in squared.items():
            self.fisher[name].mul_(self.fisher_decay).add_(value, alpha=1.0 - self.fisher_decay)

    def __call__(self, params: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        if self.anchor is None:
            return torch.zeros((), device=device)
        weighted = sum((self.consolidated_fisher[name] * (p - self.anchor[name]) ** 2).sum()
                       for name, p in params.items())
        return (self.ewc_lambda / 2) * weighted

    @torch.no_grad()
    def consolidate(self, params: dict[str, torch.Tensor]) -> None:
        self.anchor = _clone(params)
        if self.consolidated_fisher is None:
            self.consolidated_fisher = _clone(self.fisher)
        else:
            for name, value in self.fisher.items():
                self.consolidated_fisher[name].mul_(self.gamma).add_(value)

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": _clone(self.anchor), "fisher": _clone(self.fisher),
                "consolidated_fisher": _clone(self.consolidated_fisher)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor = _clone(state["anchor"])
        self.fisher = _clone(state["fisher"])
        self.consolidated_fisher = _clone(state["consolidated_fisher"])


class _Consolidating(HyperparameterRepr):
    """Fine-tuning plus a penalty component in the training loss, consolidated at boundaries found
    on the strategy's own training loss (a `Boundaries` component). L2 and EWC differ only in
    their penalty (L2Penalty, FisherPenalty).

    Ranks (streamer.distributed): the boundary detector (on the rank's own loss), the anchors and the
    Fisher (from the rank's own gradients, before they are averaged) are kept per rank; the penalised
    gradients are averaged over the ranks, so the model stays one."""

    def _build(self, model: nn.Module, lr: float, clip: float, steps: int, boundary: str, penalty) -> None:
        self.model = model
        self.lr = lr
        self.clip = clip
        self.steps = steps
        self.boundary = boundary
        self._trainer = OnlineTrainer(model, adam(model.parameters(), lr), clip)
        self._boundaries = Boundaries(boundary)  # counts learned batches; consolidations follow its boundaries
        self._penalty = penalty

    @property
    def consolidations(self) -> int:
        return self._boundaries.found

    @property
    def consolidated_at(self) -> tuple[int, ...]:
        """0-based learn index after which each of the last FOUND_LISTED consolidations happened."""
        return self._boundaries.found_at

    @property
    def _detector(self):
        """The boundary detector itself (read-only)."""
        return self._boundaries.detector

    @property
    def anchor(self) -> dict[str, torch.Tensor] | None:
        return _clone(self._penalty.anchor)

    def _named_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def penalty(self) -> torch.Tensor:
        return self._penalty(self._named_parameters(), self._trainer.device())

    def _start_state(self, batch: Batch):
        return self._trainer.start_state(batch)

    def _loss(self, batch: Batch, state):
        return self._trainer.loss(batch, state)

    def predict(self, batch: Batch) -> Prediction:
        return self._trainer.predict(batch, self._trainer.start_state(batch))

    def learn(self, batch: Batch) -> LearnStats:
        trainer = self._trainer
        self.model.train()
        start = trainer.start_state(batch)
        for _ in range(self.steps):
            trainer.optimizer.zero_grad(set_to_none=True)
            data_loss, next_state = trainer.loss(batch, start)
            data_loss.backward()
            measured = self._penalty.measure(self._named_parameters())
            penalty = self.penalty()
            if penalty.requires_grad:
                penalty.backward()  # accumulates onto the data-loss gradients
            grad_norm = trainer.clip_and_step(data_loss + penalty)  # the data gradients are in the norm
            if trainer.skipped:  # non-finite: the Fisher, boundaries and carried state stay as they were
                return LearnStats(loss=(data_loss + penalty).detach(), grad_norm=grad_norm.detach(), skipped=True)
            self._penalty.accumulate(measured)
        trainer.carry(next_state)
        if self._boundaries.update(data_loss.detach()):
            self._penalty.consolidate(self._named_parameters())
        return LearnStats(loss=(data_loss + penalty).detach(), grad_norm=grad_norm.detach())

    def state_dict(self) -> dict[str, Any]:
        boundaries = self._boundaries.state_dict()  # flat keys, as in checkpoints written before boundary.py
        return {
            **self._trainer.state_dict(),
            "learned": boundaries["learned"],
            "consolidated_at": boundaries["found_at"],
            "consolidations": boundaries["found"],
            "detector": boundaries["detector"],  # plain values (monitor.drift.detector_state)
            **self._penalty.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.load_state_dict(state)
        self._boundaries.load_state_dict({"learned": state["learned"], "found_at": state["consolidated_at"],
                                          "found": state.get("consolidations", len(state["consolidated_at"])),
                                          "detector": state["detector"]})
        self._penalty.load_state_dict(state)


class L2(_Consolidating):
    """Fine-tuning plus (l2_lambda / 2) * sum_i (theta_i - anchor_i)^2.

    The anchor is a detached copy of the parameters taken at the last
    consolidation; before the first there is no penalty (plain fine-tuning).

    l2_lambda = 0.01: the penalty's pull balances the data gradient g at a drift
    |theta - anchor| = g / l2_lambda. Per-weight gradients of a byte LSTM are about
    1e-3, so at 0.01 a weight may move about 0.1 from the anchor (the size of an
    initial weight) before the anchor wins. At 1.0 the balance is at 1e-3, about
    one Adam step: on a tiny-LSTM stream (every:20) that froze the model (mean
    prequential loss 5.22 against Naive's 4.40); at 0.01 it stays with Naive (4.40).
    """

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, steps: int = 1,
                 l2_lambda: float = 0.01, boundary: str = "page-hinkley"):
        self.l2_lambda = l2_lambda
        self._build(model, lr, clip, steps, boundary, L2Penalty(l2_lambda))


class EWC(_Consolidating):
    """Online EWC (Schwarz et al. 2018): a Fisher-weighted quadratic penalty to the consolidated weights.

    Every step, with g the gradient of the data loss alone (before clipping):
        F_running <- fisher_decay * F_running + (1 - fisher_decay) * g^2   (F_running = g^2 at the first step)
    At each consolidation:
        anchor <- theta;   F_consolidated <- gamma * F_consolidated + F_running   (F_consolidated = F_running at the first)
    Penalty: (ewc_lambda / 2) * sum_i F_consolidated_i * (theta_i - anchor_i)^2; zero before the first consolidation.

    Defaults (not tuned):
    - fisher_decay = 0.9: the running Fisher averages about the last 10 batches, the
      shortest span Page-Hinkley (min_instances=10) can call a task, so at a boundary
      it describes the task just ending rather than the whole history.
    - gamma = 0.9: detected boundaries include false alarms; with gamma < 1 repeated
      consolidations bound F_consolidated at F / (1 - gamma) = 10 F instead of growing
      without limit, and old tasks fade over about 10 consolidations.
    - ewc_lambda = 1000: F is a decayed mean of squared batch gradients, F ~ g^2, so
      the pull ewc_lambda * F * |theta - anchor| balances the data gradient g at a
      drift of about 1 / (ewc_lambda * g): 0.1 to 0.3 for weights with g ~ 3e-3 to 1e-2
      (measured on a tiny LSTM, F is 1e-5 to 1e-3 on those and ~0 on unused weights,
      which stay free). On a tiny-LSTM stream (every:20) 1000 gave a mean prequential
      loss of 4.35 against Naive's 4.40; 1e5 froze the model (4.77).
    """

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0, steps: int = 1,
                 ewc_lambda: float = 1000.0, fisher_decay: float = 0.9, gamma: float = 0.9,
                 boundary: str = "page-hinkley"):
        if not 0.0 <= fisher_decay < 1.0:
            raise ValueError(f"fisher_decay must be in [0, 1), got {fisher_decay}")
        self.ewc_lambda = ewc_lambda
        self.fisher_decay = fisher_decay
        self.gamma = gamma
        self._build(model, lr, clip, steps, boundary, FisherPenalty(ewc_lambda, fisher_decay, gamma))

    @property
    def fisher(self) -> dict[str, torch.Tensor] | None:
        return _clone(self._penalty.fisher)

    @property
    def consolidated_fisher(self) -> dict[str, torch.Tensor] | None:
        return _clone(self._penalty.consolidated_fisher)
