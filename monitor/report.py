"""The end-of-run report: CALM metrics over the paper's span and the whole stream, as JSON and a plot.

Bounded memory: the loss log (rotated files included) is read twice, one record at a time: a survey
(fragment count, classes, whether the detections were logged), then every metric at once from
fixed-size state (monitor.calm.CalmAccumulator, monitor.detection.DetectionReport,
monitor.accuracy.AccuracyTracker, monitor.plots.LossCurve, monitor.figures.GateCurve). The numbers
equal those computed from a list of every record (sums are ``math.fsum``'s); the lists of matched,
false and missed detections keep their last 1,000 entries, and the plots at most 2,000 points.

JSON policy: ``None`` is written as ``null``; a non-finite float (a perplexity of a
diverged run) is written as the string ``"inf"``, ``"-inf"`` or ``"nan"``, so
``results.json`` is strict JSON (written with ``allow_nan=False``).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from monitor.accuracy import AccuracyTracker
from monitor.calm import CalmAccumulator
from monitor.detection import DetectionReport
from monitor.figures import GateCurve, plot_probe_heatmap
from monitor.files import json_safe, replace_text
from monitor.forgetting import forgetting_summary, matrix_from_probe_log, probe_rows
from monitor.losslog import iter_loss_log, read_loss_log, torn_tail
from monitor.plots import LossCurve

__all__ = ["build_report", "load_run", "read_config", "report_files", "resolve_from_fragment",
           "write_report"]

LOSS_LOG_NAME = "losses.jsonl"
CONFIG_NAME = "config.json"
RESULTS_NAME = "results.json"
PLOT_NAME = "loss_curve.png"
FIGURE_NAMES = (PLOT_NAME, "probe_matrix.png", "gate_weights.png")  # the last two: runs that have them
DEFAULT_K, DEFAULT_SPAN = 10, "half"  # a log without a config.json: CALM's k and the paper's span


def _log_of(path: Path) -> Path:
    return path / LOSS_LOG_NAME if path.is_dir() else path


def read_config(path: str | os.PathLike) -> dict:
    """A run directory's ``config.json``, or for a loss-log file the one beside it ({} when absent):
    without it a run's log reported on as a file was scored over the fragments it held, not its
    stream's, and its results.json lost the run's configuration."""
    path = Path(path)
    config_path = (path if path.is_dir() else path.parent) / CONFIG_NAME
    if not config_path.exists():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # (the error named no file)
        raise ValueError(f"{config_path} is not JSON ({exc}); a learner writes it whole, so it was changed "
                         "by hand or damaged") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    return config


def _schedule_of(path: Path) -> str | None:
    """The schedule kind of the run's stream, from its manifest.json copy (None without one)."""
    manifest = (path if path.is_dir() else path.parent) / "manifest.json"
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("schedule")
    except (OSError, ValueError, AttributeError):
        return None


def load_run(path: str | os.PathLike) -> tuple[list[dict], dict]:
    """(records, config) of a run directory (``losses.jsonl``, optional ``config.json``)
    or of a loss-log file (config ``{}``). Holds every record: the report itself streams."""
    return read_loss_log(_log_of(Path(path))), read_config(path)


class _Distinct:
    """Distinct ints as sorted disjoint ranges: O(1) memory for a log whose fragments only go up."""

    def __init__(self) -> None:
        self._ranges: list[list[int]] = []  # [first, last]

    def add(self, value: int) -> None:
        ranges = self._ranges
        if ranges and ranges[-1][0] <= value <= ranges[-1][1] + 1:
            ranges[-1][1] = max(ranges[-1][1], value)
            return
        at = bisect.bisect_right(ranges, [value, math.inf])
        if at and ranges[at - 1][1] + 1 >= value:
            ranges[at - 1][1] = max(ranges[at - 1][1], value)
            at -= 1
        else:
            ranges.insert(at, [value, value])
        while at + 1 < len(ranges) and ranges[at + 1][0] <= ranges[at][1] + 1:
            ranges[at][1] = max(ranges[at][1], ranges.pop(at + 1)[1])

    def __len__(self) -> int:
        return sum(last - first + 1 for first, last in self._ranges)


@dataclass
class _Survey:
    """The first pass over a loss log: what the second needs to know before it starts."""

    count: int = 0
    max_sequence: int = -1
    sequences: _Distinct = field(default_factory=_Distinct)
    detected_field: bool = True  # every record has "detected_switch"
    gates: bool = False  # some record has "gates"
    classes: dict = field(default_factory=dict)  # class names in first-seen order

    @classmethod
    def of(cls, log: Path) -> _Survey:
        survey = cls()
        for record in iter_loss_log(log):
            survey.count += 1
            survey.max_sequence = max(survey.max_sequence, record["sequence"])
            survey.sequences.add(record["sequence"])
            survey.detected_field = survey.detected_field and "detected_switch" in record
            survey.gates = survey.gates or "gates" in record
            survey.classes.setdefault(record["domain_name"], None)
        survey.detected_field = survey.detected_field and survey.count > 0
        return survey


