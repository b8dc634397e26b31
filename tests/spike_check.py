"""Issue 14's check of switch spikes, as a Prometheus user sees them: one definition for the
suite (tests/test_spikes.py, time scaled down) and the measurement (benchmarks/spikes.py).

From a run's loss log: its true switches and revisits. Through the Prometheus HTTP API, with
Grafana's variables filled in as Grafana fills them: every series of the dashboard's first
time-series panel, one point per scrape. A switch "shows" when one of those series rises by more
than 10% within two scrapes after it, against the two scrapes before (a line not drawn just
before is compared with the last value it showed). The same rule at moments far from any
switch gives the false-rise share. Markers: the distinct values of the annotation queries.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from monitor.dashboard import build_dashboard
from tests.prometheus_util import query, query_range

__all__ = ["RISE", "K", "grafana_substitute", "first_timeseries_panel", "read_loss_log", "switches",
           "panel_series", "rises_at", "spike_figures", "marker_times", "counters_perplexity",
           "report_perplexity", "markers_cover", "alert_expression", "alert_figures", "ALERT_RATIO", "scrape_times"]

ROOT = Path(__file__).resolve().parents[1]
RISE = 1.10  # "rises by more than 10%"
K = 10  # the after-switch span (LiveMonitor's default k)


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
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def switches(lines: list[dict]) -> list[dict]:
    """True switches of a loss log: {time, class, revisit, spike, before_s, after_s, settled_s} at
    each batch whose fragment changed; spike is the worst of the first K batches after it over the
    worst of the 5 before (the spike in the data); before_s and after_s the durations of the
    fragments either side; settled_s how long the fragment left ran after its own first K batches
    (when batches are slow, its own spike fills the scrapes just before the switch)."""
    found, seen, starts = [], set(), [0]
    for i, line in enumerate(lines):
        if i and line["sequence"] != lines[i - 1]["sequence"]:
            spike = max(x["loss"] for x in lines[i:i + K]) / max(x["loss"] for x in lines[max(0, i - 5):i])
            found.append({"time": line["time"], "batch": line["batch"], "class": line["domain_name"],
                          "revisit": line["domain_name"] in seen,
                          "spike": spike, "head_mean": _mean(lines[i:i + K]),
                          "previous_mean": _previous_fragment_mean(lines, i)})
            starts.append(i)
        seen.add(line["domain_name"])
    edges = [lines[0]["time"]] + [s["time"] for s in found] + [lines[-1]["time"]]
    for i, switch in enumerate(found):
        switch["before_s"], switch["after_s"] = edges[i + 1] - edges[i], edges[i + 2] - edges[i + 1]
        head_end = lines[min(starts[i] + K, starts[i + 1] - 1)]["time"]
        switch["settled_s"] = switch["time"] - head_end
    return found


def _mean(lines: list[dict]) -> float:
    """Mean loss per token of these batches (what the loss counters give)."""
    return sum(x["loss"] * x["tokens"] for x in lines) / sum(x["tokens"] for x in lines)


def _previous_fragment_mean(lines: list[dict], i: int) -> float | None:
    """The mean loss of the latest earlier fragment of line i's class (CALM's rec reference, what
    streamer_previous_fragment_loss_nats holds at a revisit); None at a first visit."""
    cls, fragment = lines[i]["domain_name"], []
    for x in reversed(lines[:i]):
        if x["domain_name"] == cls:
            if fragment and x["sequence"] != fragment[-1]["sequence"]:
                break
            fragment.append(x)
        elif fragment:
            break
    return _mean(fragment) if fragment else None


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
            before = [v for t, v in points if t < at][-1:]
        after = [v for t, v in points if at < t <= at + 2 * scrape_s]
        if before and after and max(after) > RISE * max(before):
            return True
    return False


def spike_figures(series, switch_list: list[dict], start: float, end: float, scrape_s: float,
                  settled: bool = False) -> dict:
    """Share of revisits with a rise, and share of far-from-switch moments with one.

    `revisits` are the revisit switches whose fragments (the one left and the one entered) last
    at least three scrape intervals (the issue's rule), `all_revisits` every one; `spiking` those
    whose loss log itself spikes by more than 10%: the worst of the first K batches after the
    switch over the worst of the 5 before (a revisit the model had not forgotten has nothing to show).
    With `settled`, the fragment left must also run three scrape intervals after its own first K
    batches, so that the scrapes compared before the switch show its settled loss at any speed."""
    revisits = [s for s in switch_list if s["revisit"]]
    shown_all = [s for s in revisits if rises_at(series, s["time"], scrape_s)]
    long_enough = [s for s in revisits if min(s["before_s"], s["after_s"]) >= 3 * scrape_s
                   and (not settled or s["settled_s"] >= 3 * scrape_s)]
    spiking = [s for s in long_enough if s["spike"] > RISE]
    shown = [s for s in long_enough if s in shown_all]
    times = [s["time"] for s in switch_list]
    margin = 3 * scrape_s  # three scrapes from any switch, beyond the two compared on either side
    far = [start + i * scrape_s for i in range(int((end - start) / scrape_s))]
    far = [t for t in far if all(abs(t - s) > margin for s in times) and start + margin < t < end - margin]
    false = [t for t in far if rises_at(series, t, scrape_s)]
    return {"revisits": len(long_enough), "shown": len(shown), "spiking": len(spiking),
            "spiking_shown": len([s for s in spiking if s in shown]),
            "all_revisits": len(revisits), "all_shown": len(shown_all),
            "all_spiking": len([s for s in revisits if s["spike"] > RISE]),
            "all_spiking_shown": len([s for s in shown_all if s["spike"] > RISE]),
            "far_moments": len(far), "far_rises": len(false),
            "missed": [(round(s["time"] - start, 1), s["class"], round(s["spike"], 2),
                        round(s["before_s"], 1), round(s["after_s"], 1)) for s in revisits if s not in shown_all]}


def marker_times(base: str, expr: str, start: float, end: float, scrape_s: float) -> set[float]:
    """The distinct times (s) an annotation query marks (its values are Unix times in ms)."""
    results = query_range(base, grafana_substitute(expr, scrape_s), start, end, scrape_s)
    return {round(float(v) / 1000, 3) for result in results for _, v in result["values"]}


def markers_cover(events: list[float], marked: set[float], tolerance_s: float = 0.002) -> list[float]:
    """The events (Unix times) that no marker shows: empty when every one is marked."""
    return [t for t in events if not any(abs(t - m) < tolerance_s for m in marked)]


def counters_perplexity(base: str, run: str = ".*") -> float:
    """exp(summed loss / scored tokens) of the whole run, from the counters' last values (the
    learner may have exited, so its series are stale by now)."""
    def total(name: str) -> float:
        expr = f'sum(last_over_time(streamer_{name}{{run=~"{run}"}}[1d]))'
        return float(query(base, expr)[0]["value"][1])
    return math.exp(total("loss_nats_total") / total("scored_tokens_total"))


def report_perplexity(run_dir: Path) -> float:
    """`streamer report RUN --from-fragment all`'s overall ppl."""
    out = subprocess.run([sys.executable, "-m", "streamer.cli", "report", str(run_dir), "--json",
                          "--from-fragment", "all", "--out", str(Path(run_dir) / "report")],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=300)
    return json.loads(out.stdout)["ppl"]


