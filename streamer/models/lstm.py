"""A 2-layer LSTM language model over UTF-8 bytes (256 symbols)."""

from __future__ import annotations

import torch
from torch import nn

from streamer.models.catalog import VOCAB_SIZE, LSTMConfig

__all__ = ["LSTMConfig", "LSTMLanguageModel", "VOCAB_SIZE"]


class LSTMLanguageModel(nn.Module):
    """Embedding -> LSTM -> linear decoder; the caller carries the hidden state."""

    def __init__(self, config: LSTMConfig = LSTMConfig()):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.embedding)
        self.drop = nn.Dropout(config.dropout)
        self.lstm = nn.LSTM(
            config.embedding, config.hidden, num_layers=config.layers,
            dropout=config.dropout if config.layers > 1 else 0.0, batch_first=True,
        )
        self.decode = nn.Linear(config.hidden, config.vocab)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        shape = (self.config.layers, batch_size, self.config.hidden)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def features(self, inputs: torch.Tensor, state):
        """inputs: (b, w) token ids -> top-layer hidden states (b, w, hidden), next state.

        The representation that kd-rep matches and MbPA++ keys its memory on."""
        hidden, state = self.lstm(self.drop(self.embed(inputs)), state)
        return hidden, state

    def forward(self, inputs: torch.Tensor, state):
        """inputs: (b, w) token ids -> logits (b, w, vocab), next state."""
        hidden, state = self.features(inputs, state)
        return self.decode(self.drop(hidden)), state