def _expected_fragments(max_sequence: int, config: Mapping) -> int:
    """N: ``config["n_fragments"]`` if given, else one more than the largest fragment index."""
    if config.get("n_fragments") is not None:
        return int(config["n_fragments"])
    return max_sequence + 1


def resolve_from_fragment(spec: str | int, records: Iterable[Mapping], config: Mapping) -> int:
    """First fragment of the evaluated span: "half" (N // 2, the paper), "all" (0) or an index."""
    return _resolve(spec, lambda: max((r["sequence"] for r in records), default=-1), config)


def _resolve(spec: str | int, max_sequence, config: Mapping) -> int:
    if spec == "half":
        return _expected_fragments(max_sequence(), config) // 2
    if spec == "all":
        return 0
    if isinstance(spec, str) and spec.isdigit():
        spec = int(spec)
    if not (isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0):
        raise ValueError(f'from_fragment must be "half", "all" or a non-negative int, got {spec!r}')
    expected = _expected_fragments(max_sequence(), config)
    if expected and spec >= expected:  # (its tables were empty, titled "fragments >= 99 of 40")
        raise ValueError(f"--from-fragment {spec} is past the stream's last fragment: it has {expected} "
                         f"(0 to {expected - 1}); give one of those, 'half' or 'all'")
    return spec


def build_report(path: str | os.PathLike, *, k: int | None = None, from_fragment: str | int | None = None) -> dict:
    """CALM metrics of a run over the evaluated span ("metrics") and over all of it ("whole_stream").

    `k` and `from_fragment` None: those the run was learned with (its config.json), else 10 and "half".
    The loss log (its rotated files included) is read twice, one record at a time, and every metric
    is kept in fixed-size state, so memory does not grow with the log's length."""
    return _report(Path(path), read_config(path), k=k, from_fragment=from_fragment)


def _run_k_and_span(config: Mapping, k: int | None, from_fragment: str | int | None) -> tuple[int, str | int, bool]:
    """The given k and span, else the run's own (config.json: what its learner scored and wrote in
    results.json; a report over another span wrote other numbers over those), else 10 and "half"; and
    whether the span is the run's own (never refused: a run stopped before it has an empty span)."""
    k = k if k is not None else config.get("k", DEFAULT_K)
    if from_fragment is None and isinstance(config.get("from_fragment"), int):
        return k, config["from_fragment"], True
    return k, from_fragment if from_fragment is not None else DEFAULT_SPAN, False


def _report(path: Path, config: dict, *, k: int | None, from_fragment: str | int | None,
            curve: LossCurve | None = None, gates: GateCurve | None = None) -> dict:
    log = _log_of(path)
    k, from_fragment, own = _run_k_and_span(config, k, from_fragment)
    survey = _Survey.of(log)
    start = from_fragment if own else _resolve(from_fragment, lambda: survey.max_sequence, config)
    expected = _expected_fragments(survey.max_sequence, config)
    span = CalmAccumulator(k, start)
    whole = CalmAccumulator(k, 0) if start else span
    detection = DetectionReport(use_field=survey.detected_field, k=k,
                                detector=config.get("detector") or "page-hinkley")
    accuracy = AccuracyTracker()
    gates = gates if survey.gates else None
    for record in iter_loss_log(log):
        loss, domain, name, sequence = record["loss"], record["domain"], record["domain_name"], record["sequence"]
        span.update(loss, domain, name, sequence)
        if whole is not span:
            whole.update(loss, domain, name, sequence)
        detection.update(record)
        if record.get("predicted") is not None and record.get("labels") is not None:
            accuracy.update(record["predicted"], record["labels"], name)
        if curve is not None:
            curve.update(loss, sequence, name, bool(record.get("detected_switch")))
        if gates is not None:
            gates.update(record)
    seen = len(survey.sequences)
    metrics = span.result()
    if not survey.count:  # (it said "past the fragments it logged (0 to -1)")
        metrics["notes"].append("no batches logged: nothing to score")
    elif own and start > survey.max_sequence:
        metrics["notes"].append(f"the run's span starts at fragment {start} (its config.json), past the fragments "
                                f"it logged (0 to {survey.max_sequence}): nothing to score there; --from-fragment "
                                "chooses another")
    if torn_tail(log):
        metrics["notes"].append("the log's last line was cut short (a crash while it was written): left out, "
                                "as a resume of the run drops it")
    independent = _schedule_of(path) == "independent"
    # the manifest's total counts b x w byte windows, the batches of lstm-char only (streamer.learner's
    # _batch_limits: other tokenizers end with the records); a looped stream's is None, it has no end
    total = config.get("total_batches") if config.get("model_name") == "lstm-char" else None
    cut_short = independent and isinstance(total, int) and survey.count < total
    if seen < expected and not independent:
        metrics["notes"].insert(
            0,
            f"incomplete stream: {seen} of {expected} expected fragments were logged; the CALM "
            "code would report nothing, these metrics cover what was logged",
        )
    if independent:  # (its fragments' count said "incomplete" of every whole run)
        metrics["notes"].insert(0, "independent streams: each batch is scored as the fragment most of its rows are "
                                   "in, so its switches and CALM's metrics are approximate, and a fragment never in "
                                   "most rows is not logged")
        if cut_short:  # (its fragments cannot tell, its batches can: a run stopped early was called complete)
            metrics["notes"].insert(1, f"incomplete stream: {survey.count:,} of the stream's {total:,} batches "
                                       "were logged; these metrics cover what was logged")
    report = {
        "run": str(path),
        "config": config,
        "oracle": bool(config.get("oracle")),  # the strategy was told the class (independent)
        "span": {
            "from_fragment": start,
            "the_runs": own,  # the span the run was learned with (config.json), not one given
            "n_fragments_expected": expected,
            "n_fragments_seen": seen,
            "complete": not cut_short if independent else seen >= expected,  # (independent: by its batches)
        },
        "metrics": metrics,
        "whole_stream": whole.result(),
        "detection": detection.result(),
    }
    order = list(survey.classes)
    report.update(_probe_metrics(path, order, config))
    report.update(_classifier_metrics(path, order, accuracy.snapshot()))
    return report


