"""Hyperparameters from the signature (river's `_get_params`): repr, clone and the config record.

A strategy's hyperparameters are exactly its `__init__` arguments other than `model`,
stored on the instance under the same names; its runtime state lives in private
attributes. Everything here reads the signature, so no strategy writes its own.
Torch-free.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["hyperparameters", "HyperparameterRepr", "clone", "config_record"]

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
