"""n independent LSTM language models computed together, by one of two kernels.

Expert i's parameters are exactly those of an `LSTMLanguageModel` with the same `LSTMConfig`:
the embedding and the decoder are stacked (a leading expert dimension n), the LSTM weights are
one nn.LSTM-shaped parameter per expert. Embedding, decoder, clipping and the optimizer work on
all experts at once; the LSTM layers run

- fused: the input projections of all time steps as one batched matmul per layer, the
  recurrence as one `torch.bmm` per time step over all experts (`Recurrence`), on the experts'
  weights stacked once per forward;
- loop: one native `torch.lstm` call per expert and layer (what `nn.LSTM` runs: oneDNN's
  RNN primitive on CPU) on the expert's own weights, as n separate modules would.

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
    load): on the CPU fused for 20 or more experts below hidden 32, loop otherwise. The loop
    kernel makes the same native LSTM calls as n separate nn.LSTM modules, with the decoder,
    clipping and Adam batched, so it matches the module loop at every size; the fused kernel's
    cost per time step is shared by all experts, which pays only for many small ones, and where
    it pays depends on the CPU. Measured by `benchmarks/experts.py --alternate` of the time (one `poe`
    learning step, 1 thread, b=10, w=20, embedding 200, 100 gate steps, the variants' steps
    alternating in one process, median CPU time; +-5% is noise), module loop / kernel for fused
    and loop. An AMD EPYC: 10x32 0.97, 0.97; 30x32 0.92, 1.02; 60x32 0.91, 1.01; 100x32 0.97,
    1.01; 20x16 1.08, 1.05; 30x16 1.11, 1.02; 60x16 1.13, 1.01; 30x24 1.10, 1.05; 10x16 0.96,
    1.00; 10x8 1.09, 1.04; 5x16 0.94, 1.00; 200 and 550 at 5-30 experts 0.30-0.55, 0.98-1.02.
    An Intel Xeon: 10x32 1.05, 1.12; 30x32 1.09, 1.03; 5x200 0.69, 0.96; 10x200 0.76, 1.00;
    30x200 0.68, 0.98; 5x550 0.60, 0.94 (0.98 and 1.02 over 15 steps); 10x550 0.55, 0.96;
    30x550 0.50, 1.02. At hidden 32 and up the loop is at parity on both (the fused kernel's win
    at 30x32 on the Intel was a loss of 9% on the AMD); below 32 with 20 or more experts the
    fused kernel was ahead on the AMD. At 3 experts of hidden 24 (the pinned test's size)
    loop 1.00, fused 0.81-0.90."""
    if device.type != "cpu":
        return "fused"
    return "fused" if hidden < 32 and n >= 20 else "loop"


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
    """n 2-layer (config.layers) LSTM language models, computed together.

    Shapes (V vocab, E embedding, H hidden, gate order i, f, g, o as in nn.LSTM): embedding
    (n, V, E), decoder_weight (n, H, V) (nn.Linear's weight transposed, for one batched matmul)
    and decoder_bias (n, V) are stacked; per layer l, weight_ih_l, weight_hh_l, bias_ih_l and
    bias_hh_l are lists of n parameters, expert i's being nn.LSTM's (4H, in_l), (4H, H), (4H,)
    and (4H,). The loop kernel hands them to the native LSTM as they are, and each expert's
    gradient lands in its own tensor as with n separate modules (a stacked weight would have
    its gradient stacked in a fresh tensor of n times the size every step: on CPU that copy
    and its page faults cost about a tenth of a step at 10 experts of hidden 550); the fused
    kernel stacks them (a copy per forward, small at the sizes it runs on a CPU). The state is
    (h, c), each (layers, n, b, H). Dropout (config.dropout) draws an independent mask per
    expert on the embeddings, between layers and before the decoder.

    Checkpoints of the earlier layout (one stacked (n, in, 4H) tensor per LSTM matrix) are
    refused with one line (ValueError), since their optimizer state has that layout too.
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
        self.decoder_weight = nn.Parameter(torch.empty(n, hidden, vocab))
        self.decoder_bias = nn.Parameter(torch.empty(n, vocab))
        # expert i's first row in the embedding tables seen as one (n*V, E) table (features); not saved
        self.register_buffer("_offsets", torch.arange(0, n * vocab, vocab).view(n, 1, 1), persistent=False)
        for layer in range(config.layers):
            inputs = embedding if layer == 0 else hidden
            shapes = {"weight_ih": (4 * hidden, inputs), "weight_hh": (4 * hidden, hidden),
                      "bias_ih": (4 * hidden,), "bias_hh": (4 * hidden,)}
            for kind, shape in shapes.items():
                setattr(self, f"{kind}_{layer}", nn.ParameterList(nn.Parameter(torch.empty(shape)) for _ in range(n)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As nn.Embedding (N(0, 1)), nn.LSTM (U(+-1/sqrt(H))) and nn.Linear (U(+-1/sqrt(fan_in))).

        Each LSTM matrix is drawn for all experts at once in the input-major shape (n, in, 4H) and
        then laid out per expert, so a seed gives the weights it gave when they were stored so."""
        bound = 1.0 / math.sqrt(self.config.hidden)
        with torch.no_grad():
            self.embedding.normal_()
            for layer in range(self.config.layers):
                for kind, weights in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), self.layer_weights(layer)):
                    shape = weights[0].shape if kind.startswith("bias") else weights[0].t().shape
                    drawn = torch.empty(self.n, *shape, device=weights[0].device).uniform_(-bound, bound)
                    for weight, values in zip(weights, drawn):
                        weight.copy_(values if kind.startswith("bias") else values.t())
            self.decoder_weight.uniform_(-bound, bound)  # fan_in = H
            self.decoder_bias.uniform_(-bound, bound)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if f"{prefix}weight_hh_0" in state_dict:  # now weight_hh_0.0, weight_hh_0.1, ...
            raise ValueError("the checkpoint holds LSTM experts in the stacked layout of earlier streamer versions "
                             "(one (n, in, 4H) tensor per LSTM matrix); this version keeps one nn.LSTM-shaped "
                             "weight per expert: start the run over (--fresh)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def layer_weights(self, layer: int) -> tuple[nn.ParameterList, nn.ParameterList, nn.ParameterList,
                                                 nn.ParameterList]:
        """(weight_ih, weight_hh, bias_ih, bias_hh) of one layer, each a list of n parameters:
        expert i's are nn.LSTM's weight_ih_l, weight_hh_l, bias_ih_l and bias_hh_l."""
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
        # stacked input-major, (n, in, 4H) and (n, H, 4H), so that every batched product reads them in place
        weight_ih, weight_hh = (torch.stack([weight.t() for weight in weights]) for weights in (weight_ih, weight_hh))
        n, b, w, _ = x.shape
        # input projections of every time step at once: (n, b*w, in) @ (n, in, 4H), then time-major
        bias = torch.stack(tuple(bias_ih)) + torch.stack(tuple(bias_hh))
        projected = torch.baddbmm(bias.unsqueeze(1), x.reshape(n, b * w, -1), weight_ih)
        projected = projected.view(n, b, w, -1).permute(2, 0, 1, 3).contiguous()  # (w, n, b, 4H)
        outputs, h, c = Recurrence.apply(projected, weight_hh, h, c)
        return outputs.permute(1, 2, 0, 3), h, c

    def _looped_layer(self, x: torch.Tensor, layer: int, h: torch.Tensor, c: torch.Tensor):
        """As _layer, one native LSTM call per expert on its own weights."""
        outputs, last_h, last_c = [], [], []
        per_expert = zip(x.unbind(0), h.unbind(0), c.unbind(0), *self.layer_weights(layer))
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
        # one embedding lookup over the experts' tables as one (n*V, E) table, expert i's ids offset by i*V:
        # its backward is one embedding_dense_backward, not indexing's index_put (forward and backward
        # 0.28 against 0.41 ms at 10 experts of E 200, b 10, w 20, one thread; n lookups: 0.32-0.45). An id
        # outside the vocabulary is sent beyond the joint table: an IndexError, as with a table each, not
        # expert i + 1's row
        n, vocab, width = self.embedding.shape
        ids = torch.where((inputs >= 0) & (inputs < vocab), inputs, n * vocab)
        x = self._drop(F.embedding(ids.unsqueeze(0) + self._offsets, self.embedding.reshape(n * vocab, width)))
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

    def _stacked_parameters(self) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        return self.embedding, self.decoder_weight, self.decoder_bias

    def _per_expert_grads(self) -> list[list[torch.Tensor]]:
        """Expert i's gradients of the per-expert (LSTM) parameters, for each i; a missing one is left out."""
        grads = [[] for _ in range(self.n)]
        for layer in range(self.config.layers):
            for weights in self.layer_weights(layer):
                for expert, weight in zip(grads, weights):
                    if weight.grad is not None:
                        expert.append(weight.grad)
        return grads

    def per_expert_grad_norms(self) -> torch.Tensor:
        """(n,) L2 norm of each expert's gradient over all its parameters (0 where there is none)."""
        # per parameter and expert norms, then their norm: no squared copy of every gradient (hundreds of MB
        # for 30 experts of hidden 550); torch._foreach_norm: one call for a list, as clip_grad_norm_ does
        zero = torch.zeros((), device=self.embedding.device)
        norms = [torch.linalg.vector_norm(p.grad.reshape(self.n, -1), dim=1) for p in self._stacked_parameters()
                 if p.grad is not None]
        per_expert = self._per_expert_grads()
        if any(per_expert):  # each expert's LSTM gradients together
            norms.append(torch.stack([torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads
                                      else zero for grads in per_expert]))
        if not norms:
            return torch.zeros(self.n, device=self.embedding.device)
        return torch.linalg.vector_norm(torch.stack(norms), dim=0)

    @torch.no_grad()
    def clip_grad_norms_(self, max_norm: float) -> torch.Tensor:
        """Clip each expert's gradient to norm max_norm (as clip_grad_norm_ per module); returns the norms before."""
        norms = self.per_expert_grad_norms()
        scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for p in self._stacked_parameters():
            if p.grad is not None:
                p.grad.mul_(scale.view(-1, *([1] * (p.grad.dim() - 1))))
        for grads, expert_scale in zip(self._per_expert_grads(), scale.unbind()):
            if grads:
                torch._foreach_mul_(grads, expert_scale)
        return norms
