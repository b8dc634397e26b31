"""The strategies by name, with one-line descriptions, without importing torch.

`--help` and the views read names and descriptions from here; `strategy_class(name)`
imports the strategy's module only when asked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["StrategyInfo", "STRATEGY_CATALOG", "strategy_class"]


@dataclass(frozen=True)
class StrategyInfo:
    name: str  # as on the command line
    description: str  # one line
    module: str
    class_name: str
    oracle: bool = False  # reads the ground-truth class (a bound, not a continual learner)


def _info(name: str, description: str, module: str, class_name: str, oracle: bool = False) -> StrategyInfo:
    return StrategyInfo(name, description, f"streamer.strategies.{module}", class_name, oracle)


STRATEGY_CATALOG: dict[str, StrategyInfo] = {info.name: info for info in (
    _info("naive", "online fine-tuning: one Adam step per batch", "naive", "Naive"),
    _info("replay", "sparse experience replay from a reservoir (or herded) memory", "replay", "Replay"),
    _info("agem", "A-GEM: project the gradient against a reference gradient from memory", "agem", "AGEM"),
    _info("ewc", "online EWC: Fisher-weighted pull to weights consolidated at found boundaries", "regularized", "EWC"),
    _info("l2", "L2 pull to weights consolidated at found boundaries", "regularized", "L2"),
    _info("poe", "product of LSTM experts with a plastic gate vector", "experts", "PoE"),
    _info("moe", "mixture of LSTM experts with a plastic gate vector", "experts", "MoE"),
    _info("ensemble", "uniform mixture of LSTM experts", "experts", "Ensemble"),
    _info("poe-lstm", "product of LSTM experts weighted by a gate LSTM", "experts", "PoELSTM"),
    _info("moe-lstm", "mixture of LSTM experts weighted by a gate LSTM", "experts", "MoELSTM"),
    _info("mos", "online fine-tuning of a mixture-of-softmaxes LSTM", "experts", "MoS"),
    _info("independent", "one model per ground-truth class (Ind. LSTM oracle)", "independent", "Independent",
          oracle=True),
    _info("kd-logit", "replay plus distillation of a frozen snapshot's logits", "distill", "KDLogit"),
    _info("kd-rep", "replay plus distillation of a frozen snapshot's representations", "distill", "KDRep"),
    _info("mbpa", "MbPA++: sparse replay, local adaptation on nearest memories at prediction", "mbpa", "MbPA"),
    _info("adapters", "AdapterCL: frozen base, one residual adapter set per found distribution", "adapters",
          "Adapters"),
)}


def strategy_class(name: str) -> type:
    """The strategy class registered as `name` (imports its module, and so torch)."""
    try:
        info = STRATEGY_CATALOG[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(sorted(STRATEGY_CATALOG))}") from None
    return getattr(importlib.import_module(info.module), info.class_name)
