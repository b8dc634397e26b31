"""A mixture-of-softmaxes LSTM language model (Yang et al. 2018; CALM's MoS baseline)."""

from __future__ import annotations

import torch
from torch import nn

from streamer.models.lstm import LSTMConfig

__all__ = ["MixtureOfSoftmaxes"]


class MixtureOfSoftmaxes(nn.Module):
    """Embedding -> LSTM -> K softmaxes mixed by a prior computed from the same hidden state.

    With h the top-layer LSTM output at one position:
        pi = softmax(W_pi h)                          (K,)  (W_pi without bias, as in Yang et al.)
        p_k = softmax(W_dec tanh(W_k h + b_k) + b_dec)  (V,)  one shared decoder, latent size H
        p = sum_k pi_k p_k
    `forward` returns log p (b, w, V), computed with logsumexp over log-probabilities. They
    stand where logits stand: cross_entropy(log p, y) = -log p_y because log_softmax of a
    normalised log-distribution is the identity.
    """

    def __init__(self, config: LSTMConfig = LSTMConfig(), components: int = 5):
        super().__init__()
        if components < 1:
            raise ValueError(f"components must be at least 1, got {components}")
        self.config = config
        self.components = components
        self.embed = nn.Embedding(config.vocab, config.embedding)
        self.drop = nn.Dropout(config.dropout)
        self.lstm = nn.LSTM(
            config.embedding, config.hidden, num_layers=config.layers,
            dropout=config.dropout if config.layers > 1 else 0.0, batch_first=True,
        )
        self.prior = nn.Linear(config.hidden, components, bias=False)
        self.latent = nn.Linear(config.hidden, components * config.hidden)
        self.decode = nn.Linear(config.hidden, config.vocab)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        shape = (self.config.layers, batch_size, self.config.hidden)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def features(self, inputs: torch.Tensor, state):
        """inputs: (b, w) token ids -> top-layer hidden states (b, w, hidden), next state."""
        hidden, state = self.lstm(self.drop(self.embed(inputs)), state)
        return hidden, state

    def forward(self, inputs: torch.Tensor, state):
        """inputs: (b, w) token ids -> log-probabilities (b, w, vocab), next state."""
        hidden, state = self.features(inputs, state)
        hidden = self.drop(hidden)
        log_prior = self.prior(hidden).log_softmax(-1)  # (b, w, K)
        b, w, _ = hidden.shape
        latent = torch.tanh(self.latent(hidden)).view(b, w, self.components, self.config.hidden)
        log_components = self.decode(self.drop(latent)).log_softmax(-1)  # (b, w, K, V)
        return torch.logsumexp(log_components + log_prior.unsqueeze(-1), dim=2), state
