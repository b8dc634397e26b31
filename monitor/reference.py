"""Transfer T and intransigence need a per-class reference: the score of a model trained on
that class alone. The `independent` oracle run of the same stream (same seed) is exactly that:
at stage i (the end of class i's first fragment) its class-i model has learned class i's first
fragment and nothing else, and probes score each class with its own model. So R_oracle[i][i]
is class i's reference, and the other runs of that seed get T and intransigence from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from monitor.forgetting import ProbeMatrix, intransigence, transfer

__all__ = ["oracle_reference", "add_oracle_reference"]


def _matrix(report: Mapping) -> ProbeMatrix | None:
    probe = report.get("probe_matrix")
    if not isinstance(probe, Mapping) or not probe.get("stages"):
        return None
    return ProbeMatrix(classes=tuple(probe["classes"]), stages=tuple(probe["stages"]),
                       values=[list(row) for row in probe["values"]],
                       higher_is_better=probe.get("unit") == "held-out accuracy")


def oracle_reference(report: Mapping) -> dict[str, float] | None:
    """{class: the oracle's held-out value of that class at its own stage} (raw units)."""
    matrix = _matrix(report)
    if matrix is None:
        return None
    return {matrix.classes[i]: matrix.values[i][i] for i in range(matrix.n_stages)
            if matrix.values[i][i] is not None}


def _seed(report: Mapping):
    return (report.get("config") or {}).get("seed")


def add_oracle_reference(reports: Sequence[dict]) -> int:
    """Fill `transfer` and `intransigence` in the `forgetting` dict of every non-oracle report
    whose seed has an oracle report with a probe matrix; returns how many were filled."""
    references = {}
    for report in reports:
        if report.get("oracle") and _seed(report) is not None:
            reference = oracle_reference(report)
            if reference:
                references[_seed(report)] = (reference, str(report.get("run", "")))
    filled = 0
    for report in reports:
        forgetting, matrix = report.get("forgetting"), _matrix(report)
        if report.get("oracle") or _seed(report) not in references or matrix is None \
                or not isinstance(forgetting, dict):
            continue
        reference, run = references[_seed(report)]
        notes: list[str] = []
        forgetting["transfer"] = transfer(matrix, reference, notes=notes)
        forgetting["intransigence"] = intransigence(matrix, reference, notes=notes)
        forgetting["reference"] = f"independent oracle run {run} (same seed): its class-i model at stage i"
        forgetting.setdefault("notes", [])
        forgetting["notes"] = [n for n in forgetting["notes"] if not n.startswith(("transfer", "intransigence"))]
        forgetting["notes"] += notes
        filled += 1
    return filled
