"""Figures across runs: loss after a switch (CALM Fig. 1b), a probe matrix heatmap, gate weights (Fig. 1d).

Each ``plot_*`` function draws on a bare matplotlib Figure with an Agg canvas (no
pyplot, no global backend) and returns a :class:`PlotResult`: the saved path, or
``path=None`` and the reason nothing was drawn when the data are missing.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from monitor.plots import legend, line_styles, literal

__all__ = [
    "GateCurve",
    "PlotResult",
    "after_switch_curves",
    "plot_after_switch",
    "plot_gate_weights",
    "plot_probe_heatmap",
    "strategy_after_switch",
]


class PlotResult(NamedTuple):
    """The saved PNG, or ``path=None`` with the reason nothing was drawn."""

    path: Path | None
    reason: str | None = None


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)
    return figure


def _finite_loss(record: Mapping) -> float:
    loss = float(record["loss"])
    return loss if math.isfinite(loss) else math.nan


def after_switch_curves(records: Iterable[Mapping], horizon: int) -> np.ndarray:
    """Mean loss at each of the first ``horizon`` batches after a switch, over all switches of one run.

    A switch is a change of ``sequence`` between consecutive records; offset 0 is the
    first batch of the new fragment, and a fragment is never read past its end, so
    offset j averages over the switches whose new fragment has more than j batches.
    Offsets no switch reaches, and non-finite losses, are NaN (skipped in the mean).
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon!r}")
    totals = np.zeros(horizon)
    counts = np.zeros(horizon)
    offset = horizon  # before the first switch: not counted
    previous = None
    for index, record in enumerate(records):
        if index > 0 and record["sequence"] != previous:
            offset = 0
        previous = record["sequence"]
        if offset < horizon:
            loss = _finite_loss(record)
            if not math.isnan(loss):
                totals[offset] += loss
                counts[offset] += 1
            offset += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, totals / np.maximum(counts, 1), np.nan)


def strategy_after_switch(groups: Mapping[str, Sequence[Sequence[Mapping]]], horizon: int) -> dict:
    """Per strategy: the per-run curves of :func:`after_switch_curves`, their mean, min and max
    over runs (NaN-skipping) and the number of runs; strategies with no switch are left out."""
    summary: dict[str, dict] = {}
    for strategy, runs in groups.items():
        curves = [after_switch_curves(list(records), horizon) for records in runs]
        curves = [curve for curve in curves if not np.all(np.isnan(curve))]
        if not curves:
            continue
        stacked = np.vstack(curves)
        with warnings.catch_warnings():  # an offset no run reaches is NaN, not a warning
            warnings.simplefilter("ignore", RuntimeWarning)
            summary[strategy] = {
                "n_runs": len(curves),
                "runs": [curve.tolist() for curve in curves],
                "mean": np.nanmean(stacked, axis=0).tolist(),
                "min": np.nanmin(stacked, axis=0).tolist(),
                "max": np.nanmax(stacked, axis=0).tolist(),
            }
    return summary


