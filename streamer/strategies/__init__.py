"""Continual-learning strategies behind one small protocol."""

from streamer.strategies.base import Batch, LearnStats, Prediction, Strategy
from streamer.strategies.naive import Naive
from streamer.strategies.agem import AGEM
from streamer.strategies.regularized import EWC, L2
from streamer.strategies.replay import Replay

__all__ = ["Batch", "LearnStats", "Prediction", "Strategy", "Naive", "EWC", "L2", "Replay", "AGEM", "STRATEGIES"]

STRATEGIES = {"naive": Naive, "replay": Replay, "agem": AGEM, "ewc": EWC, "l2": L2}
