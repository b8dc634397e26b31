"""Continual-learning strategies behind one small protocol."""

from streamer.strategies.base import Batch, LearnStats, Prediction, Strategy
from streamer.strategies.naive import Naive

__all__ = ["Batch", "LearnStats", "Prediction", "Strategy", "Naive", "STRATEGIES"]

STRATEGIES = {"naive": Naive}
