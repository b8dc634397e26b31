"""Switches found without labels: river's drift detectors on the loss stream.

A detector's state is saved as plain values (its name, parameters and numbers), never
pickled, so a checkpoint read with ``torch.load(weights_only=True)`` can hold it:
``detector_state(detector)`` -> dict, ``load_detector(state)`` -> an equal detector that
continues exactly where the saved one stopped.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from river import drift

__all__ = ["DETECTORS", "RecordingADWIN", "make_detector", "detector_state", "load_detector"]


class RecordingADWIN(drift.ADWIN):
    """river's ADWIN, keeping the inputs since its last reset.

    ADWIN's window lives in river's Rust extension, which exposes no state; river resets
    the detector on the update after a detection, so the inputs since that reset determine
    it, and replaying them into a fresh detector rebuilds it exactly.

    `max_inputs` bounds that record on a stream that never drifts (a daemon on steady traffic
    kept every loss: 200,000 of them, 1.8 MB in each checkpoint): when the inputs since the
    reset reach `max_inputs`, the detector is rebuilt from the newest `max_inputs // 2` of them,
    so its window is at most that long, and a restart still rebuilds it exactly. The cost: a change
    that takes ADWIN over `max_inputs // 2` losses to see is not seen (a mean shift of 0.1 on a loss
    of standard deviation 0.3 at max_inputs 1,000; none of 0.2 or more at the default 20,000).
    """

    def __init__(self, delta=0.002, clock=32, max_buckets=5, min_window_length=5, grace_period=10,
                 max_inputs: int = 20_000):
        self.max_inputs = max_inputs
        super().__init__(delta=delta, clock=clock, max_buckets=max_buckets, min_window_length=min_window_length,
                         grace_period=grace_period)

    def _reset(self):
        super()._reset()
        self.inputs: list[float] = []

    def update(self, x):
        super().update(x)  # resets (clearing `inputs`) first when the last update detected
        self.inputs.append(x)
        if len(self.inputs) >= self.max_inputs and not self.drift_detected:
            kept = self.inputs[-(self.max_inputs // 2):]
            self._reset()
            for value in kept:  # as update() does: a switch found among them resets at the next
                super().update(value)
                self.inputs.append(value)
            if self.drift_detected:  # (not this update's switch: the reset it calls for, now)
                self._reset()


# Defaults tuned on calm-multilingual demo runs (byte LSTM, b=10, w=20): Page-Hinkley
# watching for increases finds about 60% of the true switches within 10 batches,
# with no false alarm; the switches it misses are between languages of similar loss.
DETECTORS = {
    "page-hinkley": lambda: drift.PageHinkley(min_instances=10, delta=0.05, threshold=1.0, alpha=0.999, mode="up"),
    "adwin": lambda: RecordingADWIN(delta=0.002),
    "kswin": lambda: drift.KSWIN(alpha=0.0001, window_size=100, stat_size=30, seed=0),
}

_KINDS = {"PageHinkley": drift.PageHinkley, "RecordingADWIN": RecordingADWIN, "KSWIN": drift.KSWIN}


def make_detector(name: str):
    """A fresh river detector (`update(x)`, read-only `drift_detected`), or None for 'none'."""
    if name == "none":
        return None
    try:
        return DETECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown detector {name!r}; choose from {', '.join([*DETECTORS, 'none'])}") from None


def detector_state(detector) -> dict[str, Any] | None:
    """The detector's class, parameters and numeric state as plain values (None for no detector)."""
    if detector is None:
        return None
    kind = type(detector).__name__
    if kind not in _KINDS:
        raise TypeError(f"cannot save a {kind} detector; known: {', '.join(_KINDS)}")
    params = {key: value for key, value in detector._get_params().items() if key != "window"}  # KSWIN's data
    state: dict[str, Any] = {"kind": kind, "params": params,
                             "drift_detected": bool(detector.drift_detected)}
    if isinstance(detector, drift.PageHinkley):
        state.update(n=detector._x_mean.n, mean=detector._x_mean._mean,
                     sum_increase=detector._sum_increase, sum_decrease=detector._sum_decrease,
                     min_increase=detector._min_increase, max_decrease=detector._max_decrease)
    elif isinstance(detector, RecordingADWIN):
        state["inputs"] = [float(x) for x in detector.inputs]
    else:  # KSWIN
        version, internal, gauss = detector._rng.getstate()
        state.update(n=detector.n, p_value=float(detector.p_value), window=[float(x) for x in detector.window],
                     rng=[version, list(internal), gauss])
    return state


def load_detector(state: dict[str, Any] | None):
    """A detector rebuilt from :func:`detector_state`'s dict (None for None)."""
    if state is None:
        return None
    detector = _KINDS[state["kind"]](**state["params"])
    if isinstance(detector, drift.PageHinkley):
        detector._x_mean.n, detector._x_mean._mean = state["n"], state["mean"]
        detector._sum_increase, detector._sum_decrease = state["sum_increase"], state["sum_decrease"]
        detector._min_increase, detector._max_decrease = state["min_increase"], state["max_decrease"]
    elif isinstance(detector, RecordingADWIN):
        for x in state["inputs"]:
            detector.update(x)
    else:  # KSWIN
        detector.n, detector.p_value = state["n"], state["p_value"]
        detector.window = deque(state["window"], maxlen=detector.window_size)
        version, internal, gauss = state["rng"]
        detector._rng = random.Random()
        detector._rng.setstate((version, tuple(internal), gauss))
    detector._drift_detected = state["drift_detected"]
    return detector
