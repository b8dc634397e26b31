"""`streamer report`, and the summary and CALM tables printed at the end of every run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from monitor.calm import format_table
from streamer.cli.errors import UserError
from streamer.cli.flags import SPAN_DEFAULT, add_span_flag, default_of, positive_int
from streamer.config import LearnConfig, RunSummary

__all__ = ["accuracy_line", "add_parser", "run", "print_run_report", "summary_line"]


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="metrics, results.json and plots from run directories or loss logs")
    p.add_argument("paths", nargs="+", type=Path, help="run directories or losses.jsonl files")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of tables: one path's report (results.json's, its metrics at the top "
                        "level); several paths' comparison (comparison.json), one object")
    p.add_argument("--out", type=Path, help="write results.json and loss_curve.png here (default: beside the log, "
                                            "in its run directory; with several paths, report/ in their common "
                                            "parent directory, e.g. runs/report)")
    add_span_flag(p, "the span the tables score", the_runs=True)
    p.add_argument("-k", type=positive_int,
                   help="batches after a switch for ppl@sw (default: the run's, from its config.json; "
                        f"{default_of(LearnConfig, 'k')} for a log without one)")


def summary_line(summary: RunSummary) -> str:
    """One line: batches and tokens (this start's; a resumed run's total beside them), compute time (and
    its tokens/s) apart from waiting (for the topic, joining the group, idle, broker lost), the stop reason,
    dead letters, updates skipped and the probes' share of wall time."""
    wall = max(summary.seconds, 1e-9)
    if summary.compute_seconds is None:  # not measured: the wall-clock rate
        timing = f"in {summary.seconds:.1f}s ({summary.tokens / wall:,.0f} tokens/s)"
    else:
        compute = summary.compute_seconds
        causes = [(name, seconds) for name, seconds in (
            ("for the topic", summary.topic_missing_seconds), ("joining the group", summary.joining_seconds),
            ("idle", summary.idle_seconds), ("broker lost", summary.broker_lost_seconds)) if seconds >= 0.05]
        waiting = sum(seconds for _, seconds in causes)
        other = max(0.0, summary.seconds - compute - waiting)
        timing = (f"in {summary.seconds:.1f}s: {compute:.1f}s computing "
                  f"({summary.tokens / max(compute, 1e-9):,.0f} tokens/s), {waiting:.1f}s waiting"
                  + (f" ({', '.join(f'{name} {seconds:.1f}s' for name, seconds in causes)})" if causes else "")
                  + f", {other:.1f}s starting and stopping")
    resumed = (f" ({summary.batches_before + summary.batches} in all, resumed at {summary.batches_before})"
               if summary.batches_before else "")
    return (f"{summary.batches} batches{resumed}, {summary.tokens} tokens {timing}; stopped: {summary.stop_reason}"
            + (f"; dead letters {summary.dead_letters}" if summary.dead_letters else "")
            + (f"; {summary.skipped} of its updates skipped (a non-finite loss or gradients: nothing learned from "
               "those batches)" if summary.skipped else "")
            + (f"; {summary.probes} probe evaluations took {summary.probe_seconds:.1f}s "
               f"({summary.probe_seconds / wall:.0%} of wall)" if summary.probes else ""))


def span_title(span: dict, spec=None) -> str:
    """Which fragments a table scored, in words: 'fragments >= 20 of 40 (the paper's span: N/2)'."""
    start, expected = span["from_fragment"], span["n_fragments_expected"]
    why = ("the whole stream" if start == 0 else "the paper's span: N/2" if start == expected // 2
           else "the run's span, from its config.json" if span.get("the_runs") else "--from-fragment")
    return f"fragments >= {start} of {expected} ({why}" + (f"; --from-fragment {spec})" if spec is not None else ")")


