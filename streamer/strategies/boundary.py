"""Boundaries a strategy finds on its own: a drift detector on its training loss, or a schedule.

The stream signals no task boundaries and headers never reach a strategy, so a
strategy that consolidates (EWC, L2), snapshots a teacher (kd-logit, kd-rep) or
closes a memory segment (replay with herding) finds them itself:
`boundary="page-hinkley" | "adwin" | "kswin"` feeds its own training loss to a
river drift detector (monitor.drift), `"every:N"` is a boundary after every N-th
learned batch, and `"none"` never is one.

A detector is saved as plain values, never pickled (monitor.drift's `detector_state` and
`load_detector`: Page-Hinkley and KSWIN as their numeric state, ADWIN as the values fed to it
since its last reset, replayed on load).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from streamer.strategies.params import HyperparameterRepr

__all__ = ["Boundaries", "parse_boundary", "FOUND_LISTED"]

# boundaries whose batch index is kept (found_at): a daemon's detector finds one every ~150 batches (EWC's
# Page-Hinkley on a CALM stream), and a list of every one grew in memory and in each checkpoint without end
FOUND_LISTED = 1000


def parse_boundary(boundary: str) -> int | None:
    """The period N of "every:N", or None for a detector name (checked by make_detector)."""
    if not boundary.startswith("every:"):
        _drift().make_detector(boundary)  # raises ValueError for an unknown name
        return None
    try:
        period = int(boundary.removeprefix("every:"))
    except ValueError:
        raise ValueError(f"boundary {boundary!r}: expected every:N with an integer N") from None
    if period < 1:
        raise ValueError(f"boundary {boundary!r}: N must be at least 1")
    return period


class Boundaries(HyperparameterRepr):
    """Counts learned batches and says after which of them a boundary falls.

    `found` counts the boundaries; `found_at` holds the 0-based index of the learned batch after which each
    of the last FOUND_LISTED of them fell.
    """

    def __init__(self, boundary: str = "page-hinkley"):
        self.boundary = boundary
        self._period = parse_boundary(boundary)
        self._detector = None if self._period is not None else _drift().make_detector(boundary)
        self._learned = 0
        self._found = 0
        self._found_at: deque[int] = deque(maxlen=FOUND_LISTED)

    @property
    def learned(self) -> int:
        return self._learned

    @property
    def found(self) -> int:
        """Boundaries found so far."""
        return self._found

    @property
    def found_at(self) -> tuple[int, ...]:
        """The learned batch index after which each of the last FOUND_LISTED boundaries fell."""
        return tuple(self._found_at)

    @property
    def detector(self):
        """The river detector (None for every:N and none); read-only use."""
        return self._detector

    def update(self, loss: torch.Tensor) -> bool:
        """Count one learned batch with its training loss; True when a boundary falls after it."""
        self._learned += 1
        if self._period is not None:
            found = self._learned % self._period == 0
        elif self._detector is None:
            found = False
        else:
            # GPU sync point: river's detectors take a Python float (only on the detector path).
            self._detector.update(loss.item())
            found = self._detector.drift_detected
        if found:
            self._found += 1
            self._found_at.append(self._learned - 1)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {
            "learned": self._learned,
            "found": self._found,
            "found_at": list(self._found_at),
            "detector": None if self._detector is None else _drift().detector_state(self._detector),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._learned = state["learned"]
        self._found = state.get("found", len(state["found_at"]))  # (a checkpoint of before: every one listed)
        self._found_at = deque(state["found_at"], maxlen=FOUND_LISTED)
        self._detector = None if state["detector"] is None else _drift().load_detector(state["detector"])


def _drift():
    """monitor.drift, imported on first use: river (and scipy with it) takes about a second to import,
    which `streamer strategies` and the other commands that only read the strategies' signatures need
    not pay."""
    from monitor import drift

    return drift
