"""Hyperparameters from the signature (river's `_get_params`): repr, clone and the config record.

A strategy's hyperparameters are exactly its `__init__` arguments other than `model`,
stored on the instance under the same names; its runtime state lives in private
attributes. Everything here reads the signature, so no strategy writes its own: `signature(cls)` adds each
argument's type (its annotation) and range, which `--set` checking and `streamer strategies` read.
Torch-free.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import MISSING, dataclass
from typing import Any

__all__ = ["hyperparameters", "HyperparameterRepr", "clone", "config_record", "Hyperparameter", "HyperparameterError",
           "signature", "TRAINER_KEYS"]

_SKIPPED = ("self", "model")
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def hyperparameters(obj: Any) -> dict[str, Any]:
    """{name: current value} for every `__init__` argument of `type(obj)` except `model`, in signature order."""
    signature = inspect.signature(type(obj).__init__)
    return {name: getattr(obj, name) for name, parameter in signature.parameters.items()
            if name not in _SKIPPED and parameter.kind not in _VARIADIC}


class HyperparameterRepr:
    """Mixin: `Name(a=1, b='x')` from the signature's hyperparameters (the only __repr__ in strategies)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in hyperparameters(self).items())
        return f"{type(self).__name__}({fields})"


def clone(strategy: Any, model: Any) -> Any:
    """A new strategy of the same class and hyperparameters, with fresh state, around `model`."""
    return type(strategy)(model, **hyperparameters(strategy))


def config_record(strategy: Any) -> dict[str, Any]:
    """What config.json stores about a strategy: its class, hyperparameters and oracle flag (plain values)."""
    cls = type(strategy)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "hyperparameters": hyperparameters(strategy),
        "oracle": bool(getattr(cls, "oracle", False)),
    }


# --- the signature with types and ranges: the source of --set checking and of `streamer strategies` ---

_KINDS = {"int": int, "float": float, "str": str, "bool": bool, int: int, float: float, str: str, bool: bool}
_BOUNDARY_DETECTORS = ("page-hinkley", "adwin", "kswin", "none")  # monitor.drift.DETECTORS and none (a test checks)
# value ranges by name: (low, high, low included, high included); anything absent: only the type is checked
_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    **{name: (0.0, 1.0, True, True) for name in ("p_write", "gamma")},
    "fisher_decay": (0.0, 1.0, True, False),  # 1 would keep the first batch's Fisher for ever (EWC refuses it)
    **{name: (1, None, True, True) for name in ("steps", "n_replay", "memory_size", "n_ref", "n_experts", "gate_steps",
                                          "gate_hidden", "n_components", "neighbours", "bottleneck", "max_adapters",
                                          "r_interval")},
    **{name: (0, None, True, True) for name in ("warmup_batches", "local_steps", "ewc_lambda", "l2_lambda", "alpha",
                                          "local_lambda", "seed")},
    **{name: (0.0, None, False, True) for name in ("lr", "clip", "gate_lr", "local_lr")},
}
# text values by name, and by (class name, name) where one class differs
_CHOICES: dict[str, tuple[str, ...]] = {"selection": ("reservoir", "herding")}
_CLASS_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {("Adapters", "selection"): ("batch", "row")}
TRAINER_KEYS = ("lr", "clip")  # every gradient strategy's trainer takes them; the run's --lr and --clip set them


class HyperparameterError(ValueError):
    """A value a hyperparameter cannot take; the message names the key, the value and what it takes."""


@dataclass(frozen=True)
class Hyperparameter:
    """One `__init__` argument of a strategy: its type, default (MISSING: given by the run) and range."""

    name: str
    kind: type
    default: Any = MISSING
    low: float | None = None
    high: float | None = None
    low_included: bool = True
    high_included: bool = True
    choices: tuple[str, ...] = ()

    @property
    def allowed(self) -> str:
        """What it takes, in words: "[0, 1]", ">= 1", "> 0", "reservoir | herding", "an integer"."""
        if self.name == "boundary":
            return " | ".join(_BOUNDARY_DETECTORS) + " | every:N"
        if self.choices:
            return " | ".join(self.choices)
        if self.low is not None and self.high is not None:
            return f"{'[' if self.low_included else '('}{self.low:g}, {self.high:g}{']' if self.high_included else ')'}"
        if self.low is not None:
            return f"{'>=' if self.low_included else '>'} {self.low:g}"
        return {int: "an integer", float: "a number", bool: "true | false"}.get(self.kind, "text")

    def check(self, value: Any) -> Any:
        """`value` as this hyperparameter's type, in its range; HyperparameterError otherwise."""
        value = self._typed(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            below = self.low is not None and (value < self.low if self.low_included else value <= self.low)
            above = self.high is not None and (value > self.high if self.high_included else value >= self.high)
            if below or above:
                raise HyperparameterError(f"{self.name}={value}: expected a value {self.allowed}")
        if self.name == "boundary":
            _check_boundary(value)
        elif self.choices and value not in self.choices:
            raise HyperparameterError(f"{self.name}={value}: expected {self.allowed}")
        return value

    def _typed(self, value: Any) -> Any:
        kind, text = self.kind, str(value).lower()
        if kind is bool:
            if value in (0, 1, True, False) or text in ("true", "false"):
                return value in (1, True) or text == "true"
            raise HyperparameterError(f"{self.name}={value}: expected true or false")
        if kind is int:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise HyperparameterError(f"{self.name}={value}: expected an integer{self._default_note()}")
            return value
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise HyperparameterError(f"{self.name}={value}: expected a number{self._default_note()}")
            if not math.isfinite(value):  # (nan passed every range; lr=inf made every weight NaN in one step)
                raise HyperparameterError(f"{self.name}={value}: expected a finite number{self._default_note()}")
            return float(value)
        return str(value) if kind is str else value

    def _default_note(self) -> str:
        return "" if self.default is MISSING else f" (default {self.default!r})"


def _check_boundary(value: str) -> None:
    if value in _BOUNDARY_DETECTORS:
        return
    period = value.removeprefix("every:")
    if value.startswith("every:") and period.isdigit() and int(period) >= 1:
        return
    raise HyperparameterError(f"boundary={value}: expected {' | '.join(_BOUNDARY_DETECTORS)} or every:N (N >= 1)")


def signature(cls: type) -> dict[str, Hyperparameter]:
    """{name: Hyperparameter} of every `__init__` argument of `cls` except `model`, in signature order."""
    out = {}
    for name, parameter in inspect.signature(cls).parameters.items():
        if name in _SKIPPED or parameter.kind in _VARIADIC:
            continue
        default = MISSING if parameter.default is inspect.Parameter.empty else parameter.default
        kind = _KINDS.get(parameter.annotation) or (type(default) if default is not MISSING else str)
        low, high, low_included, high_included = _RANGES.get(name, (None, None, True, True))
        choices = _CLASS_CHOICES.get((cls.__name__, name), _CHOICES.get(name, ()))
        out[name] = Hyperparameter(name, kind, default, low, high, low_included, high_included, choices)
    return out