def detection_line(report: dict) -> str | None:
    """The drift detector against the true switches, in one line (None without a detector's results)."""
    from monitor.detection import NO_DETECTOR

    if (report.get("detection") or {}).get("source") == NO_DETECTOR:
        return "drift detector: off (--detector none)"
    found = (report.get("detection") or {}).get("evaluation") or {}
    if not found.get("n_true") and not found.get("n_detected"):
        return None
    def number(value, digits=2):
        return "n/a" if value is None else f"{value:.{digits}f}"
    return (f"drift detector: found {found['true_positives']} of {found['n_true']} switches within "
            f"{found['tolerance']} batches, {found['n_false_alarms']} false alarms (precision "
            f"{number(found['precision'])}, recall {number(found['recall'])}, mean delay "
            f"{number(found['mean_delay_batches'], 1)} batches)")


def accuracy_line(report: dict) -> str | None:
    """A classifier run's prequential accuracy and macro-F1 (and DMI when it saved probe features) in one
    line; None for a language model's run."""
    found = report.get("accuracy")
    if not found or found.get("accuracy") is None:
        return None
    line = (f"classifier: prequential accuracy {found['accuracy']:.3f}, macro-F1 {found['macro_f1']:.3f} over "
            f"{found['utterances']:,} utterances")
    dmi = report.get("dmi") or {}
    scores = [(name, dmi.get(name)) for name in ("stability", "plasticity", "generalizability")]
    if all(value is not None for _, value in scores):
        line += "; DMI " + ", ".join(f"{name} {value:.3f}" for name, value in scores)
    return line


# A stop by a signal (systemd's or docker's, Ctrl-C) writes the report only of a loss log this large: the report reads
# the whole log (about 10 MB/s on 2 cores), and a daemon's grows to 2 GB; systemd kills a stop after TimeoutStopSec
# (20 s in deploy/systemd), docker after 10 s. 43.5 s from SIGTERM to exit with a 280 MB log: killed, marked failed.
SIGNAL_REPORT_BYTES = 32 * 2**20


def print_run_report(summary: RunSummary, from_fragment: int | str = SPAN_DEFAULT) -> dict | None:
    """The run's one-line summary, its report written over the run's span, and CALM's metrics printed; after a
    stop by a signal with a loss log over SIGNAL_REPORT_BYTES, a line that leaves the report to `streamer
    report` instead (None)."""
    from monitor.losslog import loss_log_files
    from monitor.report import report_files, write_report  # river and scipy: loaded by the commands that report

    print(summary_line(summary))
    if summary.stop_reason == "signal" and (size := sum(
            file.stat().st_size for file in loss_log_files(summary.run_dir / "losses.jsonl") if file.exists())
    ) > SIGNAL_REPORT_BYTES:
        print(f"report not written at this stop: the loss log holds {size / 2**20:,.0f} MB, and a stop by a signal "
              f"reads at most {SIGNAL_REPORT_BYTES // 2**20} MB of it, to stay within the stop timeouts of systemd and "
              f"docker; `streamer report {summary.run_dir}` writes it (the checkpoint is written)")
        return None
    report = write_report(summary.run_dir, from_fragment=from_fragment)
    print(f"\nCALM metrics over {span_title(report['span'])}:\n")
    print(format_table(report["metrics"]))
    if report["span"]["from_fragment"]:
        print("\nWhole stream (fragments >= 0):\n")
        print(format_table(report["whole_stream"]))
    for line in (accuracy_line(report), detection_line(report)):
        if line:
            print(f"\n{line}")
    print(f"run directory: {summary.run_dir} (losses.jsonl, {', '.join(report_files(summary.run_dir))}, checkpoint.pt)")
    return report


