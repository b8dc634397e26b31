"""CALM-style metrics with the switches taken from a drift detector instead of the labels.

The detections cut the stream into segments; every segment but the first and the last of the span
is scored as if it followed a switch (:func:`calm_metrics_from_detected`, and
:class:`DetectedCalmAccumulator` one batch at a time with the same numbers). monitor.detection
scores the detections themselves and re-exports both names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from monitor.calm import PPL_LOSS_LIMIT, OpenFragment, check_params, perplexity, ppl_at_switch
from monitor.sums import ExactSum

__all__ = ["ESTIMATE_NOTE", "DetectedCalmAccumulator", "calm_metrics_from_detected"]

ESTIMATE_NOTE = (
    "label-free estimates: segments are cut at detected switches; ppl@sw and rec score every "
    "segment but the first and the last of the span; rec counts batches until the loss drops "
    "below the mean of the previous segment (CALM uses the previous fragment of the same class)"
)


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
    losses = [float(record["loss"]) for record in records]
    cuts = set(detected)
    if cuts and (min(cuts) < 0 or max(cuts) >= len(losses)):
        raise ValueError(f"detections must lie in [0, {len(losses)}), got {min(cuts)}..{max(cuts)}")
    accumulator = DetectedCalmAccumulator(k, from_fragment)
    for index, loss in enumerate(losses):
        accumulator.update(loss, index in cuts)
    return accumulator.result()


class DetectedCalmAccumulator:
    """:func:`calm_metrics_from_detected` one batch at a time (its loss, whether a detection fired
    there) in O(k) memory, with exactly its numbers (sums as ``math.fsum``)."""

    def __init__(self, k: int = 10, from_fragment: int = 0) -> None:
        check_params(k, from_fragment)
        self.k, self.from_fragment = k, from_fragment
        self._segments = 0  # segments opened; the open one is the last
        self._open = OpenFragment(k, None)  # recovery counts against the previous span segment's mean
        self._loss = ExactSum()
        self._intensity = ExactSum()  # count: scored segments
        self._rec_total = 0

    def update(self, loss: float, detected: bool) -> None:
        if not self._segments or detected:
            self._close()
            self._segments += 1
        if self._segments - 1 < self.from_fragment:
            return
        loss = float(loss)
        self._open.add(loss)
        self._loss.add(loss)

    def _close(self) -> None:
        """The open segment is not the last: scored unless it is the span's first."""
        index, segment = self._segments - 1, self._open
        previous_mean = segment.previous_mean
        if index >= self.from_fragment:
            if index > self.from_fragment:
                self._intensity.add(segment.intensity())
                self._rec_total += segment.duration
            previous_mean = segment.loss.mean()
        self._open = OpenFragment(self.k, previous_mean)

    def result(self) -> dict:
        loss = self._loss.mean()
        n_segments = max(0, self._segments - self.from_fragment)
        scored = self._intensity.count
        intensity = self._intensity.mean()
        notes = [ESTIMATE_NOTE]
        where = f"detected segments >= {self.from_fragment}"
        if loss is None:
            notes.append(f"loss, ppl: no batches in the evaluated span ({where})")
        elif loss >= PPL_LOSS_LIMIT:
            notes.append(f"ppl: mean loss {loss:.3g} nats >= {PPL_LOSS_LIMIT:g}, reported as inf")
        if not scored:
            notes.append(
                f"ppl@sw, rec: fewer than three detected segments in the evaluated span ({where}; "
                f"{n_segments} segment(s), the first and the last are never scored)"
            )
        return {
            "loss": loss,
            "ppl": None if loss is None else perplexity(loss),
            "ppl@sw": ppl_at_switch(intensity),
            "rec": float(self._rec_total) / scored if scored else None,
            "n_batches": self._loss.count,
            "n_segments": n_segments,
            "n_scored_segments": scored,
            "from_fragment": self.from_fragment,
            "k": self.k,
            "estimated_from": "detected switches",
            "notes": notes,
        }
