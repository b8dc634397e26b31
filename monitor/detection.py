"""How well switches are found without labels: detections scored against true switches.

Indices are batch positions in the stream (0 for the first batch), i.e. positions
in the loss-log records list, not the ``batch`` field of a record.

Matching (:func:`evaluate_detection`, :class:`DetectionTracker`): detections are
taken in time order; a detection at ``d`` matches the earliest still-unmatched
true switch ``t`` with ``t <= d <= t + tolerance``. Matching is one-to-one and
greedy, so a second detection for an already-matched switch is a false alarm, and
a detection before its switch or more than ``tolerance`` batches after it is a
false alarm (and the switch, if nothing else matches it, is missed). A true
switch is the first batch of a new ``sequence``; the first batch is never one.

Label-free CALM estimates (:func:`calm_metrics_from_detected`, from
monitor.detected_calm): the detections cut the stream into segments and every
segment but the first and the last of the span is scored as if it followed a
switch; see that function for how its estimates differ from
:func:`monitor.calm.calm_metrics`.

Values that cannot be computed are ``None`` and a note says why.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from monitor.detected_calm import DetectedCalmAccumulator, calm_metrics_from_detected
from monitor.drift import make_detector

__all__ = [
    "DetectedCalmAccumulator",
    "DetectionReport",
    "DetectionTracker",
    "NO_DETECTOR",
    "calm_metrics_from_detected",
    "detect_offline",
    "detected_times",
    "detection_report",
    "evaluate_detection",
    "switch_times",
]

NO_DETECTOR = "none: the run had no drift detector (--detector none)"  # a report's detection source then


def _check_tolerance(tolerance: int) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, int) or tolerance < 0:
        raise ValueError(f"tolerance must be a non-negative int, got {tolerance!r}")


def _median_from_counts(counts: Sequence[int], n: int) -> float:
    """The median of ``n`` values given as ``counts[value]`` (the two middles averaged)."""

    def value_at(position: int) -> int:
        seen = 0
        for value, count in enumerate(counts):
            seen += count
            if position < seen:
                return value
        raise ValueError("position beyond the counted values")

    return (value_at((n - 1) // 2) + value_at(n // 2)) / 2


def _scores(
    *,
    tolerance: int,
    n_true: int,
    n_detected: int,
    delay_sum: int,
    delay_counts: Sequence[int],
    matched: list[list[int]],
    false_alarms: list[int],
    missed: list[int],
) -> dict:
    """The result dict shared by :func:`evaluate_detection` and :meth:`DetectionTracker.snapshot`."""
    true_positives = sum(delay_counts)
    notes: list[str] = []
    precision = true_positives / n_detected if n_detected else None
    recall = true_positives / n_true if n_true else None
    if precision is None:
        notes.append("precision, f1: no detections")
    if recall is None:
        notes.append("recall, f1: no true switches (a stream of one fragment, or no labels)")
    if precision is None or recall is None:
        f1 = None
    else:
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    if true_positives:
        mean_delay = delay_sum / true_positives
        median_delay = _median_from_counts(delay_counts, true_positives)
    else:
        mean_delay = median_delay = None
        notes.append("detection delay: no detection matched a true switch")
    return {
        "tolerance": tolerance,
        "n_true": n_true,
        "n_detected": n_detected,
        "true_positives": true_positives,
        "n_false_alarms": n_detected - true_positives,
        "n_missed": n_true - true_positives,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "mean_delay_batches": mean_delay,
        "median_delay_batches": median_delay,
        "matched": matched,
        "false_alarms": false_alarms,
        "missed": missed,
        "notes": notes,
    }


def evaluate_detection(true_switches: Iterable[int], detected: Iterable[int], *, tolerance: int = 10) -> dict:
    """Precision, recall, F1 and delay of ``detected`` against ``true_switches`` (batch indices).

    Matching as in the module doc (greedy, one-to-one, ``t <= d <= t + tolerance``).
    ``matched`` holds ``[switch, detection]`` pairs, ``false_alarms`` the unmatched
    detections, ``missed`` the unmatched switches; delays are ``d - t`` in batches.
    """
    _check_tolerance(tolerance)
    switches = sorted(true_switches)
    detections = sorted(detected)
    matched: list[list[int]] = []
    false_alarms: list[int] = []
    missed: list[int] = []
    delay_counts = [0] * (tolerance + 1)
    delay_sum = 0
    next_switch = 0  # switches before it are matched or missed
    for d in detections:
        while next_switch < len(switches) and switches[next_switch] < d - tolerance:
            missed.append(switches[next_switch])  # too old for this and every later detection
            next_switch += 1
        if next_switch < len(switches) and switches[next_switch] <= d:
            t = switches[next_switch]
            next_switch += 1
            matched.append([t, d])
            delay_counts[d - t] += 1
            delay_sum += d - t
        else:
            false_alarms.append(d)
    missed.extend(switches[next_switch:])
    return _scores(
        tolerance=tolerance, n_true=len(switches), n_detected=len(detections), delay_sum=delay_sum,
        delay_counts=delay_counts, matched=matched, false_alarms=false_alarms, missed=missed,
    )


def switch_times(records: Iterable[Mapping]) -> list[int]:
    """Positions where ``sequence`` differs from the previous record's (never position 0)."""
    times: list[int] = []
    previous = None
    for index, record in enumerate(records):
        sequence = record["sequence"]
        if index and sequence != previous:
            times.append(index)
        previous = sequence
    return times


