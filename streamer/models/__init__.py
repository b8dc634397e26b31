"""Language models the learner trains online."""

from streamer.models.lstm import LSTMConfig, LSTMLanguageModel, VOCAB_SIZE

__all__ = ["LSTMConfig", "LSTMLanguageModel", "VOCAB_SIZE"]
