"""CALM metrics (loss, ppl, ppl@sw, rec), offline from a loss log and live from a stream.

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

__all__ = ["CalmTracker", "calm_metrics", "format_table"]

PPL_LOSS_LIMIT = 20.0  # the authors' guard: ppl is inf when the mean loss reaches it


def perplexity(loss: float) -> float:
    """exp(loss), or inf when loss >= 20 nats (the CALM code's guard)."""
    return math.inf if loss >= PPL_LOSS_LIMIT else math.exp(loss)


def _exp(value: float) -> float:
    """exp without the 20-nat guard (ppl@sw in the CALM code), inf on overflow."""
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf


def _fmean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def recovery_duration(losses: Iterable[float], previous_mean: float) -> int:
    """Batches from the fragment start until the loss first drops below ``previous_mean``."""
    duration = 0
    for loss in losses:
        if loss < previous_mean:
            break
        duration += 1
    return duration


def _check_params(k: int, from_fragment: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if isinstance(from_fragment, bool) or not isinstance(from_fragment, int) or from_fragment < 0:
        raise ValueError(f"from_fragment must be a non-negative int, got {from_fragment!r}")


@dataclass(frozen=True)
class _Summary:
    """Aggregates of one class (or of all classes) over the span."""

    name: str
    loss: float | None  # mean per-batch loss, nats
    n_batches: int
    n_fragments: int
    n_revisits: int
    intensity: float | None  # mean over revisits of the mean of the first k losses
    rec: float | None  # mean over revisits of the recovery duration


def _metrics_entry(summary: _Summary) -> dict:
    return {
        "loss": summary.loss,
        "ppl": None if summary.loss is None else perplexity(summary.loss),
        "ppl@sw": None if summary.intensity is None else _exp(summary.intensity),
        "rec": summary.rec,
        "n_batches": summary.n_batches,
        "n_fragments": summary.n_fragments,
        "n_revisits": summary.n_revisits,
    }


def _class_keys(summaries: list[tuple[int, _Summary]]) -> list[str]:
    """Per-class keys: the class name, disambiguated by id if two ids share a name."""
    counts: dict[str, int] = {}
    for _, summary in summaries:
        counts[summary.name] = counts.get(summary.name, 0) + 1
    return [s.name if counts[s.name] == 1 else f"{s.name} (id {d})" for d, s in summaries]


def _result(overall: _Summary, per_class: list[tuple[int, _Summary]], k: int, from_fragment: int) -> dict:
    """The result dict shared by :func:`calm_metrics` and :meth:`CalmTracker.snapshot`."""
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


def _split_fragments(records: Iterable[Mapping], from_fragment: int) -> list[tuple[int, str, list[float]]]:
    """Span records grouped into fragments: (class id, class name, losses)."""
    fragments: list[tuple[int, str, list[float]]] = []
    last_sequence = None
    for record in records:
        sequence = record["sequence"]
        if sequence < from_fragment:
            continue
        if not fragments or sequence != last_sequence:
            fragments.append((record["domain"], record["domain_name"], []))
            last_sequence = sequence
        fragments[-1][2].append(float(record["loss"]))
    return fragments


def calm_metrics(records: Iterable[Mapping], *, k: int = 10, from_fragment: int = 0) -> dict:
    """CALM metrics over the records with ``sequence >= from_fragment``, in stream order.

    Each record needs ``loss`` (nats), ``domain`` (class id), ``domain_name`` and
    ``sequence`` (fragment index); other keys are ignored.
    """
    _check_params(k, from_fragment)
    fragments = _split_fragments(records, from_fragment)
    names: dict[int, str] = {}
    losses: dict[int, list[float]] = {}
    n_fragments: dict[int, int] = {}
    intensities: dict[int, list[float]] = {}
    durations: dict[int, list[int]] = {}
    previous_mean: dict[int, float] = {}
    for index, (domain, name, fragment_losses) in enumerate(fragments):
        names.setdefault(domain, name)
        losses.setdefault(domain, []).extend(fragment_losses)
        n_fragments[domain] = n_fragments.get(domain, 0) + 1
        intensities.setdefault(domain, [])
        durations.setdefault(domain, [])
        if index == len(fragments) - 1:
            break  # the last fragment counts for loss only
        if domain in previous_mean:
            intensities[domain].append(_fmean(fragment_losses[:k]))
            durations[domain].append(recovery_duration(fragment_losses, previous_mean[domain]))
        previous_mean[domain] = _fmean(fragment_losses)

    per_class = [
        (
            domain,
            _Summary(
                name=names[domain],
                loss=_fmean(losses[domain]),
                n_batches=len(losses[domain]),
                n_fragments=n_fragments[domain],
                n_revisits=len(durations[domain]),
                intensity=_fmean(intensities[domain]),
                rec=_fmean(durations[domain]),
            ),
        )
        for domain in names
    ]
    all_losses = [x for fragment in fragments for x in fragment[2]]
    all_intensities = [x for domain in names for x in intensities[domain]]
    all_durations = [x for domain in names for x in durations[domain]]
    overall = _Summary(
        name="all",
        loss=_fmean(all_losses),
        n_batches=len(all_losses),
        n_fragments=len(fragments),
        n_revisits=len(all_durations),
        intensity=_fmean(all_intensities),
        rec=_fmean(all_durations),
    )
    return _result(overall, per_class, k, from_fragment)


class _RunningMean:
    """Count and Neumaier-compensated sum, so a mean over a long stream stays exact to rounding."""

    __slots__ = ("count", "_sum", "_compensation")

    def __init__(self) -> None:
        self.count = 0
        self._sum = 0.0
        self._compensation = 0.0

    def add(self, value: float) -> None:
        total = self._sum + value
        if math.isfinite(total):
            if abs(self._sum) >= abs(value):
                self._compensation += (self._sum - total) + value
            else:
                self._compensation += (value - total) + self._sum
        self._sum = total
        self.count += 1

    @property
    def mean(self) -> float | None:
        return (self._sum + self._compensation) / self.count if self.count else None


class _ClassState:
    __slots__ = ("name", "loss", "n_fragments", "intensity", "rec_total", "previous_mean")

    def __init__(self, name: str) -> None:
        self.name = name
        self.loss = _RunningMean()
        self.n_fragments = 0
        self.intensity = _RunningMean()  # count = number of finalized revisits
        self.rec_total = 0
        self.previous_mean: float | None = None

    def summary(self) -> _Summary:
        n_revisits = self.intensity.count
        return _Summary(
            name=self.name,
            loss=self.loss.mean,
            n_batches=self.loss.count,
            n_fragments=self.n_fragments,
            n_revisits=n_revisits,
            intensity=self.intensity.mean,
            rec=self.rec_total / n_revisits if n_revisits else None,
        )


class _OpenFragment:
    """The fragment being received: its mean, its first-k mean and its recovery count so far."""

    __slots__ = ("domain", "previous_mean", "loss", "head", "duration", "recovered")

    def __init__(self, domain: int, previous_mean: float | None) -> None:
        self.domain = domain
        self.previous_mean = previous_mean  # None: not a revisit
        self.loss = _RunningMean()
        self.head = _RunningMean()
        self.duration = 0
        self.recovered = False

    def add(self, loss: float, k: int) -> None:
        self.loss.add(loss)
        if self.head.count < k:
            self.head.add(loss)
        if self.previous_mean is not None and not self.recovered:
            if loss < self.previous_mean:
                self.recovered = True
            else:
                self.duration += 1


class CalmTracker:
    """The CALM metrics of :func:`calm_metrics`, updated one batch at a time in O(classes) memory.

    ``snapshot()`` equals ``calm_metrics(records_so_far, k=k, from_fragment=from_fragment)``
    (the still-open fragment is the last one, so it counts for loss only), plus a
    ``"live"`` sub-dict about the most recent switches.
    """

    def __init__(self, k: int = 10, from_fragment: int = 0) -> None:
        _check_params(k, from_fragment)
        self.k = k
        self.from_fragment = from_fragment
        # whole stream
        self._switches = 0
        self._sequence: int | None = None
        self._class_name: str | None = None
        self._batches_in_fragment = 0
        # evaluated span
        self._span_sequence: int | None = None
        self._classes: dict[int, _ClassState] = {}
        self._open: _OpenFragment | None = None
        self._loss = _RunningMean()
        self._n_fragments = 0
        self._intensity = _RunningMean()
        self._rec_total = 0
        self._last_intensity: float | None = None
        self._last_rec: int | None = None
        self._last_revisit_class: str | None = None

    def __repr__(self) -> str:
        return f"CalmTracker(k={self.k}, from_fragment={self.from_fragment})"

    def update(self, loss: float, domain: int, domain_name: str, sequence: int) -> None:
        """Record the (pre-update) loss of one batch."""
        loss = float(loss)
        if self._sequence is None or sequence != self._sequence:
            if self._sequence is not None:
                self._switches += 1
            self._sequence = sequence
            self._class_name = domain_name
            self._batches_in_fragment = 0
        self._batches_in_fragment += 1
        if sequence < self.from_fragment:
            return
        if self._open is None or sequence != self._span_sequence:
            self._close_fragment()
            self._open_fragment(domain, domain_name)
            self._span_sequence = sequence
        self._open.add(loss, self.k)
        self._loss.add(loss)
        self._classes[self._open.domain].loss.add(loss)

    def _open_fragment(self, domain: int, domain_name: str) -> None:
        state = self._classes.setdefault(domain, _ClassState(domain_name))
        state.n_fragments += 1
        self._n_fragments += 1
        self._open = _OpenFragment(domain, state.previous_mean)

    def _close_fragment(self) -> None:
        fragment = self._open
        if fragment is None:
            return
        state = self._classes[fragment.domain]
        if fragment.previous_mean is not None:
            intensity = fragment.head.mean
            state.intensity.add(intensity)
            state.rec_total += fragment.duration
            self._intensity.add(intensity)
            self._rec_total += fragment.duration
            self._last_intensity = intensity
            self._last_rec = fragment.duration
            self._last_revisit_class = state.name
        state.previous_mean = fragment.loss.mean
        self._open = None

    def snapshot(self) -> dict:
        """The metrics over the records seen so far, plus the ``"live"`` sub-dict."""
        n_revisits = self._intensity.count
        mean_rec = self._rec_total / n_revisits if n_revisits else None
        overall = _Summary(
            name="all",
            loss=self._loss.mean,
            n_batches=self._loss.count,
            n_fragments=self._n_fragments,
            n_revisits=n_revisits,
            intensity=self._intensity.mean,
            rec=mean_rec,
        )
        per_class = [(domain, state.summary()) for domain, state in self._classes.items()]
        result = _result(overall, per_class, self.k, self.from_fragment)
        result["live"] = {
            "switches": self._switches,
            "current_sequence": self._sequence,
            "current_class": self._class_name,
            "batches_in_fragment": self._batches_in_fragment,
            "last_loss_after_switch": self._last_intensity,
            "last_rec": self._last_rec,
            "last_revisit_class": self._last_revisit_class,
            "mean_loss_after_switch": self._intensity.mean,
            "mean_rec": mean_rec,
        }
        return result


def _cell(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def format_table(result: Mapping) -> str:
    """A Markdown table of a :func:`calm_metrics` result (row "all", then one per class) and its notes."""
    lines = [
        "| class | ppl | ppl@sw | rec | batches | revisits |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("all", result)] + list(result.get("per_class", {}).items())
    for name, entry in rows:
        lines.append(
            f"| {name} | {_cell(entry['ppl'])} | {_cell(entry['ppl@sw'])} | {_cell(entry['rec'])} "
            f"| {entry['n_batches']} | {entry['n_revisits']} |"
        )
    notes = result.get("notes", [])
    if notes:
        lines.append("")
        lines.extend(f"- {note}" for note in notes)
    return "\n".join(lines) + "\n"
