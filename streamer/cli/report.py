"""`streamer report`, and the summary and CALM tables printed at the end of every run."""

from __future__ import annotations

import json
from pathlib import Path

from monitor.calm import format_table
from monitor.report import json_safe, write_report
from streamer.cli.errors import UserError
from streamer.cli.flags import default_of, positive_int, span
from streamer.config import LearnConfig, RunSummary

__all__ = ["add_parser", "run", "print_run_report"]


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="metrics, results.json and plots from run directories or loss logs")
    p.add_argument("paths", nargs="+", type=Path, help="run directories or losses.jsonl files")
    p.add_argument("--json", action="store_true", help="print one JSON object per path")
    p.add_argument("--out", type=Path, help="write results.json and loss_curve.png here (default: beside each log; "
                                            "with several paths, ./report)")
    p.add_argument("--from-fragment", type=span, default="half",
                   help="'half' (default: the paper's N/2), 'all' or a fragment index")
    p.add_argument("-k", type=positive_int, default=default_of(LearnConfig, "k"),
                   help="batches after a switch for ppl@sw (default %(default)s)")


def print_run_report(summary: RunSummary) -> dict:
    """The run's one-line summary, its report written, and CALM's metrics printed."""
    print(f"{summary.batches} batches, {summary.tokens} tokens in {summary.seconds:.1f}s "
          f"({summary.tokens / max(summary.seconds, 1e-9):,.0f} tokens/s); stopped: {summary.stop_reason}"
          + (f"; dead letters {summary.dead_letters}" if summary.dead_letters else "")
          + (f"; {summary.probes} probe evaluations took {summary.probe_seconds:.1f}s" if summary.probes else ""))
    report = write_report(summary.run_dir)
    span_of = report["span"]
    print(f"\nCALM metrics over the paper's span (fragments >= {span_of['from_fragment']} "
          f"of {span_of['n_fragments_expected']}):\n")
    print(format_table(report["metrics"]))
    print("\nWhole stream (fragments >= 0):\n")
    print(format_table(report["whole_stream"]))
    print(f"run directory: {summary.run_dir} (losses.jsonl, results.json, loss_curve.png, checkpoint.pt)")
    return report


def run(args) -> int:
    for path in args.paths:
        if not path.exists():
            raise UserError(f"{path} does not exist (give a run directory or a losses.jsonl file)")
    if len(args.paths) > 1:
        return _several(args)
    path = args.paths[0]
    try:
        report = write_report(path, args.out, k=args.k, from_fragment=args.from_fragment)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json_safe({**report["metrics"], **{key: report.get(key) for key in (
            "span", "run", "whole_stream", "detection", "forgetting", "probe_matrix", "config")}}), default=str))
    else:
        print(f"## {path}\n")
        print(format_table(report["metrics"]))
    return 0


def _several(args) -> int:
    """Several runs: per-run reports in <out>/<run>/, then Table 1, the forgetting table and figures."""
    from monitor.compare import load_runs, write_comparison

    out = args.out or Path("report")
    try:
        for path in args.paths:
            write_report(path, out / path.name, k=args.k, from_fragment=args.from_fragment)
        comparison = write_comparison(load_runs(args.paths, k=args.k, from_fragment=args.from_fragment), out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json_safe(comparison), default=str))
        return 0
    print((out / "table1.md").read_text())
    print((out / "forgetting.md").read_text())
    for name, reason in comparison.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    print(f"written to {out}: table1.md, forgetting.md, after_switch.png, comparison.json and one folder per run")
    return 0
