"""Switch spikes as a Prometheus user sees them (issue 14), with time scaled down: a paced
run (fragments of about 3 s) scraped by a real Prometheus every second.

Through the Prometheus HTTP API: the dashboard's first time-series panel shows a spike at
nearly every revisit (one of its series rises by more than 10% within two scrapes after the
switch against the two scrapes before; a class's line that is not drawn just before the
switch is compared with the last value it showed), seldom far from a switch; the detected-
switch annotation query returns every detected switch; the perplexity of the whole run from
the loss and token counters agrees with `streamer report --from-fragment all`.

The functions here also serve the 5 s scrape figure outside the suite (same definitions).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from monitor.dashboard import annotation_queries, build_dashboard
from monitor.exporter import create_metrics, serve
from monitor.live import LiveMonitor
from producers.kafka import produce
from streamer.config import LearnConfig
from streamer.learner import run as run_learner
from tests.helpers import TINY, small_stream
from tests.prometheus_util import query, query_range, start_prometheus, stop

ROOT = Path(__file__).resolve().parents[1]
SCRAPE_S = 1.0
RISE = 1.10  # "rises by more than 10%"
K = 10  # the after-switch span (LiveMonitor's default k)
# three classes a tiny model forgets quickly: different alphabets, so every revisit spikes
CORPUS = {"en": "hello world, how are you today? " * 600, "digits": "31415 92653 58979 32384 62643 " * 600,
          "ru": "привет мир, как дела сегодня? " * 600}


def grafana_substitute(expr: str, scrape_s: float) -> str:
    """Grafana's variables as it fills them for 'All' at a step of one scrape:
    $__rate_interval = max($__interval + scrape interval, 4 x scrape interval)."""
    rate_interval = f"{round(4 * scrape_s)}s"
    return (expr.replace("$__rate_interval", rate_interval).replace("$__interval", f"{round(scrape_s)}s")
            .replace("$run", ".*").replace("$strategy", ".*"))


def first_timeseries_panel(dashboard: dict | None = None) -> dict:
    dashboard = dashboard if dashboard is not None else build_dashboard()
    return next(p for p in dashboard["panels"] if p["type"] == "timeseries")


def read_loss_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def switches(lines: list[dict]) -> list[dict]:
    """True switches of a loss log: {time, class, revisit, before_s, after_s} at each batch whose
    fragment changed; before_s and after_s are the durations of the fragments either side, spike the
    worst of the first K batches after it over the worst of the 5 before (the spike in the data)."""
    found, seen = [], set()
    for previous, line in zip([None, *lines], lines):
        if previous is not None and line["sequence"] != previous["sequence"]:
            i = len([x for x in lines if x["time"] < line["time"]])
            spike = max(x["loss"] for x in lines[i:i + K]) / max(x["loss"] for x in lines[max(0, i - 5):i])
            found.append({"time": line["time"], "class": line["domain_name"], "revisit": line["domain_name"] in seen,
                          "spike": spike})
        seen.add(line["domain_name"])
    edges = [lines[0]["time"]] + [s["time"] for s in found] + [lines[-1]["time"]]
    for i, switch in enumerate(found):
        switch["before_s"], switch["after_s"] = edges[i + 1] - edges[i], edges[i + 2] - edges[i + 1]
    return found


def panel_series(base: str, panel: dict, start: float, end: float, scrape_s: float) -> list[list[tuple[float, float]]]:
    """Every series of every target of `panel`, as [(eval time, value)], one step per scrape."""
    series = []
    for target in panel["targets"]:
        for result in query_range(base, grafana_substitute(target["expr"], scrape_s), start, end, scrape_s):
            series.append([(float(t), float(v)) for t, v in result["values"]])
    return series


def rises_at(series: list[list[tuple[float, float]]], at: float, scrape_s: float) -> bool:
    """Does one series rise by more than 10% within two scrapes after `at`, against the two scrapes
    before (or, where the line is not drawn then, against the last value it showed)?"""
    for points in series:
        before = [v for t, v in points if at - 2 * scrape_s <= t < at]
        if not before:
            earlier = [v for t, v in points if t < at]
            before = earlier[-1:]
        after = [v for t, v in points if at < t <= at + 2 * scrape_s]
        if before and after and max(after) > RISE * max(before):
            return True
    return False


def spike_figures(series, switch_list: list[dict], start: float, end: float, scrape_s: float) -> dict:
    """Share of revisits with a rise, and share of far-from-switch moments with one."""
    all_revisits = [s for s in switch_list if s["revisit"]]
    # the rule: fragments (the one left and the one entered) of at least three scrape intervals,
    # and a spike in the loss log itself (a revisit the model had not forgotten has none to show)
    revisits = [s for s in all_revisits if min(s["before_s"], s["after_s"]) >= 3 * scrape_s and s["spike"] > RISE]
    shown = [s for s in revisits if rises_at(series, s["time"], scrape_s)]
    shown_all = [s for s in all_revisits if rises_at(series, s["time"], scrape_s)]
    times = [s["time"] for s in switch_list]
    far = [start + i * scrape_s for i in range(int((end - start) / scrape_s))]
    margin = 3 * scrape_s  # three scrapes from any switch, beyond the two compared on either side
    far = [t for t in far if all(abs(t - s) > margin for s in times) and start + margin < t < end - margin]
    false = [t for t in far if rises_at(series, t, scrape_s)]
    return {"revisits": len(revisits), "shown": len(shown), "all_revisits": len(all_revisits),
            "shown_all": len(shown_all), "far_moments": len(far), "far_rises": len(false),
            "missed": [(round(s["time"] - start, 1), round(s["spike"], 2)) for s in revisits if s not in shown]}


def marker_times(base: str, expr: str, start: float, end: float, scrape_s: float) -> set[float]:
    """The distinct times (s) an annotation query on a last-switch gauge marks."""
    results = query_range(base, grafana_substitute(expr, scrape_s), start, end, scrape_s)
    return {round(float(v) / 1000, 3) for result in results for _, v in result["values"]}


def counters_perplexity(base: str, run: str) -> float:
    loss = float(query(base, f'sum(streamer_loss_nats_total{{run="{run}"}})')[0]["value"][1])
    tokens = float(query(base, f'sum(streamer_scored_tokens_total{{run="{run}"}})')[0]["value"][1])
    return float(__import__("math").exp(loss / tokens))


def report_perplexity(run_dir: Path) -> float:
    out = subprocess.run([sys.executable, "-m", "streamer.cli", "report", str(run_dir), "--json",
                          "--from-fragment", "all", "--out", str(run_dir / "report")],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    return json.loads(out.stdout)["ppl"]


class PacedMonitor(LiveMonitor):
    """Stretches each batch to about `seconds`, as a slower device would (fragments of ~3 s)."""

    seconds = 0.15

    def observe(self, result):
        time.sleep(self.seconds)
        return super().observe(result)


@pytest.mark.slow  # about 100 s, and it needs enough qualifying revisits in a paced run: kept out of the default suite
def test_every_revisit_spike_shows_at_a_one_second_scrape(broker, tmp_path, prometheus_binaries):
    # 14 fragments of 3 classes, 0.15 s a batch: fragments of 1 to 15 s
    # (seed 333: about 540 batches, 11 revisits, 4 or 5 of them spiking between fragments of 3 s or more)
    records, manifest = small_stream(CORPUS, fragments=14, mean_tokens=1100, streams=3, window=10, seed=333)
    asyncio.run(produce(records, broker.bootstrap_servers, "spikes"))
    metrics = create_metrics()
    server, _ = serve(metrics, 0)
    (tmp_path / "rules.yml").write_text((ROOT / "deploy/prometheus/rules.yml").read_text())
    config = f"""
