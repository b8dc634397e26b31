"""The gates of CALM's expert strategies (streamer.strategies.experts): how expert outputs are combined
(poe: a weighted product, moe: a mixture), the closed-form gradients of a plastic gate's weights, and the
three gates a strategy holds: UniformGate (the ensemble), PlasticGate (a free vector fitted by GateAdam
steps on each batch) and LSTMGate (a GateLSTM reading the input window)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from streamer.distributed import average_gradients, mean_over_ranks
from streamer.strategies.trainer import adam

__all__ = ["poe_log_probs", "moe_log_probs", "poe_gate_gradient", "moe_gate_gradient", "combine", "nll", "GateLSTM",
           "GateAdam", "UniformGate", "PlasticGate", "LSTMGate"]


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


def nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(log_probs.reshape(-1, log_probs.shape[-1]), targets.reshape(-1))


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


def combine(kind: str, logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """poe_log_probs or moe_log_probs by kind ("poe" | "moe")."""
    return (poe_log_probs if kind == "poe" else moe_log_probs)(logits, weights)


class UniformGate:
    """No gate: the experts are always combined with the uniform weights (the ensemble)."""

    module = None
    optimizer = None

    def weights(self, inputs: torch.Tensor, state, uniform, warming_up: bool = False) -> tuple[torch.Tensor, tuple]:
        return uniform(), ()

    def update(self, logits, targets, inputs, state, uniform, warming_up: bool):
        return uniform(), ()

    def backup(self) -> None:
        return None

    def restore(self, kept) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass


class PlasticGate:
    """A free weight vector w (init U(-0.1, 0.1), drawn on the CPU from the global RNG) fitted by
    `steps` GateAdam steps per batch against the experts' detached logits (closed-form gradients)."""

    def __init__(self, kind: str, n: int, steps: int, lr: float, device: torch.device):
        self.kind = kind
        self.steps = steps
        self.module = nn.Parameter(torch.empty(n).uniform_(-0.1, 0.1).to(device))
        self.optimizer = GateAdam(self.module, lr)

    def weights(self, inputs, state, uniform, warming_up: bool = False):
        return (uniform() if warming_up else self.module), ()

    @torch.no_grad()
    def train(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """`steps` Adam steps on w alone against the experts' logits (n, b, w, V), taken as constants.

        The gradient is in closed form (poe_gate_gradient, moe_gate_gradient; the tests check
        it against autograd): a step is then three tensor operations and a GateAdam update,
        several times faster than autograd and torch.optim on these small problems."""
        gradient = (poe_gate_gradient if self.kind == "poe" else moe_gate_gradient)(logits, targets)
        for _ in range(self.steps):  # ranks: fitted on the global batch (the mean of the ranks' gradients)
            self.optimizer.step(mean_over_ranks(gradient(self.module)))

    def update(self, logits, targets, inputs, state, uniform, warming_up: bool):
        self.train(logits, targets)
        return self.weights(inputs, state, uniform, warming_up)

    def backup(self):
        """What `restore` puts back when the update it precedes is skipped (non-finite)."""
        return self.module.detach().clone(), self.optimizer.state_dict()

    @torch.no_grad()
    def restore(self, kept) -> None:
        self.module.copy_(kept[0])
        self.optimizer.load_state_dict(kept[1])

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class LSTMGate:
    """A GateLSTM reading the input window gives per-position weights; one Adam step (lr) per batch
    on the detached expert outputs."""

    def __init__(self, kind: str, vocab: int, n: int, hidden: int, lr: float, device: torch.device):
        self.kind = kind
        self.module = GateLSTM(vocab, n, hidden).to(device)
        self.optimizer = adam(self.module.parameters(), lr)

    def weights(self, inputs, state, uniform, warming_up: bool = False):
        weights, gate_state = self.module(inputs, state)
        return (uniform() if warming_up else weights), gate_state

    def update(self, logits, targets, inputs, state, uniform, warming_up: bool):
        weights, gate_state = self.module(inputs, state)
        self.optimizer.zero_grad(set_to_none=True)
        nll(combine(self.kind, logits, weights), targets).backward()
        average_gradients(self.module.parameters())  # ranks: the global batch's gradient
        self.optimizer.step()
        return (uniform() if warming_up else weights.detach()), gate_state

    def backup(self):
        """What `restore` puts back when the update it precedes is skipped (non-finite)."""
        return ({name: t.clone() for name, t in self.module.state_dict().items()},
                copy.deepcopy(self.optimizer.state_dict()))

    def restore(self, kept) -> None:
        self.module.load_state_dict(kept[0])
        self.optimizer.load_state_dict(kept[1])

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