def run(args) -> int:
    for path in args.paths:
        if not path.exists():
            raise UserError(f"{path} does not exist (give a run directory or a losses.jsonl file)")
        if path.is_dir() and not (path / "losses.jsonl").is_file():
            runs = sorted(log.parent.name for log in path.glob("*/losses.jsonl"))
            if runs:  # a comparison's --out: its runs are its folders
                raise UserError(f"{path} has no losses.jsonl, but {len(runs)} of its folders do: give those "
                                f"(e.g. {path / runs[0]})")
            raise UserError(f"{path} has no losses.jsonl (not a run directory, or its run has written no loss log: "
                            "a learner before its first batch, compare's multitask before its end)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file; give a directory")
    if len(args.paths) > 1:
        return _several(args)
    from monitor.files import json_safe
    from monitor.report import report_files, write_report  # river and scipy: after the paths are checked
    path = args.paths[0]
    try:
        report = write_report(path, args.out, k=args.k, from_fragment=args.from_fragment)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json_safe({**report["metrics"], **{key: report.get(key) for key in (
            "span", "run", "whole_stream", "detection", "forgetting", "probe_matrix", "accuracy", "dmi", "oracle",
            "config")}}), default=str))
    else:
        print(f"## {path}\n\nCALM metrics over {span_title(report['span'], args.from_fragment)}:\n")
        print(format_table(report["metrics"]))
        for line in (accuracy_line(report), detection_line(report)):
            if line:
                print(f"\n{line}")
        written = args.out or (path if path.is_dir() else path.parent)
        print(f"\nwritten to {written}: {', '.join(report_files(written))}")  # (it named two, whatever it drew)
    return 0


def _common_parent(paths: list[Path]) -> Path:
    """The deepest directory holding every run (a log file's run is its directory)."""
    runs = [(path if path.is_dir() else path.parent).resolve().parent for path in paths]
    common = runs[0]
    while not all(run == common or common in run.parents for run in runs):
        common = common.parent
    return common


def _run_names(paths: list[Path]) -> list[str]:
    """Each run's folder name under the report: its directory's name, with -2, -3, ... for a name taken
    (A/naive-seed0 and B/naive-seed0 wrote one folder, the second report over the first)."""
    from monitor.compare import unique_name

    used: set[str] = set()
    return [unique_name((path if path.is_dir() else path.parent).resolve().name, used) for path in paths]


def _shared_k_and_span(args) -> tuple[int | None, str | int | None]:
    """k and span for several runs: the flags', else the runs' own (None) where they all agree, else CALM's 10
    and the paper's 'half', said in one line (a Table 1 row averaged ppl@sw over runs of other k's, unsaid)."""
    from monitor.report import DEFAULT_K, DEFAULT_SPAN, read_config

    configs = [read_config(path) for path in args.paths]
    k, span = args.k, args.from_fragment
    if k is None and len({config.get("k") for config in configs}) > 1:
        k = DEFAULT_K
        print(f"the runs were learned with different k; all scored with -k {k} (give -k to choose)", file=sys.stderr)
    if span is None and len({config.get("from_fragment") for config in configs}) > 1:
        span = DEFAULT_SPAN
        print(f"the runs were learned over different spans; all scored from fragment '{span}' (give "
              "--from-fragment to choose)", file=sys.stderr)
    return k, span


def _several(args) -> int:
    """Several runs: per-run reports in <out>/<run>/, then Table 1, the forgetting table and figures."""
    from monitor.compare import load_runs, write_comparison
    from monitor.files import json_safe
    from monitor.report import write_report

    out = args.out or _common_parent(args.paths) / "report"
    k, from_fragment = _shared_k_and_span(args)
    try:
        for path, name in zip(args.paths, _run_names(args.paths)):
            write_report(path, out / name, k=k, from_fragment=from_fragment)
        comparison = write_comparison(load_runs(args.paths, k=k, from_fragment=from_fragment), out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json_safe(comparison), default=str))
        return 0
    print((out / "table1.md").read_text())
    print((out / "forgetting.md").read_text())
    for name, reason in comparison.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    print(f"written to {out}: {', '.join(comparison['files'])} and one folder per run")  # (the figures drawn)
    return 0
