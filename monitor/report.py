"""The end-of-run report: CALM metrics over the paper's span and the whole stream, as JSON and a plot.

JSON policy: ``None`` is written as ``null``; a non-finite float (a perplexity of a
diverged run) is written as the string ``"inf"``, ``"-inf"`` or ``"nan"``, so
``results.json`` is strict JSON (written with ``allow_nan=False``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monitor.accuracy import accuracy_metrics
from monitor.calm import calm_metrics
from monitor.detection import detected_times, detection_report
from monitor.figures import plot_gate_weights, plot_probe_heatmap
from monitor.forgetting import forgetting_summary, matrix_from_probe_log
from monitor.losslog import read_loss_log
from monitor.plots import plot_loss_curve

__all__ = ["build_report", "json_safe", "load_run", "resolve_from_fragment", "write_report"]

LOSS_LOG_NAME = "losses.jsonl"
CONFIG_NAME = "config.json"
RESULTS_NAME = "results.json"
PLOT_NAME = "loss_curve.png"


def load_run(path: str | os.PathLike) -> tuple[list[dict], dict]:
    """(records, config) of a run directory (``losses.jsonl``, optional ``config.json``)
    or of a loss-log file (config ``{}``)."""
    path = Path(path)
    if not path.is_dir():
        return read_loss_log(path), {}
    records = read_loss_log(path / LOSS_LOG_NAME)
    config_path = path / CONFIG_NAME
    config: dict = {}
    if config_path.exists():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a JSON object")
    return records, config


def _expected_fragments(records: Sequence[Mapping], config: Mapping) -> int:
    """N: ``config["n_fragments"]`` if given, else one more than the largest fragment index."""
    if config.get("n_fragments") is not None:
        return int(config["n_fragments"])
    return max((r["sequence"] for r in records), default=-1) + 1


def resolve_from_fragment(spec: str | int, records: Sequence[Mapping], config: Mapping) -> int:
    """First fragment of the evaluated span: "half" (N // 2, the paper), "all" (0) or an index."""
    if spec == "half":
        return _expected_fragments(records, config) // 2
    if spec == "all":
        return 0
    if isinstance(spec, str) and spec.isdigit():
        return int(spec)
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return spec
    raise ValueError(f'from_fragment must be "half", "all" or a non-negative int, got {spec!r}')


def build_report(path: str | os.PathLike, *, k: int = 10, from_fragment: str | int = "half") -> dict:
    """CALM metrics of a run over the evaluated span ("metrics") and over all of it ("whole_stream")."""
    records, config = load_run(path)
    return _report(path, records, config, k=k, from_fragment=from_fragment)


def _report(path: str | os.PathLike, records: list[dict], config: dict, *, k: int, from_fragment: str | int) -> dict:
    start = resolve_from_fragment(from_fragment, records, config)
    expected = _expected_fragments(records, config)
    seen = len({r["sequence"] for r in records})
    metrics = calm_metrics(records, k=k, from_fragment=start)
    if seen < expected:
        metrics["notes"].insert(
            0,
            f"incomplete stream: {seen} of {expected} expected fragments were logged; the CALM "
            "code would report nothing, these metrics cover what was logged",
        )
    report = {
        "run": str(path),
        "config": config,
        "oracle": bool(config.get("oracle")),  # the strategy was told the class (independent)
        "span": {
            "from_fragment": start,
            "n_fragments_expected": expected,
            "n_fragments_seen": seen,
            "complete": seen >= expected,
        },
        "metrics": metrics,
        "whole_stream": calm_metrics(records, k=k, from_fragment=0),
        "detection": detection_report(records, k=k, detector=config.get("detector") or "page-hinkley"),
    }
    report.update(_probe_metrics(Path(path), records, config))
    report.update(_classifier_metrics(Path(path), records))
    return report


def _classifier_metrics(path: Path, records: list[dict]) -> dict:
    """Classifier runs: prequential accuracy and macro-F1 from the loss log, DMI from the saved
    probe representations (None for language models, or when the run saved none)."""
    accuracy = accuracy_metrics(records)
    if accuracy is None:
        return {"accuracy": None, "dmi": None}
    from monitor.dmi import dmi_from_run  # scipy, only for classifier runs

    return {"accuracy": accuracy, "dmi": dmi_from_run(path if path.is_dir() else path.parent, records)}


def _probe_metrics(path: Path, records: list[dict], config: Mapping) -> dict:
    """The forgetting family from the run's probes.jsonl, when the run scored a probe split."""
    probe_log = path / "probes.jsonl" if path.is_dir() else path.with_name("probes.jsonl")
    if not probe_log.is_file():
        return {"forgetting": None, "probe_matrix": None}
    rows = [json.loads(line) for line in probe_log.read_text(encoding="utf-8").splitlines() if line.strip()]
    order = list(dict.fromkeys(r["domain_name"] for r in records))
    classes = order + sorted({c for row in rows for c in row["scores"]} - set(order))
    accuracy = any(row.get("unit") == "accuracy" for row in rows)  # classifier probes: higher is better
    # a classifier run's end-of-run probe closes the last class's first fragment (its stage, as in DMI)
    rows = [{**row, "trigger": "switch"} if row.get("trigger") == "end" else row for row in rows]
    matrix = matrix_from_probe_log(rows, classes, higher_is_better=accuracy, probe_every=config.get("probe_every"))
    summary = forgetting_summary(matrix)
    summary["probe_seconds"] = round(sum(row.get("seconds", 0.0) for row in rows), 3)
    summary["probe_evaluations"] = len(rows)
    return {"forgetting": summary,
            "probe_matrix": {"stages": list(matrix.stages), "classes": list(matrix.classes),
                             "values": matrix.values,
                             "unit": "held-out accuracy" if accuracy else "held-out loss (nats)"}}


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by "inf", "-inf" or "nan" (see module doc)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _title(report: Mapping) -> str:
    config = report["config"]
    parts = [Path(report["run"]).name]
    if "strategy" in config:
        parts.append(f"strategy={config['strategy']}")
    model = config.get("model_name") or config.get("model")
    if isinstance(config.get("model"), Mapping) and "hidden" in config["model"]:
        model = f"{model} (hidden {config['model']['hidden']})"
    if model:
        parts.append(f"model={model}")
    ppl = report["metrics"]["ppl"]
    if ppl is not None:
        parts.append(f"ppl={ppl:.3g} (fragments >= {report['span']['from_fragment']})")
    if report.get("accuracy"):
        parts.append(f"accuracy={report['accuracy']['accuracy']:.3f}")
    return "  ".join(parts)


def write_report(
    path: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    k: int = 10,
    from_fragment: str | int = "half",
) -> dict:
    """Build the report, write ``results.json`` and ``loss_curve.png`` into ``out_dir``
    (default: the run directory, or the loss log's directory) and return the report."""
    path = Path(path)
    records, config = load_run(path)
    report = _report(path, records, config, k=k, from_fragment=from_fragment)
    out = Path(out_dir) if out_dir is not None else (path if path.is_dir() else path.parent)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(report), indent=2, allow_nan=False)
    (out / RESULTS_NAME).write_text(text + "\n", encoding="utf-8")
    plot_loss_curve(records, out / PLOT_NAME, title=_title(report), detected_switches=detected_times(records))
    if any("gates" in row for row in records):  # mixtures log their expert weights (CALM Fig. 1d)
        plot_gate_weights(records, out / "gate_weights.png")
    if report.get("probe_matrix"):
        matrix = report["probe_matrix"]
        plot_probe_heatmap(matrix["values"], matrix["stages"], matrix["classes"], out / "probe_matrix.png",
                           title=f"{matrix['unit']} per class after each stage: {Path(report['run']).name}")
    return report