def _classifier_metrics(path: Path, order: list[str], accuracy: dict | None) -> dict:
    """Classifier runs: prequential accuracy and macro-F1 from the loss log, DMI from the saved
    probe representations (None for language models, or when the run saved none)."""
    if accuracy is None:
        return {"accuracy": None, "dmi": None}
    from monitor.dmi import dmi_from_run  # scipy, only for classifier runs

    first_seen = [{"domain_name": name} for name in order]  # all dmi_from_run reads of the records
    return {"accuracy": accuracy, "dmi": dmi_from_run(path if path.is_dir() else path.parent, first_seen)}


def _probe_metrics(path: Path, order: list[str], config: Mapping) -> dict:
    """The forgetting family from the run's probes.jsonl, when the run scored a probe split."""
    probe_log = path / "probes.jsonl" if path.is_dir() else path.with_name("probes.jsonl")
    seen, accuracy, seconds, evaluations = set(), False, 0.0, 0  # a survey: the log is read twice, never held
    for row in probe_rows(probe_log) if probe_log.is_file() else ():
        seen.update(row["scores"])
        accuracy = accuracy or row.get("unit") == "accuracy"  # classifier probes: higher is better
        seconds, evaluations = seconds + row.get("seconds", 0.0), evaluations + 1
    if not evaluations:  # (an empty log, a run with no probe evaluation, reported as if probed: a bogus row)
        return {"forgetting": None, "probe_matrix": None}
    classes = order + sorted(seen - set(order))
    # a classifier run's end-of-run probe closes the last class's first fragment (its stage, as in DMI)
    rows = ({**row, "trigger": "switch"} if row.get("trigger") == "end" else row for row in probe_rows(probe_log))
    matrix = matrix_from_probe_log(rows, classes, higher_is_better=accuracy, probe_every=config.get("probe_every"))
    summary = forgetting_summary(matrix)
    summary["probe_seconds"] = round(seconds, 3)
    summary["probe_evaluations"] = evaluations
    return {"forgetting": summary,
            "probe_matrix": {"stages": list(matrix.stages), "classes": list(matrix.classes),
                             "values": matrix.values,
                             "unit": "held-out accuracy" if accuracy else "held-out loss (nats)"}}


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
    k: int | None = None,
    from_fragment: str | int | None = None,
) -> dict:
    """Build the report, write ``results.json`` and ``loss_curve.png`` into ``out_dir``
    (default: the run directory, or the loss log's directory) and return the report
    (`k` and `from_fragment` as in build_report)."""
    path = Path(path)
    curve, gates = LossCurve(), GateCurve()
    report = _report(path, read_config(path), k=k, from_fragment=from_fragment, curve=curve, gates=gates)
    out = Path(out_dir) if out_dir is not None else (path if path.is_dir() else path.parent)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(report), indent=2, allow_nan=False)
    replace_text(out / RESULTS_NAME, text + "\n")  # a stop mid-write leaves the last one whole
    curve.save(out / PLOT_NAME, title=_title(report))
    # mixtures log their expert weights (CALM Fig. 1d); a figure not drawn: an earlier run's in the same directory
    # is not this one's
    if not (gates.n or gates.problem) or gates.save(out / "gate_weights.png").path is None:
        (out / "gate_weights.png").unlink(missing_ok=True)
    matrix = report.get("probe_matrix")
    if not matrix or plot_probe_heatmap(matrix["values"], matrix["stages"], matrix["classes"], out / "probe_matrix.png",
                                        title=f"{matrix['unit']} per class after each stage: "
                                              f"{Path(report['run']).name}").path is None:
        (out / "probe_matrix.png").unlink(missing_ok=True)
    return report


def report_files(out_dir: str | os.PathLike) -> list[str]:
    """The files of the report written into `out_dir`: results.json and the figures it drew (write_report removes
    those of an earlier report there that it does not draw)."""
    out = Path(out_dir)
    return [name for name in (RESULTS_NAME, *FIGURE_NAMES) if (out / name).is_file()]
