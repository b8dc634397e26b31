"""`--params N`: size each strategy's model to about N parameters (CALM compares at equal size).

The hidden size of the template LSTM (`LSTMConfig.hidden`, every layer) is searched so
that the parameter count of `strategy.model` (frozen ones included: adapters' frozen
base counts, as in the tables' params column) comes closest to the budget;
the strategy is built for the count, since e.g. poe builds n experts from the template's
config and independent counts one class's model (its per-class models each get the
budget). Builds happen on the meta device (no memory, no initialisation cost), falling
back to the CPU for a strategy that cannot be built there. Models whose size does not
follow the hidden size (pretrained ones: any model not in SIZED_BY_HIDDEN) are refused
with a clear message before anything is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from streamer.config import LearnConfig

__all__ = ["BudgetError", "FittedBudget", "fit_hidden", "fit_to_budget", "trainable_parameters",
           "strategy_parameters"]

MAX_HIDDEN = 1 << 16
SIZED_BY_HIDDEN = ("lstm-char", "lstm-word")  # models built from LSTMConfig; others (pretrained) are refused at once


class BudgetError(ValueError):
    """The budget cannot be met (a fixed-size model, or a budget below the smallest model)."""


@dataclass(frozen=True)
class FittedBudget:
    budget: int
    hidden: int
    parameters: int  # parameters of strategy.model at that hidden size, frozen ones included

    @property
    def relative_error(self) -> float:
        return (self.parameters - self.budget) / self.budget

    def describe(self, strategy: str) -> str:
        """One line: the budget, the hidden size chosen and the parameters it gives."""
        return (f"--params {self.budget:,}: {strategy} with hidden {self.hidden} has {self.parameters:,} "
                f"parameters ({self.relative_error:+.1%})")


def trainable_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def strategy_parameters(config: LearnConfig, manifest: dict | None = None) -> int:
    """Parameters of `strategy.model` for a LearnConfig, frozen ones included (built on meta, else CPU)."""
    from streamer.learner import build_strategy

    try:
        with torch.device("meta"):
            strategy, _ = build_strategy(config, torch.device("meta"), manifest)
    except (RuntimeError, NotImplementedError, TypeError):  # an operation meta tensors do not support
        strategy, _ = build_strategy(config, torch.device("cpu"), manifest)
    return sum(p.numel() for p in strategy.model.parameters())


def fit_hidden(count: Callable[[int], int], budget: int, *, max_hidden: int = MAX_HIDDEN) -> tuple[int, int]:
    """(hidden, count(hidden)) with count closest to `budget`, for a `count` increasing in hidden.

    Doubles an upper bound, then binary-searches the smallest hidden whose count reaches
    the budget and keeps it or its predecessor, whichever is closer (ties: the smaller)."""
    if budget < 1:
        raise BudgetError(f"--params must be positive, got {budget}")
    cache: dict[int, int] = {}

    def at(hidden: int) -> int:
        if hidden not in cache:
            cache[hidden] = count(hidden)
        return cache[hidden]

    if at(1) >= budget:
        return 1, at(1)
    low, high = 1, 2  # count(low) < budget
    while at(high) < budget:
        if high >= max_hidden:
            return high, at(high)
        low, high = high, min(2 * high, max_hidden)
    while high - low > 1:  # count(low) < budget <= count(high)
        middle = (low + high) // 2
        if at(middle) < budget:
            low = middle
        else:
            high = middle
    if budget - at(low) <= at(high) - budget:
        return low, at(low)
    return high, at(high)


def fit_to_budget(config: LearnConfig, budget: int,
                  manifest: dict | None = None) -> tuple[LearnConfig, FittedBudget]:
    """(config with the fitted hidden size, FittedBudget) for a LearnConfig and a budget N."""

    def with_hidden(hidden: int):
        return dataclasses.replace(config, model=dataclasses.replace(config.model, hidden=hidden))

    def count(hidden: int) -> int:
        return strategy_parameters(with_hidden(hidden), manifest)

    if config.model_name not in SIZED_BY_HIDDEN or count(8) == count(16):
        raise BudgetError(f"--params sizes the hidden layers of models built from --hidden "
                          f"({', '.join(SIZED_BY_HIDDEN)}); model {config.model_name!r} has a fixed size "
                          f"(pretrained): drop --params")
    smallest = count(1)
    if budget < smallest:
        raise BudgetError(f"--params {budget:,} is below the smallest {config.strategy} model on "
                          f"{config.model_name} ({smallest:,} parameters at hidden 1; lower --embedding)")
    hidden, parameters = fit_hidden(count, budget)
    return with_hidden(hidden), FittedBudget(budget, hidden, parameters)
