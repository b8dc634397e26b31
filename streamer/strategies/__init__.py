"""Continual-learning strategies behind one small protocol (predict, learn, state_dict, load_state_dict).

Importing this package does not import torch: the catalog (names, one-line descriptions)
and the hyperparameter helpers are torch-free, and the strategy classes, the protocol's
values and `STRATEGIES` (name -> class) are imported on first use (PEP 562 `__getattr__`).

Strategies are built by composition: each holds the parts it needs and calls them in
`learn`/`predict`: an OnlineTrainer (trainer.py: optimizer, clip, carried hidden state),
a SparseReplay with its ReservoirMemory/HerdingMemory (replay.py, memory.py), Boundaries
(boundary.py), a penalty (regularized.py: L2Penalty, FisherPenalty), a Distillation teacher
(distill.py) or a gate (gates.py: UniformGate, PlasticGate, LSTMGate). Hyperparameters are
exactly the `__init__` arguments (params.py gives repr, clone and the config record).
"""

from __future__ import annotations

import importlib
from typing import Any

from streamer.strategies.catalog import STRATEGY_CATALOG, StrategyInfo, strategy_class
from streamer.strategies.params import clone, config_record, hyperparameters

__all__ = ["Batch", "LearnStats", "Prediction", "Strategy", "Naive", "EWC", "L2", "Replay", "AGEM",
           "PoE", "MoE", "Ensemble", "PoELSTM", "MoELSTM", "MoS", "Independent", "KDLogit", "KDRep", "MbPA", "Adapters",
           "STRATEGIES", "STRATEGY_CATALOG", "StrategyInfo", "strategy_class", "hyperparameters", "clone",
           "config_record"]

_LAZY = {"Batch": "base", "LearnStats": "base", "Prediction": "base", "Strategy": "base",
         **{info.class_name: info.module.rsplit(".", 1)[1] for info in STRATEGY_CATALOG.values()}}


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":
        value: Any = {key: strategy_class(key) for key in STRATEGY_CATALOG}
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