def detected_times(records: Iterable[Mapping]) -> list[int]:
    """Positions whose ``detected_switch`` is true (a missing field counts as false)."""
    return [index for index, record in enumerate(records) if record.get("detected_switch")]


def detect_offline(losses: Iterable[float], detector: str = "page-hinkley") -> list[int]:
    """Positions where a fresh ``monitor.drift`` detector fires on ``losses``.

    As in :class:`monitor.live.LiveMonitor`, a non-finite loss is not fed to the
    detector (but keeps its position), so a live run's ``detected_switch`` fields
    are reproduced from its losses. ``detector="none"`` finds nothing.
    """
    model = make_detector(detector)
    if model is None:
        return []
    found: list[int] = []
    for index, loss in enumerate(losses):
        loss = float(loss)
        if not math.isfinite(loss):
            continue
        model.update(loss)
        if model.drift_detected:
            found.append(index)
    return found


class DetectionTracker:
    """:func:`evaluate_detection` updated one batch at a time, in memory bounded by ``tolerance``.

    ``snapshot()`` equals ``evaluate_detection(switch_times(seen), detected_times(seen),
    tolerance=tolerance)`` over the batches seen so far: a switch still waiting for
    its detection counts as missed until one arrives. Only the unmatched switches of
    the last ``tolerance`` batches, running counts and a delay histogram are kept;
    the lists ``matched``, ``false_alarms`` and ``missed`` keep their last
    ``max_listed`` entries (all of them with ``None``) and a note says when they were cut.
    """

    def __init__(self, tolerance: int = 10, max_listed: int | None = 1000) -> None:
        _check_tolerance(tolerance)
        if max_listed is not None and (isinstance(max_listed, bool) or not isinstance(max_listed, int) or max_listed < 0):
            raise ValueError(f"max_listed must be a non-negative int or None, got {max_listed!r}")
        self.tolerance = tolerance
        self.max_listed = max_listed
        self._last_index: int | None = None
        self._last_sequence = None
        self._pending: deque[int] = deque()  # unmatched switches of the last `tolerance` batches
        self._n_true = 0
        self._n_detected = 0
        self._delay_sum = 0
        self._delay_counts = [0] * (tolerance + 1)
        self._n_expired = 0  # switches that can no longer be matched
        self._matched: deque[list[int]] = deque(maxlen=max_listed)
        self._false_alarms: deque[int] = deque(maxlen=max_listed)
        self._expired: deque[int] = deque(maxlen=max_listed)

    def __repr__(self) -> str:
        return f"DetectionTracker(tolerance={self.tolerance}, max_listed={self.max_listed})"

    def update(self, batch_index: int, sequence, detected: bool) -> None:
        """Account one batch: its position, its fragment index and whether the detector fired."""
        if self._last_index is not None and batch_index <= self._last_index:
            raise ValueError(f"batch_index must increase, got {batch_index} after {self._last_index}")
        while self._pending and self._pending[0] < batch_index - self.tolerance:
            self._expired.append(self._pending.popleft())
            self._n_expired += 1
        if self._last_index is not None and sequence != self._last_sequence:
            self._pending.append(batch_index)
            self._n_true += 1
        self._last_index, self._last_sequence = batch_index, sequence
        if not detected:
            return
        self._n_detected += 1
        if self._pending:
            switch = self._pending.popleft()
            self._matched.append([switch, batch_index])
            self._delay_counts[batch_index - switch] += 1
            self._delay_sum += batch_index - switch
        else:
            self._false_alarms.append(batch_index)

    def state_dict(self) -> dict:
        """Counts, pending switches and listed entries as plain values (see :meth:`load_state_dict`)."""
        return {
            "tolerance": self.tolerance, "max_listed": self.max_listed, "last_index": self._last_index,
            "last_sequence": self._last_sequence, "pending": list(self._pending), "n_true": self._n_true,
            "n_detected": self._n_detected, "delay_sum": self._delay_sum, "delay_counts": list(self._delay_counts),
            "n_expired": self._n_expired, "matched": [list(pair) for pair in self._matched],
            "false_alarms": list(self._false_alarms), "expired": list(self._expired),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; tolerance and max_listed must match."""
        if (state["tolerance"], state["max_listed"]) != (self.tolerance, self.max_listed):
            raise ValueError(f"saved detection tracker has tolerance={state['tolerance']}, max_listed="
                             f"{state['max_listed']}; this one {self.tolerance}, {self.max_listed}")
        self._last_index, self._last_sequence = state["last_index"], state["last_sequence"]
        self._pending = deque(state["pending"])
        self._n_true, self._n_detected = state["n_true"], state["n_detected"]
        self._delay_sum, self._delay_counts = state["delay_sum"], list(state["delay_counts"])
        self._n_expired = state["n_expired"]
        self._matched = deque((list(pair) for pair in state["matched"]), maxlen=self.max_listed)
        self._false_alarms = deque(state["false_alarms"], maxlen=self.max_listed)
        self._expired = deque(state["expired"], maxlen=self.max_listed)

    def snapshot(self) -> dict:
        """The :func:`evaluate_detection` result over the batches seen so far."""
        missed = [*self._expired, *self._pending]
        if self.max_listed is not None:
            missed = missed[max(0, len(missed) - self.max_listed):]
        n_missed = self._n_expired + len(self._pending)
        true_positives = self._n_true - n_missed
        lists = {
            "matched": ([list(pair) for pair in self._matched], true_positives),
            "false_alarms": (list(self._false_alarms), self._n_detected - true_positives),
            "missed": (missed, n_missed),
        }
        result = _scores(
            tolerance=self.tolerance, n_true=self._n_true, n_detected=self._n_detected,
            delay_sum=self._delay_sum, delay_counts=self._delay_counts,
            matched=lists["matched"][0], false_alarms=lists["false_alarms"][0], missed=lists["missed"][0],
        )
        for name, (listed, total) in lists.items():
            if len(listed) < total:
                result["notes"].append(f"{name}: the last {len(listed)} of {total} are listed")
        return result


class DetectionReport:
    """:func:`detection_report` one record at a time, in memory bounded by ``tolerance``, ``k`` and
    ``max_listed`` (the listed matches, false alarms and misses: the last ``max_listed`` of each, a note
    says when more were cut; None lists all). ``use_field``: score the records' ``detected_switch``
    fields (a live run's log), else the detections of a fresh ``detector`` on the losses. A run
    with ``detector`` "none" had no detector: nothing is scored (it read as one that found nothing,
    recall 0)."""

    def __init__(self, *, use_field: bool, tolerance: int = 10, k: int = 10, detector: str = "page-hinkley",
                 from_fragment: int = 0, max_listed: int | None = 1000) -> None:
        self.use_field, self.detector = use_field, detector
        self._tracker = DetectionTracker(tolerance, max_listed)
        self._calm = DetectedCalmAccumulator(k, from_fragment)
        self._model = None if use_field else make_detector(detector)
        self._index = 0

    def update(self, record: Mapping) -> None:
        if self.detector == "none":
            return
        loss = float(record["loss"])
        if self.use_field:
            detected = bool(record.get("detected_switch"))
        else:
            detected = False
            if self._model is not None and math.isfinite(loss):  # as detect_offline
                self._model.update(loss)
                detected = bool(self._model.drift_detected)
        self._tracker.update(self._index, record["sequence"], detected)
        self._calm.update(loss, detected)
        self._index += 1

    def result(self) -> dict:
        if self.detector == "none":
            return {"source": NO_DETECTOR, "evaluation": None, "metrics": None}
        source = ("detected_switch field of the loss log" if self.use_field else
                  f"detect_offline with {self.detector!r} (the loss log has no detected_switch field)")
        return {"source": source, "evaluation": self._tracker.snapshot(), "metrics": self._calm.result()}


def detection_report(
    records: Iterable[Mapping],
    *,
    tolerance: int = 10,
    k: int = 10,
    detector: str = "page-hinkley",
    from_fragment: int = 0,
) -> dict:
    """Detections of a loss log scored against its true switches, and CALM estimates from them.

    The detections are the records' ``detected_switch`` fields when every record has
    one (a live run), else ``detect_offline`` of the losses with ``detector`` (a log
    from another tool, CALM format). Everything is listed; :class:`DetectionReport` streams.
    """
    records = list(records)
    use_field = bool(records) and all("detected_switch" in record for record in records)
    report = DetectionReport(use_field=use_field, tolerance=tolerance, k=k, detector=detector,
                             from_fragment=from_fragment, max_listed=None)
    for record in records:
        report.update(record)
    return report.result()
