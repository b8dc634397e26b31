"""Static plots of a run (matplotlib Agg canvas, imported only when a plot is drawn)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["plot_loss_curve", "rolling_mean"]


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


def _fragments(records: Sequence[Mapping]) -> list[tuple[int, int, str]]:
    """(start, end, class name) of each maximal run of equal ``sequence``, end exclusive."""
    fragments: list[tuple[int, int, str]] = []
    start = 0
    for index in range(1, len(records) + 1):
        if index == len(records) or records[index]["sequence"] != records[start]["sequence"]:
            fragments.append((start, index, str(records[start]["domain_name"])))
            start = index
    return fragments


def plot_loss_curve(
    records: Sequence[Mapping],
    path: str | os.PathLike,
    *,
    title: str = "",
    detected_switches: Iterable[int] = (),
) -> None:
    """Save a PNG of the per-batch loss: raw trace coloured by class, rolling mean,
    dashed lines at the true switches and dotted red lines at ``detected_switches``
    (batch indices)."""
    # A bare Figure on an Agg canvas: no pyplot, so no global backend or figure registry.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = list(records)
    losses = np.array([float(r["loss"]) for r in records])
    figure = Figure(figsize=(12, 4), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if losses.size == 0:
        axes.text(0.5, 0.5, "no batches logged", ha="center", va="center", transform=axes.transAxes)
    else:
        _draw(axes, records, losses, list(detected_switches))
    axes.set_xlabel("batch")
    axes.set_ylabel("loss (nats)")
    if title:
        axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)


def _draw(axes, records: list[Mapping], losses: np.ndarray, detected: list[int]) -> None:
    fragments = _fragments(records)
    class_names = sorted({name for _, _, name in fragments})
    palette = _palette(len(class_names))
    colours = dict(zip(class_names, palette))
    batches = np.arange(losses.size)
    marker = "." if losses.size <= 500 else None  # short runs: show single-batch fragments
    for start, end, name in fragments:
        axes.plot(batches[start:end], losses[start:end], color=colours[name], linewidth=0.7,
                  alpha=0.6, marker=marker)
    finite = losses[np.isfinite(losses)]
    bottom, top = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    margin = 0.05 * (top - bottom) or 0.5
    window = max(5, min(200, losses.size // 100))
    clipped = np.where(np.isfinite(losses), losses, top)  # one inf must not blank the rest
    axes.plot(batches, rolling_mean(clipped, window), color="black", linewidth=1.3,
              label=f"rolling mean ({window} batches)")
    switches = [start for start, _, _ in fragments[1:]]
    if switches:
        axes.vlines(switches, bottom, top, colors="0.35", linestyles="dashed", linewidth=0.7,
                    label="true switch")
    if detected:
        axes.vlines(detected, bottom, top, colors="tab:red", linestyles="dotted", linewidth=1.2,
                    label="detected switch")
    for name in class_names:
        axes.plot([], [], color=colours[name], linewidth=2.5, label=name)
    axes.set_xlim(-0.5, losses.size - 0.5)
    axes.set_ylim(bottom - margin, top + margin)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def _palette(count: int) -> list:
    import matplotlib

    name = "tab10" if count <= 10 else "tab20"
    colormap = matplotlib.colormaps[name]
    return [colormap(i % colormap.N) for i in range(count)]
