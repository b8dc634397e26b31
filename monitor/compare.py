"""Reports across several runs: CALM's Table 1 (mean ± std per strategy), forgetting metrics and figures.

Input is the single-run reports of :func:`monitor.report.build_report` (with their
loss-log records for the figures). Standard deviations are sample standard
deviations (ddof=1) over runs, ``None`` for a single run; a run without a value
(``None``) is skipped and counted in a note; a non-finite value (a diverged run's
ppl of inf) makes the mean inf and the std ``None``, also with a note.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from monitor.calm import markdown_cell
from monitor.figures import plot_after_switch, plot_probe_heatmap, strategy_after_switch
from monitor.files import json_safe
from monitor.reference import add_oracle_reference
from monitor.report import build_report, load_run

__all__ = [
    "FORGETTING_KEYS",
    "forgetting_table_markdown",
    "load_runs",
    "summarise_forgetting",
    "summarise_runs",
    "unique_name",
    "table1_markdown",
    "write_comparison",
]

CALM_COLUMNS = ("ppl", "ppl@sw", "rec")
FORGETTING_KEYS = (
    "forgetting", "transfer", "zero_shot_transfer", "final_performance", "bwt", "fwt",
    "cur_acc", "last_acc", "chaudhry_forgetting", "intransigence", "aultc",
)
AFTER_SWITCH_HORIZON = 15


def _strategy(report: Mapping) -> str:
    return str(report.get("config", {}).get("strategy") or "unknown")


def _oracle(group: Sequence[Mapping]) -> bool:
    """One model per class, told the class: an upper bound (the learner's config.json says so)."""
    return any(r.get("config", {}).get("oracle") for r in group)


def _reference(group: Sequence[Mapping]) -> bool:
    """The same batches shuffled i.i.d. and learned offline (`streamer multitask`'s config.json says so)."""
    return any(r.get("config", {}).get("reference") for r in group)


def _run_name(report: Mapping) -> str:
    config = report.get("config", {})
    return str(config.get("run_name") or Path(str(report.get("run", "run"))).name)


def _run_names(reports: Sequence[Mapping]) -> list[str]:
    """Each run's name; runs of one name (A/naive-seed0, B/naive-seed0) by their directory's parent too."""
    names = [_run_name(r) for r in reports]

    def where(report: Mapping, name: str) -> str:
        path = Path(str(report.get("run", "run")))
        run_dir = path.parent if path.suffix == ".jsonl" else path
        return f"{run_dir.parent.name}/{name}"
    return [where(r, n) if names.count(n) > 1 else n for r, n in zip(reports, names)]


def _number(value) -> float | None:
    """A metric value as a float: ``None`` stays ``None``; "inf"/"nan" strings (results.json) are parsed."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) else None


def _stats(values: Sequence[float | None]) -> dict:
    """mean, sample std (ddof=1, None for fewer than two values), n used and n missing."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    result = {"mean": None, "std": None, "n": len(present), "missing": len(values) - len(present)}
    if not present:
        return result
    infinite = {v for v in present if math.isinf(v)}
    if infinite:  # a diverged run: the mean is that infinity (nan if both signs occur), no std
        result["mean"] = infinite.pop() if len(infinite) == 1 else math.nan
        return result
    result["mean"] = math.fsum(present) / len(present)
    if len(present) > 1:
        result["std"] = statistics.stdev(present)
    return result


def _group(reports: Iterable[Mapping]) -> dict[str, list[Mapping]]:
    """Reports by strategy, in order of first appearance, references and oracle strategies last."""
    groups: dict[str, list[Mapping]] = {}
    for report in reports:
        groups.setdefault(_strategy(report), []).append(report)
    return dict(sorted(groups.items(), key=lambda item: (_oracle(item[1]), _reference(item[1]))))


def _parameters(group: Sequence[Mapping]) -> int | list[int] | None:
    counts = sorted({int(r["config"]["parameters"]) for r in group if r.get("config", {}).get("parameters")})
    if not counts:
        return None
    return counts[0] if len(counts) == 1 else counts


def _why_missing(column: str, reports: Sequence[Mapping]) -> list[str]:
    """The reasons the runs' own notes give for `column` having no value ("ppl@sw, rec: no class was
    revisited ..."), each once."""
    reasons: list[str] = []
    for report in reports:
        for note in report.get("metrics", {}).get("notes") or ():
            head, said, why = str(note).partition(": ")
            if said and column in head.split(", ") and why not in reasons:
                reasons.append(why)
    return reasons


def summarise_runs(reports: Sequence[Mapping]) -> list[dict]:
    """One entry per strategy: n_runs, run names, seeds, parameters, and mean/std/n/missing of
    ppl, ppl@sw and rec (from each report's ``"metrics"``), with notes on what was skipped."""
    summary = []
    for strategy, group in _group(reports).items():
        names = _run_names(group)
        notes = []
        metrics = {}
        for column in CALM_COLUMNS:
            values = [_number(r.get("metrics", {}).get(column)) for r in group]
            metrics[column] = stats = _stats(values)
            if stats["missing"]:
                gone = [(n, r) for n, r, v in zip(names, group, values) if v is None or math.isnan(v)]
                why = _why_missing(column, [r for _, r in gone])  # (Table 1 printed n/a, and no why)
                notes.append(f"{column}: no value in {stats['missing']} of {len(group)} runs "
                             f"({', '.join(n for n, _ in gone)})" + (f": {'; '.join(why)}" if why else "")
                             + (f"; mean over the other {stats['n']}" if stats["n"] else ""))
            if stats["mean"] is not None and not math.isfinite(stats["mean"]):
                notes.append(f"{column}: a run's value is not finite (diverged), so the mean is "
                             f"{stats['mean']} and the std n/a")
        seeds = [r.get("config", {}).get("seed") for r in group]
        if any(seed is None for seed in seeds):
            notes.append(f"seed not recorded for {seeds.count(None)} run(s)")
        repeated = sorted({s for s in seeds if s is not None and seeds.count(s) > 1})
        if repeated:
            notes.append(f"seed(s) {repeated} appear in more than one run")
        incomplete = [n for n, r in zip(names, group) if not r.get("span", {}).get("complete", True)]
        if incomplete:
            notes.append(f"incomplete stream in {', '.join(incomplete)}: metrics cover what was logged")
        parameters = _parameters(group)
        if isinstance(parameters, list):
            notes.append(f"runs differ in parameter count: {parameters}")
        summary.append({
            "strategy": strategy,
            "oracle": _oracle(group),
            "reference": _reference(group),
            "n_runs": len(group),
            "runs": names,
            "seeds": seeds,
            "parameters": parameters,
            "from_fragment": sorted({r.get("span", {}).get("from_fragment") for r in group},
                                    key=lambda v: (v is None, v)),
            "metrics": metrics,
            "notes": notes,
        })
    return summary


def _number_text(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2f}"


def _mean_std(stats: Mapping) -> str:
    """"mean ± std", "mean" when there is no std, "n/a" when there is no mean."""
    if stats["mean"] is None:
        return "n/a"
    if stats["std"] is None:
        return _number_text(stats["mean"])
    return f"{_number_text(stats['mean'])} ± {_number_text(stats['std'])}"


def _parameters_text(parameters) -> str:
    if parameters is None:
        return "n/a"
    if isinstance(parameters, list):
        return f"{parameters[0]:,}–{parameters[-1]:,}"
    return f"{parameters:,}"


def _label(entry: Mapping) -> str:
    """The strategy's name as a Markdown table cell (a run's config.json says it), with what it is."""
    name = markdown_cell(entry["strategy"])
    if entry.get("oracle"):
        return f"{name} (oracle)"
    return f"{name} (reference)" if entry.get("reference") else name


def table1_markdown(summary: Sequence[Mapping]) -> str:
    """A Markdown table shaped like CALM's Table 1 (one row per strategy), followed by notes."""
    lines = [
        "| strategy | runs | ppl | ppl@sw | rec | params |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for entry in summary:
        cells = [_mean_std(entry["metrics"][column]) for column in CALM_COLUMNS]
        lines.append(f"| {_label(entry)} | {entry['n_runs']} | {' | '.join(cells)} "
                     f"| {_parameters_text(entry.get('parameters'))} |")
    spans = sorted({f for entry in summary for f in entry.get("from_fragment", []) if f is not None})
    span = f"fragments >= {spans[0]}" if len(spans) == 1 else f"fragments >= {spans} (runs differ)"
    lines += [
        "",
        f"- mean ± sample standard deviation (ddof=1) over runs; one run: the value alone. "
        f"Evaluated span: {span if spans else 'unknown'}.",
        "- ppl@sw: perplexity of the first k batches after a switch back to a seen class; "
        "rec: batches until the loss falls below the class's previous-fragment mean (CALM).",
    ]
    if any(entry.get("oracle") for entry in summary):
        lines.append("- (oracle): one model per class, told the class; an upper bound, not a competitor. "
                     "Its params: all its per-class models (as `streamer compare` records them).")
    if any(entry.get("reference") for entry in summary):
        lines.append("- (reference): the stream's batches shuffled i.i.d. and learned offline by a naive "
                     "learner; metrics at the batches' stream positions.")
    for entry in summary:
        lines.extend(f"- {_label(entry)}: {note}" for note in entry.get("notes", []))
    return "\n".join(lines) + "\n"


def summarise_forgetting(reports: Sequence[Mapping]) -> list[dict]:
    """Per strategy, mean/std/n/missing of every scalar in the reports' ``"forgetting"`` dicts
    (known keys first, in :data:`FORGETTING_KEYS` order); empty when no report has one."""
    if not any(isinstance(r.get("forgetting"), Mapping) for r in reports):
        return []
    keys = [k for k in FORGETTING_KEYS if any(_number((r.get("forgetting") or {}).get(k)) is not None
                                              for r in reports)]
    extra = {k for r in reports for k, v in (r.get("forgetting") or {}).items()
             if k not in FORGETTING_KEYS and _number(v) is not None}
    keys += sorted(extra)
    summary = []
    for strategy, group in _group(reports).items():
        with_dict = [r for r in group if isinstance(r.get("forgetting"), Mapping)]
        summary.append({
            "strategy": strategy,
            "oracle": _oracle(group),
            "reference": _reference(group),
            "n_runs": len(group),
            "n_with_forgetting": len(with_dict),
            "metrics": {k: _stats([_number((r.get("forgetting") or {}).get(k)) for r in group]) for k in keys},
        })
    return summary


FORGETTING_MISSING_NOTE = (
    "Probe-based metrics (forgetting, transfer, BWT/FWT, ...) are not available: they need "
    "held-out probe splits per class and probe scoring during the run, and no report has them.\n"
)


def forgetting_table_markdown(reports: Sequence[Mapping]) -> str:
    """A Markdown table of the probe-based metrics per strategy (mean ± std over runs),
    or a one-line note when no report carries a ``"forgetting"`` dict."""
    summary = summarise_forgetting(reports)
    if not summary:
        return FORGETTING_MISSING_NOTE
    keys = list(summary[0]["metrics"])
    losses = all((r.get("forgetting") or {}).get("score") == "-loss" for r in reports if r.get("forgetting"))
    headers = [_forgetting_header(k, losses) for k in keys]
    lines = [
        "| strategy | runs | " + " | ".join(headers) + " |",
        "|---|---:|" + "---:|" * len(keys),
    ]
    for entry in summary:
        cells = [_forgetting_cell(k, entry["metrics"][k], losses) for k in keys]
        lines.append(f"| {_label(entry)} | {entry['n_with_forgetting']}/{entry['n_runs']} | {' | '.join(cells)} |")
    lines += ["", "- mean ± sample standard deviation (ddof=1) over the runs that have the metric; "
              "runs: runs with probe metrics / runs."]
    if losses:
        lines.append("- language models: the probe scores are losses (nats). Forgetting, transfer, BWT/FWT, "
                     "intransigence and aultc are computed on the negated loss, so positive forgetting means "
                     "worse; cur_loss, last_loss and final_loss are the mean probe losses themselves.")
    return "\n".join(lines) + "\n"


# Probe metrics named for accuracy that, on losses, are a loss level: shown as the loss (nats), sign restored.
LOSS_LEVELS = {"cur_acc": "cur_loss", "last_acc": "last_loss", "final_performance": "final_loss"}


def _forgetting_header(key: str, losses: bool) -> str:
    if losses and key in LOSS_LEVELS:
        return f"{LOSS_LEVELS[key]} (nats)"
    return key


def _forgetting_cell(key: str, stats: Mapping, losses: bool) -> str:
    """A cell of the forgetting table: counts (n_..., probe_evaluations) as integers, loss levels with their
    sign restored."""
    counts = key.startswith("n_") or key == "probe_evaluations"
    if counts and stats["mean"] is not None and float(stats["mean"]).is_integer():
        return f"{int(stats['mean'])}" if not stats["std"] else _mean_std(stats)
    if losses and key in LOSS_LEVELS and stats["mean"] is not None:
        return _mean_std({**stats, "mean": -stats["mean"]})
    return _mean_std(stats)


def load_runs(paths: Iterable[str | os.PathLike], *, k: int | None = None,
              from_fragment: str | int | None = None) -> list[tuple[dict, list[dict]]]:
    """(report, records) of each run directory or loss log, ready for :func:`write_comparison` (`k` and
    `from_fragment` None: each run's own, as in monitor.report.build_report)."""
    return [(build_report(path, k=k, from_fragment=from_fragment), load_run(path)[0]) for path in paths]


def _nan_to_none(values: Sequence[float]) -> list[float | None]:
    return [None if isinstance(v, float) and math.isnan(v) else v for v in values]


def unique_name(name: str, used: set[str]) -> str:
    """`name`, or `name-2`, `name-3`, ... for one in `used` (the one given is added to it)."""
    candidate, index = name, 2
    while candidate in used:
        candidate, index = f"{name}-{index}", index + 1
    used.add(candidate)
    return candidate


def write_comparison(runs: Sequence[tuple[Mapping, Sequence[Mapping]]], out_dir: str | os.PathLike,
                     *, horizon: int = AFTER_SWITCH_HORIZON, left_out: Mapping[str, str] | None = None,
                     incomplete: str | None = None) -> dict:
    """Write ``table1.md``, ``forgetting.md``, ``after_switch.png``, ``probe_matrix_<run>.png``
    (runs whose report has ``"probe_matrix"``) and ``comparison.json`` into ``out_dir``.

    ``runs`` is a list of (report, loss-log records). ``left_out`` names the runs of the plan that
    are not in it, with why (listed under Table 1); ``incomplete`` says why the comparison ended
    before its plan (the first line of Table 1). Returns what ``comparison.json`` holds (before the
    JSON-safe conversion): the per-strategy summary, the forgetting summary, the after-switch
    curves, the files written, the figures skipped, with why, ``left_out`` and ``incomplete``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reports = [report for report, _ in runs]
    add_oracle_reference(reports)  # T and intransigence, where an independent oracle run shares the seed
    summary = summarise_runs(reports)
    files: list[str] = []
    skipped: dict[str, str] = {}

    left_out = dict(left_out or {})
    table1 = (f"**Incomplete: {incomplete}; {len(left_out)} planned run(s) are not in this table.**\n\n"
              if incomplete else "") + table1_markdown(summary)
    table1 += "".join(f"- skipped {name}: {reason}\n" for name, reason in left_out.items())
    (out / "table1.md").write_text(table1, encoding="utf-8")
    (out / "forgetting.md").write_text(forgetting_table_markdown(reports), encoding="utf-8")
    files += ["table1.md", "forgetting.md"]

    groups: dict[str, list[list[Mapping]]] = {}
    for report, records in runs:
        groups.setdefault(_strategy(report), []).append(list(records))
    result = plot_after_switch(groups, out / "after_switch.png", horizon=horizon)
    if result.path is None:
        skipped["after_switch.png"] = result.reason
    else:
        files.append("after_switch.png")
    curves = strategy_after_switch(groups, horizon)

    used: set[str] = set()
    for report in reports:
        matrix = report.get("probe_matrix")
        if not isinstance(matrix, Mapping):
            continue
        name = f"probe_matrix_{unique_name(_run_name(report), used)}.png"
        result = plot_probe_heatmap(matrix.get("values") or [], matrix.get("stages") or [],
                                    matrix.get("classes") or [], out / name,
                                    title=f"{_run_name(report)} ({_strategy(report)}): probe matrix R")
        if result.path is None:
            skipped[name] = result.reason
        else:
            files.append(name)

    comparison = {
        "runs": [str(report.get("run")) for report in reports],
        "strategies": summary,
        "forgetting": summarise_forgetting(reports),
        "after_switch": {
            "horizon": horizon,
            "band": "min-max over runs",
            "curves": {s: {**c, "mean": _nan_to_none(c["mean"]), "min": _nan_to_none(c["min"]),
                           "max": _nan_to_none(c["max"]), "runs": [_nan_to_none(r) for r in c["runs"]]}
                       for s, c in curves.items()},
        },
        "files": files + ["comparison.json"],
        "skipped": skipped,
        "left_out": left_out,
        "incomplete": incomplete,
    }
    text = json.dumps(json_safe(comparison), indent=2, allow_nan=False)
    (out / "comparison.json").write_text(text + "\n", encoding="utf-8")
    return comparison
