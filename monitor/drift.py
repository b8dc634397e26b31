"""Switches found without labels: river's drift detectors on the loss stream."""

from __future__ import annotations

from river import drift

__all__ = ["DETECTORS", "make_detector"]

# Defaults tuned on calm-multilingual demo runs (byte LSTM, b=10, w=20): Page-Hinkley
# watching for increases finds about 60% of the true switches within 10 batches,
# with no false alarm; the switches it misses are between languages of similar loss.
DETECTORS = {
    "page-hinkley": lambda: drift.PageHinkley(min_instances=10, delta=0.05, threshold=1.0, alpha=0.999, mode="up"),
    "adwin": lambda: drift.ADWIN(delta=0.002),
    "kswin": lambda: drift.KSWIN(alpha=0.0001, window_size=100, stat_size=30, seed=0),
}


def make_detector(name: str):
    """A fresh river detector (`update(x)`, read-only `drift_detected`), or None for 'none'."""
    if name == "none":
        return None
    try:
        return DETECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown detector {name!r}; choose from {', '.join([*DETECTORS, 'none'])}") from None
