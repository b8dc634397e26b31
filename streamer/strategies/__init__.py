"""Continual-learning strategies behind one small protocol."""

from streamer.strategies.base import Batch, LearnStats, Prediction, Strategy
from streamer.strategies.naive import Naive
from streamer.strategies.agem import AGEM
from streamer.strategies.regularized import EWC, L2
from streamer.strategies.replay import Replay
from streamer.strategies.distill import KDLogit, KDRep
from streamer.strategies.mbpa import MbPA
from streamer.strategies.experts import Ensemble, MoE, MoELSTM, MoS, PoE, PoELSTM
from streamer.strategies.independent import Independent
from streamer.strategies.adapters import Adapters

__all__ = ["Batch", "LearnStats", "Prediction", "Strategy", "Naive", "EWC", "L2", "Replay", "AGEM",
           "PoE", "MoE", "Ensemble", "PoELSTM", "MoELSTM", "MoS", "Independent", "KDLogit", "KDRep", "MbPA", "Adapters",
           "STRATEGIES"]

STRATEGIES = {"naive": Naive, "replay": Replay, "agem": AGEM, "ewc": EWC, "l2": L2,
              "poe": PoE, "moe": MoE, "ensemble": Ensemble, "poe-lstm": PoELSTM, "moe-lstm": MoELSTM, "mos": MoS,
              "independent": Independent, "kd-logit": KDLogit, "kd-rep": KDRep, "mbpa": MbPA,
              "adapters": Adapters}
