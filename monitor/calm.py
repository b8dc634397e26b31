"""CALM metrics (loss, ppl, ppl@sw, rec), offline from a loss log (live: monitor.calm_tracker, the same accumulator).

Definitions follow the CALM authors' ``metrics.py`` (repository germank/CALM):

- the span is the records with ``sequence >= from_fragment``; a fragment is a
  maximal run of consecutive span records with the same ``sequence``, and its
  class is the ``domain`` of its first record (as in the authors' code);
- loss is the mean per-batch loss in the span, ppl its exp (inf from 20 nats on);
- every fragment but the last whose class already had a fragment in the span is a
  revisit: its intensity is the mean of its first ``k`` losses and its duration
  the number of batches before the loss first drops below the mean loss of the
  class's previous fragment (the fragment's length if it never does);
- ppl@sw is exp of the mean intensity, rec the mean duration, overall and per class.

Values that cannot be computed are ``None`` and a note says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from monitor.sums import ExactSum

__all__ = ["PPL_LOSS_LIMIT", "CalmAccumulator", "ClassTotals", "OpenFragment", "Summary", "calm_metrics", "calm_result",
           "check_params", "format_table", "markdown_cell", "perplexity", "ppl_at_switch"]

PPL_LOSS_LIMIT = 20.0  # the authors' guard: ppl is inf when the mean loss reaches it


def perplexity(loss: float) -> float:
    """exp(loss), or inf when loss >= 20 nats (the CALM code's guard)."""
    return math.inf if loss >= PPL_LOSS_LIMIT else math.exp(loss)


def ppl_at_switch(intensity: float | None) -> float | None:
    """ppl@sw: exp of the mean loss after a switch, without ppl's 20-nat guard (as the CALM code), inf on
    overflow; None stays None."""
    if intensity is None:
        return None
    try:
        return math.exp(intensity)
    except OverflowError:
        return math.inf


def check_params(k: int, from_fragment: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if isinstance(from_fragment, bool) or not isinstance(from_fragment, int) or from_fragment < 0:
        raise ValueError(f"from_fragment must be a non-negative int, got {from_fragment!r}")


@dataclass(frozen=True)
class Summary:
    """Aggregates of one class (or of all classes) over the span."""

    name: str
    loss: float | None  # mean per-batch loss, nats
    n_batches: int
    n_fragments: int
    n_revisits: int
    intensity: float | None  # mean over revisits of the mean of the first k losses
    rec: float | None  # mean over revisits of the recovery duration


def _metrics_entry(summary: Summary) -> dict:
    return {
        "loss": summary.loss,
        "ppl": None if summary.loss is None else perplexity(summary.loss),
        "ppl@sw": ppl_at_switch(summary.intensity),
        "rec": summary.rec,
        "n_batches": summary.n_batches,
        "n_fragments": summary.n_fragments,
        "n_revisits": summary.n_revisits,
    }


def _class_keys(summaries: list[tuple[int, Summary]]) -> list[str]:
    """Per-class keys: the class name, disambiguated by id if two ids share a name."""
    counts: dict[str, int] = {}
    for _, summary in summaries:
        counts[summary.name] = counts.get(summary.name, 0) + 1
    return [s.name if counts[s.name] == 1 else f"{s.name} (id {d})" for d, s in summaries]


def calm_result(overall: Summary, per_class: list[tuple[int, Summary]], k: int, from_fragment: int) -> dict:
    """The result dict shared by :func:`calm_metrics` and :meth:`monitor.calm_tracker.CalmTracker.snapshot`."""
    span = f"fragments >= {from_fragment}"
    notes: list[str] = []
    if overall.n_batches == 0:
        notes.append(f"loss, ppl: no batches in the evaluated span ({span})")
    elif overall.loss is not None and overall.loss >= PPL_LOSS_LIMIT:
        notes.append(f"ppl: mean loss {overall.loss:.3g} nats >= {PPL_LOSS_LIMIT:g}, reported as inf")
    if overall.n_revisits == 0:
        notes.append(
            f"ppl@sw, rec: no class was revisited in the evaluated span ({span}; "
            "the last fragment is never counted)"
        )
    keys = _class_keys(per_class)
    for key, (_, summary) in zip(keys, per_class):
        if summary.n_revisits == 0 and overall.n_revisits > 0:
            notes.append(
                f"class {key!r}: ppl@sw, rec n/a, never revisited in the evaluated span "
                f"({span}; {summary.n_fragments} fragment(s), the last fragment is never counted)"
            )
    result = _metrics_entry(overall)
    result.update(
        from_fragment=from_fragment,
        k=k,
        per_class={key: _metrics_entry(s) for key, (_, s) in zip(keys, per_class)},
        notes=notes,
    )
    return result


class ClassTotals:
    """One class's sums over the span: its losses, its fragments, its revisits' intensities and recovery
    durations, and the mean loss of its last closed fragment (the next revisit's threshold)."""

    __slots__ = ("name", "loss", "n_fragments", "intensity", "rec_total", "previous_mean")

    def __init__(self, name: str, sum_type: type = ExactSum) -> None:
        self.name = name
        self.loss = sum_type()
        self.n_fragments = 0
        self.intensity = sum_type()  # count: revisits
        self.rec_total = 0
        self.previous_mean: float | None = None

    def summary(self) -> Summary:
        revisits = self.intensity.count
        return Summary(name=self.name, loss=self.loss.mean(), n_batches=self.loss.count,
                       n_fragments=self.n_fragments, n_revisits=revisits, intensity=self.intensity.mean(),
                       rec=float(self.rec_total) / revisits if revisits else None)


class OpenFragment:
    """A fragment (or a detected segment) being read: the sum of its losses, of its first k losses,
    and the batches until the loss first drops below `previous_mean` (None: not a revisit, no
    recovery counted). Shared by CalmAccumulator (so CalmTracker) and monitor.detected_calm."""

    __slots__ = ("k", "previous_mean", "loss", "head", "duration", "recovered")

    def __init__(self, k: int, previous_mean: float | None, sum_type: type = ExactSum) -> None:
        self.k, self.previous_mean = k, previous_mean
        self.loss = sum_type()
        self.head = sum_type()  # the first k losses
        self.duration, self.recovered = 0, False

    def add(self, loss: float) -> None:
        self.loss.add(loss)
        if self.head.count < self.k:
            self.head.add(loss)
        if self.previous_mean is not None and not self.recovered:
            if loss < self.previous_mean:
                self.recovered = True
            else:
                self.duration += 1

    def intensity(self) -> float:
        """The mean loss of its first k batches (CALM's loss after a switch)."""
        return self.head.mean()


class CalmAccumulator:
    """:func:`calm_metrics` one record at a time in O(classes + k) memory, with exactly its numbers
    (sums as ``math.fsum``): the still-open fragment is the last one, so it counts for loss only.

    The one implementation of the fragment, class and revisit bookkeeping: monitor.calm_tracker's
    CalmTracker is this accumulator with compensated sums (``sum_type``), saved in checkpoints."""

    sum_type: type = ExactSum  # of every sum it keeps: monitor.sums.ExactSum or CompensatedSum

    def __init__(self, k: int = 10, from_fragment: int = 0) -> None:
        check_params(k, from_fragment)
        self.k, self.from_fragment = k, from_fragment
        self._classes: dict[int, ClassTotals] = {}
        self._loss = self.sum_type()
        self._intensity = self.sum_type()
        self._rec_total = 0
        self._n_fragments = 0
        self._open: OpenFragment | None = None
        self._open_domain: int | None = None  # the class of the open fragment
        self._span_sequence: int | None = None  # the sequence of the open (or last closed) fragment

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k}, from_fragment={self.from_fragment})"

    def update(self, loss: float, domain: int, domain_name: str, sequence: int) -> None:
        if sequence < self.from_fragment:
            return
        loss = float(loss)
        fragment = self._open
        if fragment is None or sequence != self._span_sequence:
            self._close()
            totals = self._classes.get(domain)
            if totals is None:
                totals = self._classes[domain] = ClassTotals(domain_name, self.sum_type)
            totals.n_fragments += 1
            self._n_fragments += 1
            fragment = self._open = OpenFragment(self.k, totals.previous_mean, self.sum_type)
            self._open_domain, self._span_sequence = domain, sequence
        fragment.add(loss)
        self._classes[self._open_domain].loss.add(loss)
        self._loss.add(loss)

    def _close(self) -> tuple[str, float, int] | None:
        """The open fragment is not the last: a revisit scores, and its mean is the class's previous.
        Returns the revisit it scored (class name, intensity, recovery duration), if any."""
        fragment, self._open = self._open, None
        if fragment is None:
            return None
        totals, revisit = self._classes[self._open_domain], None
        if fragment.previous_mean is not None:
            intensity = fragment.intensity()
            totals.intensity.add(intensity)
            totals.rec_total += fragment.duration
            self._intensity.add(intensity)
            self._rec_total += fragment.duration
            revisit = (totals.name, intensity, fragment.duration)
        totals.previous_mean = fragment.loss.mean()
        return revisit

    def result(self) -> dict:
        """The :func:`calm_metrics` result over the records so far."""
        per_class = [(domain, totals.summary()) for domain, totals in self._classes.items()]
        revisits = self._intensity.count
        overall = Summary(name="all", loss=self._loss.mean(), n_batches=self._loss.count,
                          n_fragments=self._n_fragments, n_revisits=revisits, intensity=self._intensity.mean(),
                          rec=float(self._rec_total) / revisits if revisits else None)
        return calm_result(overall, per_class, self.k, self.from_fragment)