def alert_expression(name: str, rules: Path = ROOT / "deploy/prometheus/rules.yml") -> str:
    """The PromQL of alert `name` in rules.yml (its folded `expr: >-` block or one-line expr)."""
    block = re.split(r"^\s*- alert:\s*", rules.read_text(encoding="utf-8"), flags=re.MULTILINE)
    body = next(b for b in block if b.startswith(name + "\n"))
    match = re.search(r"^\s*expr:\s*(>-\n((?:\s{10,}.*\n)+)|(.+)\n)", body, flags=re.MULTILINE)
    return " ".join(line.strip() for line in match.group(2).splitlines()) if match.group(2) else match.group(3)


def scrape_times(base: str, start: float, end: float) -> list[tuple[float, float]]:
    """(scrape time, batches learned then) of every scrape of the run, from the raw samples of
    streamer_batches_learned_total (a range vector: its samples carry their scrape timestamps)."""
    window = max(60, int(end - start) + 60)
    results = query(base, f"streamer_batches_learned_total[{window}s]", at=end)
    return sorted((float(t), float(v)) for result in results for t, v in result["values"])


# StreamerSwitchSpike's threshold over the class's previous fragment, as rules.yml says it
ALERT_RATIO = float(re.search(r">\s*([\d.]+)\s*\*\s*streamer_previous_fragment_loss_nats",
                              alert_expression("StreamerSwitchSpike")).group(1))


def alert_figures(base: str, switch_list: list[dict], start: float, end: float, scrape_s: float,
                  alert: str = "StreamerSwitchSpike", span_s: float = 60) -> dict:
    """Where `alert` (of rules.yml as it is now, evaluated at every scrape: it has no `for`) fires:
    at how many revisits (a firing of the revisited class within `span_s` plus a scrape after the
    switch), how soon after, and at how many evaluations away from any revisit."""
    results = query_range(base, alert_expression(alert), start, end, scrape_s)
    firings = [(float(t), result["metric"].get("class")) for result in results for t, _ in result["values"]]
    revisits = [s for s in switch_list if s["revisit"]]

    def revisit_of(t: float, cls: str) -> dict | None:
        """The latest switch into `cls` before t, if it is a revisit less than span_s ago."""
        latest = [s for s in switch_list if s["class"] == cls and s["time"] < t][-1:]
        return latest[0] if latest and latest[0]["revisit"] and t <= latest[0]["time"] + span_s + scrape_s else None
    first: dict[float, float] = {}
    for t, cls in sorted(firings):
        s = revisit_of(t, cls)
        if s is not None:
            first.setdefault(s["time"], t - s["time"])
    delays = list(first.values())
    stray = [t for t, cls in firings if revisit_of(t, cls) is None]
    due = [s for s in revisits if s["head_mean"] > ALERT_RATIO * s["previous_mean"]]
    # how long after the first scrape that holds the revisit's first batch (the rule cannot see it before)
    scraped = scrape_times(base, start, end)
    after_scrape = []
    for s in revisits:
        holding = next((t for t, learned in scraped if learned > s["batch"]), None)
        fired = [t for t, cls in firings if cls == s["class"] and holding is not None
                 and holding <= t <= s["time"] + span_s + scrape_s]
        if fired:
            after_scrape.append(min(fired) - holding)
    return {"alert_revisits": len(revisits), "alert_fired": len(delays),
            "alert_due": len(due), "alert_due_fired": len([s for s in due if s["time"] in first]),
            "alert_after_scrape_s": (round(min(after_scrape), 1), round(max(after_scrape), 1)) if after_scrape else None,
            "alert_delay_s": (round(min(delays)), round(max(delays))) if delays else None,
            "alert_stray_evaluations": len(stray)}