def plot_after_switch(
    groups: Mapping[str, Sequence[Sequence[Mapping]]],
    path: str | os.PathLike,
    *,
    horizon: int = 15,
    k_label: str = "",
) -> PlotResult:
    """CALM Fig. 1b: per strategy, the mean loss over the first ``horizon`` batches after a switch
    (mean over the switches of a run, then over the strategy's runs), with a min-max band over
    runs. ``k_label`` (e.g. "MultiLingual, λ = 10k") is added to the title."""
    curves = strategy_after_switch(groups, horizon)
    if not curves:
        return PlotResult(None, "no switch in any run's loss log")
    figure = _figure(8, 4.5)
    axes = figure.add_subplot()
    offsets = np.arange(horizon)
    handles, labels = [], []
    for style, (strategy, curve) in zip(line_styles(len(curves)), curves.items()):
        runs = curve["n_runs"]
        handles += axes.plot(offsets, curve["mean"], color=style["color"], linestyle=style["linestyle"], marker="o",
                             markersize=3, linewidth=1.6)
        labels.append(f"{strategy} (mean of {runs} run{'s' if runs != 1 else ''})")
        if runs > 1:
            axes.fill_between(offsets, curve["min"], curve["max"], color=style["color"], alpha=0.2, linewidth=0)
    if any(curve["n_runs"] > 1 for curve in curves.values()):
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="0.5", alpha=0.3))
        labels.append("band: min-max over runs")
    axes.legend(handles, [literal(label) for label in labels], fontsize="small", frameon=False)
    axes.set_xlabel("batches after the switch")
    axes.set_ylabel("loss (nats)")
    axes.set_xticks(offsets[:: max(1, horizon // 15)])
    axes.grid(alpha=0.3)
    title = "Loss after a switch (mean over switches, then over runs)"
    axes.set_title(f"{title}\n{literal(k_label)}" if k_label else title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path)
    return PlotResult(Path(path))


def plot_probe_heatmap(
    matrix_values: Sequence[Sequence[float | None]],
    stages: Sequence,
    classes: Sequence,
    path: str | os.PathLike,
    *,
    title: str = "",
) -> PlotResult:
    """The probe matrix R (rows: stages, columns: classes) as a heatmap with each value in its cell;
    ``None`` or non-finite cells are blank and marked "n/a". Stage i is the model after the first fragment of
    ``classes[i]``: a stage given as a batch number is labelled "after <class> (batch N)"."""
    if not matrix_values or not stages or not classes:
        return PlotResult(None, "empty probe matrix")
    shape = (len(stages), len(classes))
    if len(matrix_values) != shape[0] or any(len(row) != shape[1] for row in matrix_values):
        return PlotResult(None, f"probe matrix is not {shape[0]} stages x {shape[1]} classes")
    values = np.array([[math.nan if v is None else float(v) for v in row] for row in matrix_values])
    finite = np.isfinite(values)
    if not finite.any():
        return PlotResult(None, "probe matrix has no finite value")
    rows = [_stage_label(stage, name) for stage, name in zip(stages, classes)]
    rotate = shape[1] > 6 or max(len(str(c)) for c in classes) > 8  # (long names ran into each other)
    tilted = 0.06 * max(len(str(c)) for c in classes) if rotate else 0.0  # inches the tilted names take
    figure = _figure(max(4.5, 1.6 + 0.7 * shape[1] + 0.075 * max(map(len, rows)), 0.08 * len(title)),
                     max(3.5, 1.2 + 0.45 * shape[0] + tilted))
    axes = figure.add_subplot()
    masked = np.ma.masked_invalid(values)
    image = axes.imshow(masked, cmap="viridis", aspect="auto", interpolation="nearest")
    figure.colorbar(image, ax=axes, fraction=0.05)
    if values.size <= 900:
        low, high = float(values[finite].min()), float(values[finite].max())
        middle = (low + high) / 2
        for row in range(shape[0]):
            for column in range(shape[1]):
                value = values[row, column]
                text = f"{value:.3g}" if math.isfinite(value) else "n/a"
                colour = "black" if math.isfinite(value) and value > middle else "white"
                if not math.isfinite(value):
                    colour = "0.3"
                axes.text(column, row, text, ha="center", va="center", color=colour, fontsize="small")
    axes.set_xticks(range(shape[1]), [literal(c) for c in classes], rotation=45 if rotate else 0,
                    ha="right" if rotate else "center", rotation_mode="anchor")
    axes.set_yticks(range(shape[0]), [literal(row) for row in rows])
    axes.set_xlabel("class")
    axes.set_ylabel("stage")
    if title:
        axes.set_title(literal(title), fontsize="medium")
    figure.tight_layout()
    figure.savefig(path)
    return PlotResult(Path(path))


def _stage_label(stage, name) -> str:
    """Row i of a probe matrix: the model after class i's first fragment; a stage given as its batch (the report's)
    is said so (the rows were bare batch numbers beside "stage")."""
    if isinstance(stage, int) and not isinstance(stage, bool):
        return f"after {name} (batch {stage:,})"
    return f"after {name}" if stage is None else str(stage)


class GateCurve:
    """The gate weights of a run (loss-log rows with a ``"gates"`` list) in at most ``max_points``
    buckets, fed one row at a time: a bucket holds ``width`` consecutive gated rows and their mean
    weights; past ``max_points`` buckets the width doubles and neighbours merge. The first 201 true
    switches are kept (the figure draws them when there are at most 200)."""

    MAX_SWITCHES = 200

    def __init__(self, max_points: int = 1000) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, got {max_points}")
        self.max_points, self.width, self.n = max_points, 1, 0
        self.experts: int | None = None
        self.problem: str | None = None  # why nothing can be drawn
        self.use_step = True  # every gated row has a "step"
        self._sums: list[list[float]] = []
        self._counts: list[int] = []
        self._x: list[tuple[int, float]] = []  # (position, step) of each bucket's first row
        self._switches: list[tuple[int, float]] = []
        self._index = 0
        self._last_sequence = None

    def update(self, row: Mapping) -> None:
        index, self._index = self._index, self._index + 1
        gates = row.get("gates")
        if not isinstance(gates, (list, tuple)) or self.problem:
            return
        if self.experts is None:
            self.experts = len(gates)
        if len(gates) != self.experts or not gates:
            self.problem = f"gate vectors have differing or zero lengths: {sorted({self.experts, len(gates)})}"
            return
        self.use_step = self.use_step and "step" in row
        here = (index, row.get("step", index))
        if self.n and row.get("sequence") != self._last_sequence and len(self._switches) <= self.MAX_SWITCHES:
            self._switches.append(here)
        self._last_sequence = row.get("sequence")
        if self.n // self.width == len(self._counts) == self.max_points:
            self._merge()
        if self.n // self.width == len(self._counts):
            self._sums.append([0.0] * self.experts)
            self._counts.append(0)
            self._x.append(here)
        sums = self._sums[-1]
        for expert, weight in enumerate(gates):
            sums[expert] += float(weight)
        self._counts[-1] += 1
        self.n += 1

    def _merge(self) -> None:
        pairs = range(0, len(self._counts), 2)
        self._sums = [[sum(v) for v in zip(*self._sums[i:i + 2])] for i in pairs]
        self._counts = [sum(self._counts[i:i + 2]) for i in pairs]
        self._x = self._x[::2]
        self.width *= 2

    def save(self, path: str | os.PathLike) -> PlotResult:
        """CALM Fig. 1d: the gate weight of each expert over time, stacked, with dashed lines at the true
        switches (up to 200); buckets of several rows show their mean. Gates that are not weights (a value below
        0, or rows that do not sum to 1) are drawn as a line each, not stacked."""
        if self.problem:
            return PlotResult(None, self.problem)
        if not self.n:
            return PlotResult(None, "no gate weights logged")
        pick = 1 if self.use_step else 0
        x = np.array([point[pick] for point in self._x], dtype=float)
        weights = np.array(self._sums) / np.array(self._counts, dtype=float)[:, None]
        figure = _figure(12, 4)
        axes = figure.add_subplot()
        styles = line_styles(self.experts)
        shares = bool((weights >= 0).all()) and bool(np.allclose(weights.sum(axis=1), 1.0, atol=1e-3))
        if shares:
            handles = axes.stackplot(x, weights.T, colors=[style["color"] for style in styles],
                                     hatch=[style["hatch"] for style in styles], alpha=0.85)
        else:  # (poe's signed gate values, rows summing to 3.57, were stacked as if shares of a whole)
            handles = [axes.plot(x, weights[:, e], color=styles[e]["color"], linestyle=styles[e]["linestyle"],
                                 linewidth=1.0)[0] for e in range(self.experts)]
        labels = [f"expert {e}" for e in range(self.experts)]
        switches = [point[pick] for point in self._switches]
        if 0 < len(switches) <= self.MAX_SWITCHES:
            handles.append(axes.vlines(switches, 0, 1, transform=axes.get_xaxis_transform(), colors="0.2",
                                       linestyles="dashed", linewidth=0.7))
            labels.append("true switch")
        axes.set_xlim(x[0], x[-1] if x[-1] > x[0] else x[0] + 1)
        axes.set_xlabel("step" if self.use_step else "batch")
        axes.set_ylabel(("gate weight" if shares else "gate value") + (f" (mean per {self.width} batches)"
                                                                       if self.width > 1 else ""))
        axes.set_title("Gate weights over time" if shares else "Gate values over time (not weights summing to 1)")
        legend(axes, handles, labels)
        figure.tight_layout()
        figure.savefig(path)
        return PlotResult(Path(path))


def plot_gate_weights(rows: Iterable[Mapping], path: str | os.PathLike, *, max_points: int = 1000) -> PlotResult:
    """CALM Fig. 1d from loss-log rows with a ``"gates"`` list (see :class:`GateCurve`), read once."""
    curve = GateCurve(max_points)
    for row in rows:
        curve.update(row)
    return curve.save(path)
