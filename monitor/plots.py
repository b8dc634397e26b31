"""Static plots of a run (matplotlib Agg canvas, imported only when a plot is drawn)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["LossCurve", "legend", "line_styles", "literal", "plot_loss_curve", "rolling_mean"]

LEGEND_ROWS = 16  # a legend's entries per column beside a 4-inch-high plot (more ran off the image)


def literal(text) -> str:
    """`text` as matplotlib is to show it: a `$` (a class `tweets_$AAPL_$TSLA`, a run dir `US$ and CA$`) escaped, so
    it is not read as mathtext (which raised ValueError at a lone `^`, or set a pair's text in italics)."""
    return str(text).replace("$", r"\$")


def line_styles(count: int) -> list[dict]:
    """A colour, a line style and a hatch for each of `count` lines (or areas), no two alike: tab10's colours
    (tab20's past 10 lines), then the same colours dashed and hatched, dotted, ... (tab20 alone repeated itself
    past 20: class20 looked like class00)."""
    import matplotlib

    colormap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    dashes, hatches = ("solid", "dashed", "dotted", "dashdot"), ("", "//", "..", "xx")
    return [{"color": colormap(i % colormap.N), "linestyle": dashes[i // colormap.N % len(dashes)],
             "hatch": hatches[i // colormap.N % len(hatches)]} for i in range(count)]


def legend(axes, handles: list, labels: list) -> None:
    """A legend right of the plot, of these handles and labels as they are (matplotlib drops a label that starts
    with `_`, as a class named `_other`), in as many columns as keep it within the figure."""
    axes.legend(handles, [literal(label) for label in labels], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                fontsize="small", frameon=False, ncols=max(1, math.ceil(len(labels) / LEGEND_ROWS)))


def rolling_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return values
    window = max(1, min(window, values.size))
    cumulative = np.concatenate(([0.0], np.cumsum(values)))
    ends = np.arange(1, values.size + 1)
    starts = np.maximum(0, ends - window)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


class LossCurve:
    """A run's per-batch loss in at most ``max_points`` buckets, fed one batch at a time (O(max_points)
    memory however long the log). A bucket holds ``width`` consecutive batches; when the buckets would
    pass ``max_points`` the width doubles and neighbours merge. Each bucket keeps the max (so a spike
    stays visible), min, sum and count of its finite losses, its count of non-finite ones, the fragment
    (``sequence``) and class of its first batch, and the first true and detected switch inside it
    (drawn as lines while there are at most ``MAX_LINES`` of each).
    Until the run has more than ``max_points`` batches every bucket is one batch and the plot is the
    exact per-batch trace."""

    MAX_LINES = 300  # switch lines drawn at most (past that they hide the trace)
    _FIELDS = ("high", "low", "total", "finite", "count", "sequence", "name", "switch", "detected")

    def __init__(self, max_points: int = 2000) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, got {max_points}")
        self.max_points = max_points
        self.width = 1
        self.n = 0
        self.class_names: set[str] = set()
        self.low, self.high = math.inf, -math.inf  # finite losses
        self.counts = {"switch": 0, "detected": 0}  # every true and detected switch (a bucket keeps its first)
        self._buckets: dict[str, list] = {name: [] for name in self._FIELDS}
        self._last_sequence = None

    def update(self, loss: float, sequence, class_name: str, detected: bool = False) -> None:
        index, loss = self.n, float(loss)
        self.n += 1
        switch = index > 0 and sequence != self._last_sequence
        if index == 0 or switch:
            self.class_names.add(str(class_name))
        self._last_sequence = sequence
        b = self._buckets
        if index // self.width == len(b["count"]):
            if len(b["count"]) == self.max_points:
                self._merge()
            if index // self.width == len(b["count"]):
                for name, value in zip(self._FIELDS, (-math.inf, math.inf, 0.0, 0, 0, sequence, str(class_name), -1, -1)):
                    b[name].append(value)
        last = len(b["count"]) - 1
        b["count"][last] += 1
        if math.isfinite(loss):
            b["high"][last] = max(b["high"][last], loss)
            b["low"][last] = min(b["low"][last], loss)
            b["total"][last] += loss
            b["finite"][last] += 1
            self.low, self.high = min(self.low, loss), max(self.high, loss)
        self.counts["switch"] += switch
        self.counts["detected"] += bool(detected)
        if switch and b["switch"][last] < 0:
            b["switch"][last] = index
        if detected and b["detected"][last] < 0:
            b["detected"][last] = index

    def _merge(self) -> None:
        """Twice the width: bucket 2i and 2i+1 become bucket i."""
        b = self._buckets
        merged: dict[str, list] = {}
        for name in self._FIELDS:
            values = b[name]
            pairs = [values[i:i + 2] for i in range(0, len(values), 2)]
            if name == "high":
                merged[name] = [max(p) for p in pairs]
            elif name == "low":
                merged[name] = [min(p) for p in pairs]
            elif name in ("total", "finite", "count"):
                merged[name] = [sum(p) for p in pairs]
            elif name in ("switch", "detected"):
                merged[name] = [next((v for v in p if v >= 0), -1) for p in pairs]
            else:
                merged[name] = [p[0] for p in pairs]
        self._buckets = merged
        self.width *= 2

    def save(self, path: str | os.PathLike, *, title: str = "") -> None:
        """Save a PNG: the trace coloured by class (the per-bucket max, with a min-max band once buckets
        hold several batches), its rolling mean, dashed lines at the true switches and dotted red lines
        at the detected ones (the first of each in a bucket)."""
        # A bare Figure on an Agg canvas: no pyplot, so no global backend or figure registry.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(12, 4), dpi=120)
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        if self.n == 0:
            axes.text(0.5, 0.5, "no batches logged", ha="center", va="center", transform=axes.transAxes)
        else:
            self._draw(axes)
        axes.set_xlabel("batch")
        axes.set_ylabel("loss (nats)")
        if title:
            axes.set_title(literal(title))
        figure.tight_layout()
        figure.savefig(path)

    def _draw(self, axes) -> None:
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator

        b = self._buckets
        x = np.arange(len(b["count"])) * self.width
        high = np.array([v if math.isfinite(v) else np.nan for v in b["high"]])
        class_names = sorted(self.class_names)
        styles = {name: {key: style[key] for key in ("color", "linestyle")}
                  for name, style in zip(class_names, line_styles(len(class_names)))}
        marker = "." if self.n <= 500 else None  # short runs: show single-batch fragments
        if self.width == 1:  # one line per fragment, as many as the run has (at most max_points)
            for start, end in _runs(b["sequence"]):
                axes.plot(x[start:end], high[start:end], **styles[b["name"][start]], linewidth=0.7, alpha=0.6,
                          marker=marker)
        else:  # one line through the buckets' maxima, each piece in its bucket's class colour, over a min-max band
            from matplotlib.collections import LineCollection

            low = np.array([v if math.isfinite(v) else np.nan for v in b["low"]])
            axes.fill_between(x, low, high, color="0.6", alpha=0.25, linewidth=0)
            points = np.column_stack([x, high])
            axes.add_collection(LineCollection(np.stack([points[:-1], points[1:]], axis=1), linewidths=0.7,
                                               colors=[styles[name]["color"] for name in b["name"][:-1]],
                                               linestyles=[styles[name]["linestyle"] for name in b["name"][:-1]],
                                               alpha=0.8))
        bottom, top = (self.low, self.high) if self.high >= self.low else (0.0, 1.0)
        margin = 0.05 * (top - bottom) or 0.5
        window = max(5, min(200, self.n // 100))
        count = np.array(b["count"], dtype=float)
        means = (np.array(b["total"]) + (count - np.array(b["finite"])) * top) / count  # one inf must not blank the rest
        smooth = max(1, round(window / self.width))
        handles = axes.plot(x, rolling_mean(means, smooth), color="black", linewidth=1.3)
        labels = [f"rolling mean ({smooth * self.width} batches)"]
        for key, what, style in (("switch", "true switch", {"colors": "0.35", "linestyles": "dashed", "linewidth": 0.7}),
                                 ("detected", "detected switch",
                                  {"colors": "tab:red", "linestyles": "dotted", "linewidth": 1.2})):
            lines = [v for v in b[key] if v >= 0]
            if len(lines) > self.MAX_LINES:  # they would cover the trace: said in the legend instead
                handles.append(Line2D([], [], linewidth=0))
                labels.append(f"{self.counts[key]:,} {what}es, not drawn")  # (not the buckets holding one)
            elif lines:
                handles.append(axes.vlines(lines, bottom, top, **style))
                labels.append(what)
        if self.width > 1:
            handles.append(Line2D([], [], color="0.5", linewidth=0.7))
            labels.append(f"max (band: min) per {self.width} batches")
        handles += [Line2D([], [], **styles[name], linewidth=2.5) for name in class_names]
        labels += class_names
        axes.set_xlim(-0.5, self.n - 0.5)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # (1 batch: ticks at -0.4 .. 0.4)
        axes.set_ylim(bottom - margin, top + margin)
        axes.grid(axis="y", alpha=0.3)
        legend(axes, handles, labels)


def _runs(values: list) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of equal values, end exclusive."""
    runs, start = [], 0
    for index in range(1, len(values) + 1):
        if index == len(values) or values[index] != values[start]:
            runs.append((start, index))
            start = index
    return runs


def plot_loss_curve(
    records: Iterable[Mapping],
    path: str | os.PathLike,
    *,
    title: str = "",
    detected_switches: Iterable[int] = (),
    max_points: int = 2000,
) -> None:
    """Save a PNG of the per-batch loss (see :meth:`LossCurve.save`); ``detected_switches`` are batch
    positions. The records are read once, one at a time."""
    detected = set(detected_switches)
    curve = LossCurve(max_points)
    for index, record in enumerate(records):
        curve.update(record["loss"], record["sequence"], record["domain_name"], index in detected)
    curve.save(path, title=title)
