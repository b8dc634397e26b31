"""Models by name (`--model`): each builder returns the module and the tokenizer that drives batching.

A builder takes a ModelRequest and returns a BuiltModel. Language models ("lm")
are trained on b x w windows of token ids cut by `make_batcher`; classifiers
("classifier") on padded utterances with revealed labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from streamer.models.lstm import LSTMConfig, LSTMLanguageModel

__all__ = ["ModelRequest", "BuiltModel", "MODELS", "build_model", "byte_encode"]


@dataclass(frozen=True)
class ModelRequest:
    name: str = "lstm-char"
    lstm: LSTMConfig = field(default_factory=LSTMConfig)  # sizes of the LSTM models
    options: tuple[tuple[str, Any], ...] = ()  # the model's own options (--model-opt KEY=VALUE)
    manifest: dict | None = None  # the producer's manifest (corpus, classes, vocabulary), when known
    device: torch.device = torch.device("cpu")


def byte_encode(text: str) -> bytes:
    """lstm-char's tokenizer: UTF-8 bytes, 256 symbols."""
    return text.encode("utf-8")


@dataclass(frozen=True)
class BuiltModel:
    model: nn.Module
    encode: Callable[[str], Any]  # text -> a sequence of token ids (bytes for lstm-char)
    kind: str = "lm"  # "lm" | "classifier"
    name: str = "lstm-char"
    details: dict = field(default_factory=dict)  # what config.json records about the model

    def make_batcher(self, streams: int, window: int, device: torch.device):
        from streamer.batching import Batcher

        return Batcher(streams, window, device, encode=self.encode)


def _lstm_char(request: ModelRequest) -> BuiltModel:
    if request.options:
        raise ValueError(f"model lstm-char takes no --model-opt or [model] option (got "
                         f"{', '.join(k for k, _ in request.options)}); its size is --hidden, --embedding, --layers "
                         "(top-level keys in a --config file)")
    model = LSTMLanguageModel(request.lstm).to(request.device)
    return BuiltModel(model=model, encode=byte_encode, name="lstm-char", details={"tokens": "utf-8 bytes"})


def _lazy(module: str, builder: str) -> Callable[[ModelRequest], BuiltModel]:
    """A builder imported when first called (its module imports this one)."""
    def build(request: ModelRequest) -> BuiltModel:
        import importlib

        return getattr(importlib.import_module(module), builder)(request)
    return build


MODELS: dict[str, Callable[[ModelRequest], BuiltModel]] = {
    "lstm-char": _lstm_char,
    "lstm-word": _lazy("streamer.models.word", "build_lstm_word"),
    "hf-causal": _lazy("streamer.models.hf_causal", "build_hf_causal"),
    "hf-classifier": _lazy("streamer.models.hf_classifier", "build_hf_classifier"),
}


def build_model(request: ModelRequest) -> BuiltModel:
    try:
        builder = MODELS[request.name]
    except KeyError:
        raise ValueError(f"unknown model {request.name!r} (choose from {', '.join(sorted(MODELS))})") from None
    return builder(request)