global: {{scrape_interval: {SCRAPE_S:g}s, evaluation_interval: {SCRAPE_S:g}s}}
rule_files: [{tmp_path / 'rules.yml'}]
scrape_configs:
  - job_name: streamer
    static_configs: [{{targets: ["127.0.0.1:{server.server_address[1]}"]}}]
"""
    process, base = start_prometheus(config, tmp_path)
    try:
        learn_config = LearnConfig(
            bootstrap_servers=broker.bootstrap_servers, topic="spikes", group_id="spikes-g",
            run_dir=tmp_path / "run", run_name="spikes", streams=3, window=10, model=TINY, device="cpu",
            total_batches=manifest["total_batches"], classes=tuple(manifest["classes"]), idle_timeout_s=30)
        monitor = PacedMonitor(run="spikes", strategy="naive", classes=learn_config.classes, metrics=metrics)
        started = time.time()
        thread = threading.Thread(target=lambda: asyncio.run(run_learner(learn_config, monitor=monitor)))
        thread.start()
        thread.join(timeout=240)
        assert not thread.is_alive()
        time.sleep(3 * SCRAPE_S)  # the last batches scraped
        ended = time.time()

        lines = read_loss_log(tmp_path / "run" / "losses.jsonl")
        switch_list = switches(lines)
        series = panel_series(base, first_timeseries_panel(), started, ended, SCRAPE_S)
        figures = spike_figures(series, switch_list, started, ended, SCRAPE_S)
        print("spike figures (1 s scrape):", figures)
        assert figures["revisits"] >= 3
        assert figures["shown"] >= 0.9 * figures["revisits"], figures
        assert figures["far_rises"] <= 0.2 * max(figures["far_moments"], 1), figures

        # markers: every detected switch (loss log) is one value of the detected-switch annotation query
        queries = annotation_queries()
        detected = {line["time"] for line in lines if line["detected_switch"]}
        marked = marker_times(base, queries["Detected switches"], started, ended, SCRAPE_S)
        assert detected and all(any(abs(t - m) < 0.002 for m in marked) for t in detected), (detected, marked)
        true_marked = marker_times(base, queries["True switches"], started, ended, SCRAPE_S)
        assert all(any(abs(s["time"] - m) < 0.002 for m in true_marked) for s in switch_list)

        # the whole run's perplexity from the counters is the report's
        from_counters, from_report = counters_perplexity(base, "spikes"), report_perplexity(tmp_path / "run")
        print(f"perplexity: counters {from_counters:.4f}, report {from_report:.4f}")
        assert abs(from_counters / from_report - 1) < 0.01
    finally:
        stop(process)
        server.shutdown()
