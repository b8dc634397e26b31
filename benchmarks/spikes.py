"""Switch spikes as a Prometheus user sees them (issue 14's "How it will be checked"), end to end.

An embedded broker; `streamer produce` paced at --token-rate (fragments of lambda / token-rate
seconds on average); `streamer learn --manifest --metrics-port`; Debian's prometheus scraping
the learner at --scrape seconds with deploy/prometheus/rules.yml, from a config generated in a
temporary directory. After the run, every query of the dashboard is evaluated through the
Prometheus HTTP API (tests/spike_check.py holds the definitions the suite uses too) and the
figures are printed: revisits the first time-series panel shows, false rises far from any
switch, detected and true switches the annotation queries return, panels without data, and
the whole run's perplexity from the counters against `streamer report --from-fragment all`.

    nice .venv/bin/python benchmarks/spikes.py --scrape 5 --fragments 26 --lambda 8000 --token-rate 500
    nice .venv/bin/python benchmarks/spikes.py --scrape 15 --fragments 24 --lambda 24000 --token-rate 500

With --keep the work directory stays (logs, run directory, TSDB); --evaluate DIR evaluates the
dashboard of now on it again, without a new run. SIGTERM or Ctrl-C ends it with Prometheus, the
producer, the learner and the broker, its work directory removed (benchmarks.command.ended_by_signals).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = 8  # evaluation grids, a scrape / PHASES apart
sys.path.insert(0, str(ROOT))

from benchmarks.command import ended_by_signals, seconds  # noqa: E402
from monitor.dashboard import annotation_queries, build_dashboard, panel_queries  # noqa: E402
from streamer.broker import EmbeddedBroker, die_with_parent  # noqa: E402
from streamer.cli.flags import Parser, positive_float, positive_int  # noqa: E402
from tests.prometheus_util import query_range, start_prometheus, stop  # noqa: E402
from tests.spike_check import (  # noqa: E402
    ALERT_RATIO, K, alert_figures, counters_perplexity, first_timeseries_panel, grafana_substitute, markers_cover, marker_times, panel_series,
    read_loss_log, report_perplexity, spike_figures, switches)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def streamer(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "streamer", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=die_with_parent(os.getpid()))  # killed with this process


def wait_for(path: Path, process: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"producer ended without a manifest:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


def run(args: argparse.Namespace, work: Path) -> dict:
    """One paced run scraped by Prometheus; returns what the evaluation needs."""
    manifest, run_dir, port = work / "stream.manifest.json", work / "run", free_port()
    (work / "rules.yml").write_text((ROOT / "deploy/prometheus/rules.yml").read_text())
    config = f"""
global: {{scrape_interval: {args.scrape:g}s, evaluation_interval: {args.scrape:g}s}}
rule_files: [{work / 'rules.yml'}]
scrape_configs:
  - job_name: streamer
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""
    started_here: list[subprocess.Popen] = []
    with EmbeddedBroker() as broker:
        prometheus, base = start_prometheus(config, work)
        try:
            producer = streamer("produce", "--bootstrap-servers", broker.bootstrap_servers, "--topic", "spikes",
                                "--corpus", args.corpus, "--fragments", str(args.fragments),
                                "--lambda", str(args.mean_tokens), "--token-rate", str(args.token_rate),
                                "--seed", str(args.seed), "--manifest", str(manifest), log=work / "producer.log")
            started_here.append(producer)
            wait_for(manifest, producer, work / "producer.log")
            started = time.time()
            learner = streamer("learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", "spikes",
                               "--manifest", str(manifest), "--run-dir", str(run_dir), "--fresh", "--no-view",
                               "--metrics-port", str(port), "--idle-timeout", str(10 + 3 * args.scrape),
                               "--seed", str(args.seed), *args.learn, log=work / "learner.log")
            started_here.append(learner)
            # the learner stops at the manifest's last batch (the idle timeout only if records go
            # missing); its exporter waits for one more scrape, so the counters hold every batch
            producer.wait()
            learner.wait()
            time.sleep(2 * args.scrape)  # stale markers and a last rule evaluation
            ended = time.time()
            if producer.returncode or learner.returncode:
                raise SystemExit(f"producer {producer.returncode}, learner {learner.returncode}; logs in {work}")
            (work / "times.json").write_text(json.dumps({"start": started, "end": ended, "scrape": args.scrape}))
            return evaluate(base, run_dir, started, ended, args.scrape)
        finally:  # (a signal: the producer and the learner end while the broker is still there)
            for process in started_here:
                stop(process)
            stop(prometheus)


def reevaluate(work: Path) -> tuple[dict, float]:
    """Evaluate the dashboard of now on a kept run's TSDB (a Prometheus that scrapes nothing)."""
    times = json.loads((work / "times.json").read_text())
    config = f"global: {{evaluation_interval: {times['scrape']:g}s}}\n"
    prometheus, base = start_prometheus(config, work)  # its tsdb/ and a config without targets
    try:
        return evaluate(base, work / "run", times["start"], times["end"], times["scrape"]), times["scrape"]
    finally:
        stop(prometheus)


