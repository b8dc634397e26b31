"""Language models and classifiers the learner trains online, by name (streamer.models.registry)."""

from __future__ import annotations

import importlib

__all__ = ["LSTMConfig", "LSTMLanguageModel", "VOCAB_SIZE", "MODELS", "BuiltModel", "ModelRequest", "build_model"]

# Imported on first use, so that `import streamer.models.catalog` (what `--help` reads) does not import torch.
_HOMES = {"LSTMConfig": "streamer.models.catalog", "VOCAB_SIZE": "streamer.models.catalog",
          "LSTMLanguageModel": "streamer.models.lstm", "MODELS": "streamer.models.registry",
          "BuiltModel": "streamer.models.registry", "ModelRequest": "streamer.models.registry",
          "build_model": "streamer.models.registry"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