def calm_metrics(records: Iterable[Mapping], *, k: int = 10, from_fragment: int = 0) -> dict:
    """CALM metrics over the records with ``sequence >= from_fragment``, in stream order.

    Each record needs ``loss`` (nats), ``domain`` (class id), ``domain_name`` and
    ``sequence`` (fragment index); other keys are ignored. The records are read once, one at a
    time (:class:`CalmAccumulator`), so a generator over a long log needs no list.
    """
    accumulator = CalmAccumulator(k, from_fragment)
    for record in records:
        accumulator.update(record["loss"], record["domain"], record["domain_name"], record["sequence"])
    return accumulator.result()


def _cell(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def markdown_cell(text) -> str:
    """`text` as one cell of a Markdown table: a `|` escaped and a line break a space (a class named `a|b` split its
    row into one cell more than the header's)."""
    return " ".join(str(text).splitlines()).replace("|", r"\|")


def format_table(result: Mapping) -> str:
    """A Markdown table of a :func:`calm_metrics` result (row "all", then one per class) and its notes."""
    lines = [
        "| class | ppl | ppl@sw | rec | batches | revisits |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("all", result)] + list(result.get("per_class", {}).items())
    for name, entry in rows:
        lines.append(
            f"| {markdown_cell(name)} | {_cell(entry['ppl'])} | {_cell(entry['ppl@sw'])} | {_cell(entry['rec'])} "
            f"| {entry['n_batches']} | {entry['n_revisits']} |"
        )
    notes = result.get("notes", [])
    if notes:
        lines.append("")
        lines.extend(f"- {note}" for note in notes)
    return "\n".join(lines) + "\n"
