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

Label-free CALM estimates (:func:`calm_metrics_from_detected`): the detections
cut the stream into segments and every segment but the first and the last of
the span is scored as if it followed a switch; see that function for how its
estimates differ from :func:`monitor.calm.calm_metrics`.

Values that cannot be computed are ``None`` and a note says why.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from monitor.calm import PPL_LOSS_LIMIT, perplexity, recovery_duration
from monitor.drift import make_detector

__all__ = [
    "DetectionTracker",
    "calm_metrics_from_detected",
    "detect_offline",
    "detected_times",
    "detection_report",
    "evaluate_detection",
    "switch_times",
]

ESTIMATE_NOTE = (
    "label-free estimates: segments are cut at detected switches; ppl@sw and rec score every "
    "segment but the first and the last of the span; rec counts batches until the loss drops "
    "below the mean of the previous segment (CALM uses the previous fragment of the same class)"
)


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


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _exp(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf


def calm_metrics_from_detected(
    records: Sequence[Mapping], detected: Iterable[int], *, k: int = 10, from_fragment: int = 0
) -> dict:
    """CALM-style metrics with the switches taken from ``detected`` instead of the labels.

    Segments are the runs between detections: a detection at ``d`` starts a new
    segment at ``d`` (one at 0 or a repeated one starts nothing). ``from_fragment``
    counts detected segments, so the span is segments ``>= from_fragment``.
    Without labels a revisit cannot be known, so:

    - ppl@sw (estimate) is exp of the mean, over the span's segments except its
      first and the stream's last, of the mean loss of their first ``k`` batches;
    - rec (estimate) is the mean, over the same segments, of the batches until
      the loss first drops below the mean loss of the *previous segment* (the
      segment's length if it never does), where CALM uses the previous fragment
      of the same class;
    - loss and ppl are over the span as in :func:`monitor.calm.calm_metrics`.

    Only ``loss`` is read from the records.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if isinstance(from_fragment, bool) or not isinstance(from_fragment, int) or from_fragment < 0:
        raise ValueError(f"from_fragment must be a non-negative int, got {from_fragment!r}")
    losses = [float(record["loss"]) for record in records]
    cuts = sorted(set(detected))
    if cuts and (cuts[0] < 0 or cuts[-1] >= len(losses)):
        raise ValueError(f"detections must lie in [0, {len(losses)}), got {cuts[0]}..{cuts[-1]}")
    starts = [0] + [d for d in cuts if d > 0]
    segments = [losses[a:b] for a, b in zip(starts, starts[1:] + [len(losses)])] if losses else []
    span = segments[from_fragment:]  # runs to the end of the stream
    scored = span[1:-1]
    intensities = [_mean(segment[:k]) for segment in scored]
    durations = [recovery_duration(span[i], _mean(span[i - 1])) for i in range(1, len(span) - 1)]
    span_losses = [x for segment in span for x in segment]
    loss = _mean(span_losses)
    notes = [ESTIMATE_NOTE]
    where = f"detected segments >= {from_fragment}"
    if loss is None:
        notes.append(f"loss, ppl: no batches in the evaluated span ({where})")
    elif loss >= PPL_LOSS_LIMIT:
        notes.append(f"ppl: mean loss {loss:.3g} nats >= {PPL_LOSS_LIMIT:g}, reported as inf")
    if not scored:
        notes.append(
            f"ppl@sw, rec: fewer than three detected segments in the evaluated span ({where}; "
            f"{len(span)} segment(s), the first and the last are never scored)"
        )
    return {
        "loss": loss,
        "ppl": None if loss is None else perplexity(loss),
        "ppl@sw": _exp(_mean(intensities)),
        "rec": _mean(durations),
        "n_batches": len(span_losses),
        "n_segments": len(span),
        "n_scored_segments": len(scored),
        "from_fragment": from_fragment,
        "k": k,
        "estimated_from": "detected switches",
        "notes": notes,
    }


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


def detection_report(
    records: Sequence[Mapping],
    *,
    tolerance: int = 10,
    k: int = 10,
    detector: str = "page-hinkley",
    from_fragment: int = 0,
) -> dict:
    """Detections of a loss log scored against its true switches, and CALM estimates from them.

    The detections are the records' ``detected_switch`` fields when every record has
    one (a live run), else ``detect_offline`` of the losses with ``detector`` (a log
    from another tool, CALM format).
    """
    records = list(records)
    if records and all("detected_switch" in record for record in records):
        detected, source = detected_times(records), "detected_switch field of the loss log"
    else:
        detected = detect_offline((record["loss"] for record in records), detector)
        source = f"detect_offline with {detector!r} (the loss log has no detected_switch field)"
    return {
        "source": source,
        "evaluation": evaluate_detection(switch_times(records), detected, tolerance=tolerance),
        "metrics": calm_metrics_from_detected(records, detected, k=k, from_fragment=from_fragment),
    }
