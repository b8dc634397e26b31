"""Continual-learning strategies behind one small protocol."""

from streamer.strategies.base import Batch, LearnStats, Prediction, Strategy
from streamer.strategies.naive import Naive
from streamer.strategies.regularized import EWC, L2

__all__ = ["Batch", "LearnStats", "Prediction", "Strategy", "Naive", "EWC", "L2", "STRATEGIES"]

STRATEGIES = {"naive": Naive, "ewc": EWC, "l2": L2}
