"""Plain-value state of the river objects monitor/ keeps: means, rolling windows, confusion matrices.

river objects are meant to be pickled; a checkpoint read with ``torch.load(weights_only=True)``
takes only plain values (dict, list, tuple, str, int, float, bool, None). Each ``*_state``
function returns such values and each ``load_*`` function writes them back into a freshly
built object, so that it continues with bit-identical numbers (the running sums of an
update/revert window carry their rounding history, which replaying the window would lose).
Dicts are saved as lists of pairs, so their order, and the float sums iterated in it, survive.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from typing import Any

from river import metrics, stats, utils

__all__ = ["mean_state", "load_mean", "confusion_state", "load_confusion", "rolling_state", "load_rolling"]


def mean_state(mean: stats.Mean) -> list[float]:
    return [mean.n, mean._mean]


def load_mean(mean: stats.Mean, state: list[float]) -> None:
    mean.n, mean._mean = state


def confusion_state(metric: metrics.base.ClassificationMetric) -> dict[str, Any]:
    """The confusion matrix under a river classification metric (Accuracy, MacroF1, ...)."""
    cm = metric.cm
    return {
        "init_classes": list(cm._init_classes), "n_samples": cm.n_samples, "total_weight": cm.total_weight,
        "total_true_positives": cm._total_true_positives,
        "sum_row": [[key, value] for key, value in cm.sum_row.items()],
        "sum_col": [[key, value] for key, value in cm.sum_col.items()],
        "data": [[row, [[col, value] for col, value in cols.items()]] for row, cols in cm.data.items()],
    }


def load_confusion(metric: metrics.base.ClassificationMetric, state: dict[str, Any]) -> None:
    cm = metric.cm
    cm._init_classes = set(state["init_classes"])
    cm.n_samples, cm.total_weight = state["n_samples"], state["total_weight"]
    cm._total_true_positives = state["total_true_positives"]
    cm.sum_row = defaultdict(float, ((key, value) for key, value in state["sum_row"]))
    cm.sum_col = defaultdict(float, ((key, value) for key, value in state["sum_col"]))
    cm.data = defaultdict(functools.partial(defaultdict, float))
    for row, cols in state["data"]:
        cm.data[row] = defaultdict(float, ((col, value) for col, value in cols))


def rolling_state(rolling: utils.Rolling) -> dict[str, Any]:
    """A Rolling window over a stats.Mean or a classification metric: its inputs and its inner state."""
    if any(kwargs for _, kwargs in rolling.window):
        raise ValueError("a rolling window fed keyword arguments cannot be saved")
    inner = mean_state(rolling.obj) if isinstance(rolling.obj, stats.Mean) else confusion_state(rolling.obj)
    return {"window_size": rolling.window_size, "inputs": [list(args) for args, _ in rolling.window], "obj": inner}


def load_rolling(rolling: utils.Rolling, state: dict[str, Any]) -> None:
    if state["window_size"] != rolling.window_size:
        raise ValueError(f"saved window of {state['window_size']}, this one {rolling.window_size}")
    if isinstance(rolling.obj, stats.Mean):
        load_mean(rolling.obj, state["obj"])
    else:
        load_confusion(rolling.obj, state["obj"])
    rolling.window = deque(((tuple(args), {}) for args in state["inputs"]), maxlen=rolling.window_size)
