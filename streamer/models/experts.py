"""n independent LSTM language models computed as one batched model (no Python loop over experts).

Every parameter carries a leading expert dimension n; expert i's slice holds exactly
the weights of an `LSTMLanguageModel` with the same `LSTMConfig`. The input
projections of all time steps are one batched matmul per layer; only the recurrence
loops, over the w time steps.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from streamer.models.lstm import LSTMConfig

__all__ = ["LSTMExperts", "Recurrence"]


class Recurrence(torch.autograd.Function):
    """The LSTM recurrence of n experts over w steps, with a hand-written backward.

    forward(projected (w, n, b, 4H): input projections plus biases, weight_hh (n, H, 4H),
    h (n, b, H), c (n, b, H)) -> (outputs (w, n, b, H), last h, last c). Gate order i, f, g, o.

    Autograd through the step loop would form the recurrent weight's gradient as w small
    batched matmuls (inner size b) and w accumulations of an (n, H, 4H) tensor; here it is one
    batched matmul over all steps (inner size w*b), as the native nn.LSTM does. Measured on CPU,
    one thread (30 experts, hidden 200, b=10, w=20), forward and backward of one layer: 281 ms
    against 377 ms through autograd. The tests check it with gradcheck and against nn.LSTM.
    """

    @staticmethod
    def forward(ctx, projected, weight_hh, h, c):
        w, n, b, four_hidden = projected.shape
        hidden = four_hidden // 4
        gates = torch.empty_like(projected)  # activated: sigmoid(i), sigmoid(f), tanh(g), sigmoid(o)
        cells = projected.new_empty(w + 1, n, b, hidden)
        states = projected.new_empty(w + 1, n, b, hidden)
        cells[0], states[0] = c, h
        for t in range(w):
            step = torch.bmm(states[t], weight_hh, out=gates[t]).add_(projected[t])  # faster than baddbmm on CPU
            step[..., : 2 * hidden].sigmoid_()
            step[..., 2 * hidden: 3 * hidden].tanh_()
            step[..., 3 * hidden:].sigmoid_()
            i, f, g, o = step.chunk(4, dim=-1)
            torch.addcmul(f * cells[t], i, g, out=cells[t + 1])
            torch.mul(o, cells[t + 1].tanh(), out=states[t + 1])
        ctx.save_for_backward(weight_hh)
        ctx.gates, ctx.cells, ctx.states = gates, cells, states
        return states[1:].clone(), states[w].clone(), cells[w].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_outputs, grad_h, grad_c):
        (weight_hh,) = ctx.saved_tensors
        gates, cells, states = ctx.gates, ctx.cells, ctx.states
        w, n, b, four_hidden = gates.shape
        grad_gates = torch.empty_like(gates)
        recurrent_t = weight_hh.transpose(1, 2)  # (n, 4H, H)
        dh, dc = grad_h, grad_c
        for t in reversed(range(w)):
            i, f, g, o = gates[t].chunk(4, dim=-1)
            dh = dh + grad_outputs[t]
            tanh_c = cells[t + 1].tanh()
            dc = torch.addcmul(dc, dh * o, 1 - tanh_c * tanh_c)
            torch.cat([dc * g * i * (1 - i), dc * cells[t] * f * (1 - f), dc * i * (1 - g * g),
                       dh * tanh_c * o * (1 - o)], dim=-1, out=grad_gates[t])
            dh = torch.bmm(grad_gates[t], recurrent_t)
            dc = dc * f
        hidden = four_hidden // 4
        previous = states[:w].permute(1, 3, 0, 2).reshape(n, hidden, w * b)  # h_{t-1} of every step
        grad_weight = torch.bmm(previous, grad_gates.transpose(0, 1).reshape(n, w * b, four_hidden))
        return grad_gates, grad_weight, dh, dc


class LSTMExperts(nn.Module):
    """n 2-layer (config.layers) LSTM language models with stacked parameters.

    Shapes (V vocab, E embedding, H hidden, gate order i, f, g, o as in nn.LSTM):
    embedding (n, V, E); per layer l weight_ih_l (n, in_l, 4H), weight_hh_l (n, H, 4H),
    bias_ih_l and bias_hh_l (n, 4H); decoder_weight (n, H, V), decoder_bias (n, V). Matrices
    are stored input-major (nn.LSTM's and nn.Linear's weights transposed), so every batched
    matmul reads them in place (through a transposed view, autograd copies the gradient).
    The state is (h, c), each (layers, n, b, H). Dropout (config.dropout) draws an
    independent mask per expert on the embeddings, between layers and before the decoder.
    """

    def __init__(self, n: int, config: LSTMConfig = LSTMConfig()):
        super().__init__()
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        self.n = n
        self.config = config
        vocab, embedding, hidden = config.vocab, config.embedding, config.hidden
        self.embedding = nn.Parameter(torch.empty(n, vocab, embedding))
        for layer in range(config.layers):
            inputs = embedding if layer == 0 else hidden
            self.register_parameter(f"weight_ih_{layer}", nn.Parameter(torch.empty(n, inputs, 4 * hidden)))
            self.register_parameter(f"weight_hh_{layer}", nn.Parameter(torch.empty(n, hidden, 4 * hidden)))
            self.register_parameter(f"bias_ih_{layer}", nn.Parameter(torch.empty(n, 4 * hidden)))
            self.register_parameter(f"bias_hh_{layer}", nn.Parameter(torch.empty(n, 4 * hidden)))
        self.decoder_weight = nn.Parameter(torch.empty(n, hidden, vocab))
        self.decoder_bias = nn.Parameter(torch.empty(n, vocab))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As nn.Embedding (N(0, 1)), nn.LSTM (U(+-1/sqrt(H))) and nn.Linear (U(+-1/sqrt(fan_in)))."""
        bound = 1.0 / math.sqrt(self.config.hidden)
        with torch.no_grad():
            self.embedding.normal_()
            for layer in range(self.config.layers):
                for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    getattr(self, f"{kind}_{layer}").uniform_(-bound, bound)
            self.decoder_weight.uniform_(-bound, bound)  # fan_in = H
            self.decoder_bias.uniform_(-bound, bound)

    def layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight_ih, weight_hh, bias_ih, bias_hh) of one layer, each with the expert dimension first."""
        return tuple(getattr(self, f"{kind}_{layer}") for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        shape = (self.config.layers, self.n, batch_size, self.config.hidden)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.config.dropout, self.training) if self.config.dropout > 0 else x

    def _layer(self, x: torch.Tensor, layer: int, h: torch.Tensor, c: torch.Tensor):
        """x (n, b, w, in), h and c (n, b, H) -> outputs (n, b, w, H), last h, last c."""
        weight_ih, weight_hh, bias_ih, bias_hh = self.layer_weights(layer)
        n, b, w, _ = x.shape
        # input projections of every time step at once: (n, b*w, in) @ (n, in, 4H), then time-major
        projected = torch.baddbmm((bias_ih + bias_hh).unsqueeze(1), x.reshape(n, b * w, -1), weight_ih)
        projected = projected.view(n, b, w, -1).permute(2, 0, 1, 3).contiguous()  # (w, n, b, 4H)
        outputs, h, c = Recurrence.apply(projected, weight_hh, h, c)
        return outputs.permute(1, 2, 0, 3), h, c

    def features(self, inputs: torch.Tensor, state):
        """inputs (b, w) token ids -> top-layer hidden states (n, b, w, H), next state."""
        h0, c0 = state
        x = self._drop(self.embedding[:, inputs])  # (n, b, w, E)
        last_h, last_c = [], []
        for layer in range(self.config.layers):
            if layer > 0:
                x = self._drop(x)  # nn.LSTM's dropout between layers
            x, h, c = self._layer(x, layer, h0[layer], c0[layer])
            last_h.append(h)
            last_c.append(c)
        return x, (torch.stack(last_h), torch.stack(last_c))

    def forward(self, inputs: torch.Tensor, state):
        """inputs (b, w) token ids -> logits (n, b, w, V) of every expert, next state."""
        hidden, state = self.features(inputs, state)
        n, b, w, _ = hidden.shape
        logits = torch.baddbmm(self.decoder_bias.unsqueeze(1), self._drop(hidden).reshape(n, b * w, -1),
                               self.decoder_weight)
        return logits.view(n, b, w, -1), state

    def per_expert_grad_norms(self) -> torch.Tensor:
        """(n,) L2 norm of each expert's gradient over all its parameters (0 where there is none)."""
        squares = [p.grad.reshape(self.n, -1).pow(2).sum(1) for p in self.parameters() if p.grad is not None]
        if not squares:
            return torch.zeros(self.n, device=self.embedding.device)
        return torch.stack(squares).sum(0).sqrt()

    @torch.no_grad()
    def clip_grad_norms_(self, max_norm: float) -> torch.Tensor:
        """Clip each expert's gradient to norm max_norm (as clip_grad_norm_ per module); returns the norms before."""
        norms = self.per_expert_grad_norms()
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.view(-1, *([1] * (p.grad.dim() - 1))))
        return norms
