"""n independent LSTM language models with stacked parameters, computed by one of two kernels.

Every parameter carries a leading expert dimension n; expert i's slice holds exactly
the weights of an `LSTMLanguageModel` with the same `LSTMConfig`. Embedding, decoder,
clipping and the optimizer always work on the stacked tensors; the LSTM layers run

- fused: the input projections of all time steps as one batched matmul per layer, the
  recurrence as one `torch.bmm` per time step over all experts (`Recurrence`);
- loop: one native `torch.lstm` call per expert and layer (what `nn.LSTM` runs: oneDNN's
  RNN primitive on CPU) on the stacked weights, copied into its (4H, in) layout once per layer.

`kernel="auto"` (the default) takes fused on a GPU, and on the CPU the one measured faster
for the size (`choose_kernel`). Both give the same numbers up to float rounding (tested to 1e-5
over learning steps); the choice depends only on device and size, so runs stay reproducible.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from streamer.models.lstm import LSTMConfig

__all__ = ["KERNELS", "LSTMExperts", "Recurrence", "choose_kernel"]

KERNELS = ("auto", "fused", "loop")


def choose_kernel(device: torch.device, n: int, hidden: int) -> str:
    """The kernel "auto" runs: fused on a GPU; on the CPU the faster one for n experts of this size.

    The rule is fixed (no timing at run time, so a run's numbers never depend on the machine's
    load): loop from hidden 64 on, fused below. Measured by benchmarks/experts.py (one `poe`
    learning step, 1 thread, b=10, w=20, CPU ms fused/loop for 5, 10, 30 experts, on a shared
    2-core machine, so a few percent is noise): hidden 32: 41/65, 70/91, 160/203 (and the fused
    kernel keeps small runs' numbers as they were); hidden 200: 161/178, 321/316, 951/847; hidden
    550: 961/763, 1591/1711, 5818/5038. The loop kernel's overhead over n separate nn.LSTM modules
    (about 30% of the step at 10 x 550) is the copies between the stacked input-major weights and
    the native kernel's layout (weights transposed, gradients stacked and transposed back)."""
    if device.type != "cpu":
        return "fused"
    return "fused" if hidden < 64 else "loop"


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

    def __init__(self, n: int, config: LSTMConfig = LSTMConfig(), kernel: str = "auto"):
        super().__init__()
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.n = n
        self.kernel = kernel  # "auto", "fused" or "loop": see the module docstring
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

    def kernel_for(self, device: torch.device) -> str:
        """The kernel that runs on `device`: self.kernel, or choose_kernel's for "auto"."""
        return choose_kernel(device, self.n, self.config.hidden) if self.kernel == "auto" else self.kernel

    def _layer(self, x: torch.Tensor, layer: int, h: torch.Tensor, c: torch.Tensor):
        """x (n, b, w, in), h and c (n, b, H) -> outputs (n, b, w, H), last h, last c."""
        if self.kernel_for(x.device) == "loop":
            return self._looped_layer(x, layer, h, c)
        weight_ih, weight_hh, bias_ih, bias_hh = self.layer_weights(layer)
        n, b, w, _ = x.shape
        # input projections of every time step at once: (n, b*w, in) @ (n, in, 4H), then time-major
        projected = torch.baddbmm((bias_ih + bias_hh).unsqueeze(1), x.reshape(n, b * w, -1), weight_ih)
        projected = projected.view(n, b, w, -1).permute(2, 0, 1, 3).contiguous()  # (w, n, b, 4H)
        outputs, h, c = Recurrence.apply(projected, weight_hh, h, c)
        return outputs.permute(1, 2, 0, 3), h, c

    def _looped_layer(self, x: torch.Tensor, layer: int, h: torch.Tensor, c: torch.Tensor):
        """As _layer, one native LSTM call per expert; unbind's backward stacks the gradients in one copy."""
        outputs, last_h, last_c = [], [], []
        weight_ih, weight_hh, bias_ih, bias_hh = self.layer_weights(layer)
        # one copy per layer into the native (4H, in) layout: measured faster than a transposed view per expert
        native = (weight_ih.transpose(1, 2).contiguous(), weight_hh.transpose(1, 2).contiguous(), bias_ih, bias_hh)
        per_expert = zip(x.unbind(0), h.unbind(0), c.unbind(0), *(w.unbind(0) for w in native))
        for x_i, h_i, c_i, *weights in per_expert:
            out, h_n, c_n = torch.lstm(x_i, (h_i.unsqueeze(0), c_i.unsqueeze(0)), weights,
                                       True, 1, 0.0, self.training, False, True)  # biases, 1 layer, batch first
            outputs.append(out.transpose(0, 1))  # (w, b, H)
            last_h.append(h_n[0])
            last_c.append(c_n[0])
        # laid out (w, n, b, H) in memory as the fused kernel's: dropout draws its mask in memory order
        return torch.stack(outputs, dim=1).permute(1, 2, 0, 3), torch.stack(last_h), torch.stack(last_c)

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
        # per parameter (n,) norms, then their norm: no squared copy of every gradient (hundreds of MB for
        # 30 experts of hidden 550)
        norms = [torch.linalg.vector_norm(p.grad.reshape(self.n, -1), dim=1) for p in self.parameters()
                 if p.grad is not None]
        if not norms:
            return torch.zeros(self.n, device=self.embedding.device)
        return torch.linalg.vector_norm(torch.stack(norms), dim=0)

    @torch.no_grad()
    def clip_grad_norms_(self, max_norm: float) -> torch.Tensor:
        """Clip each expert's gradient to norm max_norm (as clip_grad_norm_ per module); returns the norms before."""
        norms = self.per_expert_grad_norms()
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.view(-1, *([1] * (p.grad.dim() - 1))))
        return norms
