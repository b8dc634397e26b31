"""CALM metrics (loss, ppl, ppl@sw, rec), offline from a loss log (live: monitor.calm_tracker).

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

__all__ = ["PPL_LOSS_LIMIT", "Summary", "calm_metrics", "calm_result", "check_params", "format_table",
           "perplexity", "recovery_duration"]

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
        "ppl@sw": None if summary.intensity is None else _exp(summary.intensity),
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
    check_params(k, from_fragment)
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
            Summary(
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
    overall = Summary(
        name="all",
        loss=_fmean(all_losses),
        n_batches=len(all_losses),
        n_fragments=len(fragments),
        n_revisits=len(all_durations),
        intensity=_fmean(all_intensities),
        rec=_fmean(all_durations),
    )
    return calm_result(overall, per_class, k, from_fragment)


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