def evaluate(base: str, run_dir: Path, start: float, end: float, scrape_s: float) -> dict:
    lines = read_loss_log(run_dir / "losses.jsonl")
    switch_list = switches(lines)
    series = panel_series(base, first_timeseries_panel(), start, end, scrape_s)
    figures = spike_figures(series, switch_list, start, end, scrape_s)
    # where the evaluation grid falls against the scrapes decides a close call either way: the same
    # figures on PHASES grids shifted by a fraction of a scrape, summed
    shifted = [start + i * scrape_s / PHASES for i in range(PHASES)]
    phased = [spike_figures(panel_series(base, first_timeseries_panel(), at, end, scrape_s), switch_list, at, end, scrape_s)
              for at in shifted]
    figures["phased"] = {key: sum(f[key] for f in phased)
                         for key in ("all_shown", "all_revisits", "all_spiking_shown", "all_spiking", "far_rises", "far_moments")}
    queries = annotation_queries()
    detected = [line["time"] for line in lines if line.get("detected_switch")]
    figures["detected"] = len(detected)
    figures["detected_unmarked"] = len(markers_cover(detected, marker_times(base, queries["Detected switches"], start, end, scrape_s)))
    figures["true"] = len(switch_list)
    figures["true_unmarked"] = len(markers_cover([s["time"] for s in switch_list],
                                                 marker_times(base, queries["True switches"], start, end, scrape_s)))
    figures["empty_panels"] = [f"{title}: {expr}" for title, expr, optional in panel_queries(build_dashboard())
                               if not optional and not query_range(base, grafana_substitute(expr, scrape_s), start, end, scrape_s)]
    # why a CALM panel can be empty (a short run: no revisit in the span): the run's own notes
    figures["run_notes"] = json.loads((run_dir / "results.json").read_text())["metrics"]["notes"]
    figures["ppl_counters"], figures["ppl_report"] = counters_perplexity(base), report_perplexity(run_dir)
    figures.update(alert_figures(base, switch_list, start, end, scrape_s))
    figures["batches"], figures["seconds"] = len(lines), round(end - start)
    figures["fragment_s"] = [round(s["after_s"], 1) for s in switch_list]
    return figures


def share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({part / max(1, whole):.0%})"


def show(figures: dict, scrape: float) -> None:
    far = figures["far_rises"] / max(1, figures["far_moments"])
    ratio = figures["ppl_counters"] / figures["ppl_report"] - 1
    lengths = sorted(figures["fragment_s"])
    print(f"scrape {scrape:g} s, {figures['batches']} batches in {figures['seconds']} s, fragments "
          f"{lengths[0]:.0f} to {lengths[-1]:.0f} s (median {lengths[len(lengths) // 2]:.0f} s)")
    print(f"revisits the top panel shows: {share(figures['all_shown'], figures['all_revisits'])}; "
          f"of those whose loss log spikes >10%: {share(figures['all_spiking_shown'], figures['all_spiking'])}")
    print(f"  between fragments of 3 scrapes or more: {share(figures['shown'], figures['revisits'])}; "
          f"of those whose loss log spikes >10%: {share(figures['spiking_shown'], figures['spiking'])}")
    print(f"rises far from any switch: {figures['far_rises']}/{figures['far_moments']} ({far:.0%})")
    phased = figures["phased"]
    print(f"on {PHASES} evaluation grids 1/{PHASES} scrape apart: revisits shown "
          f"{share(phased['all_shown'], phased['all_revisits'])}, of those whose loss log spikes >10% "
          f"{share(phased['all_spiking_shown'], phased['all_spiking'])}; far rises {share(phased['far_rises'], phased['far_moments'])}")
    print(f"detected switches without a marker: {figures['detected_unmarked']}/{figures['detected']}; "
          f"true switches without a marker: {figures['true_unmarked']}/{figures['true']}")
    print(f"StreamerSwitchSpike fired at {share(figures['alert_fired'], figures['alert_revisits'])} revisits "
          f"(first firing {figures['alert_delay_s']} s after the switch, {figures['alert_after_scrape_s']} s after "
          f"the first scrape holding its first batch), and at "
          f"{figures['alert_stray_evaluations']} evaluations away from any; at "
          f"{share(figures['alert_due_fired'], figures['alert_due'])} of the revisits whose first {K} batches average "
          f"over {ALERT_RATIO:g}x the class's previous fragment in the loss log (its rule)")
    print("panels without data:" + ("" if figures["empty_panels"] else " none"))
    for target in figures["empty_panels"]:
        print(f"  {target}")
    if figures["empty_panels"] and figures["run_notes"]:
        print("  the run's CALM notes (a metric without data there has no series):", *figures["run_notes"],
              sep="\n    ")
    print(f"perplexity: counters {figures['ppl_counters']:.4f}, report {figures['ppl_report']:.4f} ({ratio:+.3%})")
    if figures["missed"]:
        print("missed revisits (s into the run, class, spike in the loss log, fragment before and after, s):",
              figures["missed"])


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrape", type=seconds, default=5.0,
                        help="Prometheus scrape and rule interval, s (default 5)")
    parser.add_argument("--fragments", type=positive_int, default=24, help="fragments of the stream (default 24)")
    parser.add_argument("--lambda", dest="mean_tokens", type=positive_int, default=8000,
                        help="mean fragment, bytes (default 8000)")
    parser.add_argument("--token-rate", type=positive_float, default=500, help="producer pace, bytes/s (default 500)")
    parser.add_argument("--corpus", default="calm-multilingual")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run, TSDB)")
    parser.add_argument("--evaluate", type=Path, metavar="DIR",
                        help="evaluate the current dashboard on a directory kept by --keep, without a new run")
    parser.add_argument("learn", nargs="*", help="extra `streamer learn` flags, after --")
    args = parser.parse_args()
    with ended_by_signals("spikes"):
        measure(args)


def measure(args) -> None:
    if args.evaluate:
        figures, scrape = reevaluate(args.evaluate)
        show(figures, scrape)
        return
    work = Path(tempfile.mkdtemp(prefix="streamer-spikes-"))
    try:
        show(run(args, work), args.scrape)
    finally:
        if args.keep:
            print(f"work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
