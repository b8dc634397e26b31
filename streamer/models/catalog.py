"""The models by name, torch-free: what `--help`, `streamer models` and the README show.

Each entry is the one place a model's learning-rate default lives; the builders live in
streamer.models.registry (which imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelInfo", "MODEL_CATALOG", "LSTMConfig", "VOCAB_SIZE", "default_lr"]


VOCAB_SIZE = 256  # byte level: every UTF-8 text is in vocabulary, no <unk>


@dataclass(frozen=True)
class LSTMConfig:
    """Sizes of the LSTM models (lstm-char, lstm-word and the experts): their one home for defaults."""

    embedding: int = 64
    hidden: int = 256
    layers: int = 2
    dropout: float = 0.0
    vocab: int = VOCAB_SIZE  # 256 bytes for lstm-char; the corpus vocabulary's size for lstm-word


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str  # one line
    default_lr: float  # Adam's learning rate when --lr is not given
    options: str  # the --model-opt keys it takes, as the README lists them


# 2e-3 trains the LSTMs from scratch; pretrained transformers fine-tuned end to end need a far
# smaller step (hf-classifier collapsed to 3% accuracy at 2e-3 and reached 44% at 5e-5 on
# intents-multilingual).
MODEL_CATALOG: dict[str, ModelInfo] = {info.name: info for info in (
    ModelInfo("lstm-char", "2-layer LSTM over UTF-8 bytes (the default)", 2e-3,
              "--hidden, --embedding, --layers, --dropout"),
    ModelInfo("lstm-word", "the same LSTM over whitespace words; vocabulary from the corpus or CALM's rule", 2e-3,
              "vocab=PATH, per_class=10000"),
    ModelInfo("hf-causal", "a Hugging Face causal LM from local files (default: the built SmolLM2-135M)", 5e-5,
              "path, gguf, name, dtype=float32"),
    ModelInfo("hf-classifier", "an encoder with mean pooling and a growing linear head over labelled utterances "
              "(default: the built all-MiniLM-L6-v2)", 5e-5,
              "path, max_length=64, max_labels=512, freeze_encoder=0, head_lr_scale=20"),
)}


def default_lr(model_name: str) -> float:
    try:
        return MODEL_CATALOG[model_name].default_lr
    except KeyError:
        raise ValueError(f"unknown model {model_name!r} (choose from {', '.join(sorted(MODEL_CATALOG))})") from None
