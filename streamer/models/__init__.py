"""Language models and classifiers the learner trains online, by name (streamer.models.registry)."""

from streamer.models.lstm import LSTMConfig, LSTMLanguageModel, VOCAB_SIZE
from streamer.models.registry import MODELS, BuiltModel, ModelRequest, build_model

__all__ = ["LSTMConfig", "LSTMLanguageModel", "VOCAB_SIZE", "MODELS", "BuiltModel", "ModelRequest", "build_model"]
