"""The Grafana dashboard of streamer, as code, and the `streamer monitor` subcommand.

The dashboard is built from plain Python dicts rather than grafana-foundation-sdk. The
SDK installs from PyPI (pure Python, no dependencies), one build per Grafana schema with
the build time as a version epoch: a bare `pip install grafana-foundation-sdk` picks the
newest epoch, a build of Grafana 10.1's schema, and matching the stack's Grafana 11.1
takes a pin such as `grafana-foundation-sdk==1769699681!11.1.0`, renewed with every
Grafana upgrade. For a dozen panels that is one more dependency and schema to track, and
its typed builders have no room for the panel key the checks read (`streamer_optional`);
the JSON written here is small and diffs well in review. `build_dashboard()` is the single source; deploy/grafana/dashboards/streamer.json
is its output, committed so Grafana's file provisioning can load it, and a test
fails when the two differ (`streamer monitor dashboard` regenerates the file).

Every query filters on the `run` and `strategy` template variables. The top row shows
each switch at a glance: the worst batch and the mean loss of each class and of all
classes between the last two scrapes (from the batch-loss histogram and the loss and
token counters, so no batch is missed between scrapes) beside the class's steady loss, and
each class's mean over the run's mean loss in the last minute (a ratio, detrended); a
class without batches since the previous scrape draws nothing. Switch markers are
Prometheus annotation queries on the last-switch gauges (true switches white,
detected ones red): no extra process, no credentials. Panels whose
metric exists only in some runs (forgetting needs probe sets, GPU memory a GPU)
carry ``"streamer_optional": true`` so checks against a CPU run without probes
can skip them.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "DASHBOARD_UID", "DEFAULT_PATH", "PROMETHEUS_UID", "build_dashboard", "annotation_queries",
    "panel_queries", "render_dashboard", "switch_marker_query", "write_dashboard",
]

DASHBOARD_UID = "streamer"
# the checkout's (monitor/ beside deploy/), wherever the command runs: from another folder it wrote a
# new deploy/ tree there, and --check said the committed file was missing
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "streamer.json"
PROMETHEUS_UID = "prometheus"  # deploy/grafana/provisioning/datasources/prometheus.yml
PROMETHEUS = {"type": "prometheus", "uid": PROMETHEUS_UID}
GRAFANA_ANNOTATIONS = {"type": "grafana", "uid": "-- Grafana --"}  # the built-in "Annotations & Alerts" source
FILTER = 'run=~"$run", strategy=~"$strategy"'
RATE = "[$__rate_interval]"
# units Grafana shows on axes and tooltips ("suffix:" is its custom-unit form)
NATS, BATCHES, PPL, RECORDS, SWITCHES = "suffix: nats", "suffix: batches", "suffix: ppl", "suffix: records", "suffix: switches"
STREAMS = "suffix: streams"
TOKENS_PER_S, BATCHES_PER_S = "suffix: tokens/s", "suffix: batches/s"
RATIO = "suffix: x"  # a loss over another loss


def _m(name: str, extra: str = "") -> str:
    """A selector of `name` filtered by the run and strategy variables (plus `extra` matchers)."""
    return f"streamer_{name}{{{FILTER}{', ' + extra if extra else ''}}}"


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": PROMETHEUS, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(kind: str, title: str, targets: list[tuple[str, str]], *, unit: str,
           description: str = "", optional: bool = False, width: int = 12, height: int = 8,
           units: dict | None = None, **options) -> dict:
    """`unit` for every target, `units` {refId: unit} for the targets that differ."""
    overrides = [{"matcher": {"id": "byFrameRefID", "options": ref},
                  "properties": [{"id": "unit", "value": value}]} for ref, value in (units or {}).items()]
    panel = {
        "type": kind, "title": title, "description": description, "datasource": PROMETHEUS,
        "targets": [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": overrides},
        "gridPos": {"w": width, "h": height},
        "options": options or {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                               "tooltip": {"mode": "multi", "sort": "none"}},
    }
    if optional:
        panel["streamer_optional"] = True
    return panel


def _stat_options() -> dict:
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "value_and_name", "colorMode": "value", "graphMode": "none", "orientation": "auto"}


def _bar_options() -> dict:
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True}


def _row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def _latency(metric: str, quantile: float) -> str:
    return (f"histogram_quantile({quantile}, sum by (le, run, strategy) "
            f"(rate({_m(metric + '_bucket')}{RATE})))")


def worst_batch(by: str) -> str:
    """The worst batch between the last two scrapes (99th percentile of the batch-loss histogram's
    irate), nats. irate, not rate: a window of $__rate_interval (4 scrapes) would still hold the
    previous switch's spike when fragments last 3 scrapes. NaN (no batch since the previous
    scrape) is dropped by `>= 0`, so an inactive class draws no line."""
    return (f"histogram_quantile(0.99, sum by (le, {by}) (irate({_m('batch_loss_nats_bucket')}{RATE}))) >= 0")


def window_loss(phase: str | None, by: str = "run, strategy, class", over: str = "increase") -> str:
    """Mean loss per token, nats, from the counters (exact at any scrape interval): of the batches
    of `phase` (None: every batch) over the window (`over="increase"`), or between the last two
    scrapes (`over="irate"`). A class without batches there divides by no token: no line."""
    selector = f'phase="{phase}"' if phase else ""
    return (f"sum by ({by}) ({over}({_m('loss_nats_total', selector)}{RATE})) / "
            f"(sum by ({by}) ({over}({_m('scored_tokens_total', selector)}{RATE})) > 0)")


def loss_over_recent(window: str = "1m") -> str:
    """Each class's mean loss between the last two scrapes over the run's mean loss (all classes)
    in the last `window`, from the counters: about 1 where the learner goes on as it just went, above
    it when a class comes back worse than the loss the learner has just been at. Detrended, so a
    spike still shows while the loss falls fast (early in a run), where a spike can be lower than
    the loss of two scrapes before it. The loss alone: nothing here knows where a switch is."""
    recent = (f"sum by (run, strategy) (increase({_m('loss_nats_total')}[{window}])) / "
              f"(sum by (run, strategy) (increase({_m('scored_tokens_total')}[{window}])) > 0)")
    return f"({window_loss(None, over='irate')}) / on (run, strategy) group_left () ({recent})"


def _panels() -> list[dict]:
    """Rows and panels, in reading order; `_layout` assigns ids and positions."""
    per_run = "{{run}} {{strategy}}"
    return [
        _row("Switch spikes"),
        _panel("timeseries", "Switch spikes: loss per class since the previous scrape",
               [(worst_batch("run, strategy, class"), "{{class}} worst batch " + per_run),
                (worst_batch("run, strategy"), "all classes worst batch " + per_run),
                (window_loss(None, over="irate"), "{{class}} mean " + per_run),
                (window_loss(None, "run, strategy", over="irate"), "all classes mean " + per_run),
                (window_loss("steady"), "{{class}} steady " + per_run),
                (loss_over_recent(), "{{class}} over the last minute's loss " + per_run)],
               unit=NATS, units={"F": RATIO}, width=16,
               description="Between the last two scrapes, from the histogram and the counters (so no batch is "
               "missed): the worst batch (99th percentile, nats) and the mean loss per token, of each class and "
               "of all, beside each class's steady loss over the window (all batches but a revisit's first k). "
               "On the right axis, each class's mean over the run's mean loss in the last minute (x): 1 is the "
               "level the learner has just been at. A revisit shows as a jump of the class's lines (above where "
               "they ended when it was last active) or of the all-classes lines; a class with no batch since the "
               "previous scrape draws nothing. "
               "Markers: true switches (white) and detected switches (red)."),
        _panel("timeseries", "Perplexity per class: steady and after switch",
               [(f"exp({window_loss('steady')})", "{{class}} steady " + per_run),
                (f"exp({window_loss('after_switch')})", "{{class}} after switch " + per_run)],
               unit=PPL, width=8,
               description="exp of the mean loss per token over the window, from the loss and token counters: "
               "steady batches, and the first k batches after a switch (ppl@sw of the window)."),
        _row("Learning"),
        _panel("timeseries", "Perplexity of the run", [(f"exp({window_loss('steady', 'run, strategy')})", "steady " + per_run),
                                                       (_m("rolling_perplexity"), "last 100 batches " + per_run)],
               unit=PPL, description="exp of the mean loss per token over the window (steady batches), and over "
               "the last 100 batches (a gauge)."),
        _panel("timeseries", "Last switch: worst batch of its first k", [(_m("last_switch_spike_nats"), "{{kind}} " + per_run)],
               unit=NATS, description="Worst batch loss of the first k batches after the latest true and detected "
               "switch, held until the next one."),
        _row("CALM metrics per class"),
        _panel("bargauge", "ppl and ppl@sw per class",
               [(f"exp({_m('class_loss_mean')})", "{{class}} ppl " + per_run),
                (f"exp({_m('loss_after_switch_mean')})", "{{class}} ppl@sw " + per_run)],
               unit=PPL, description="Both over CALM's evaluated span, fragments >= --from-fragment (N/2 with a "
               "manifest, the whole stream without one), as the run's report and console: ppl = exp(mean loss of "
               "the class there); ppl@sw = exp(mean loss of the first k batches after a revisit there). The gap is "
               "the switch spike; class 'all' is overall. No bars until the span starts.",
               **_bar_options()),
        _panel("bargauge", "Recovery time per class", [(_m("recovery_batches_mean"), "{{class}} " + per_run)],
               unit=BATCHES, description="Mean batches until the loss falls below the previous fragment's mean (rec), "
               "over the revisits in CALM's evaluated span (as ppl@sw beside it).",
               **_bar_options()),
        _panel("timeseries", "Forgetting per class",
               [(f"{_m('forgetting')} unless on (run, strategy) {_m('accuracy')}",
                 "{{class}} loss increase " + per_run),
                (f"{_m('forgetting')} and on (run, strategy) {_m('accuracy')}", "{{class}} accuracy drop " + per_run)],
               unit=NATS, units={"B": "percentunit"}, optional=True, width=24,
               description="Forgetting of each class on its probe set; only runs with probes. A language model's "
               "is a loss increase, nats: the class's held-out loss now minus its best (lowest) since it was first "
               "learned. A classifier's (a run that exports prequential accuracy) is an accuracy drop, a ratio "
               "shown in %: its best held-out accuracy minus now."),
        _row("Throughput and latency"),
        _panel("timeseries", "Throughput",
               [(_m("tokens_per_second"), "tokens/s " + per_run),
                (f"rate({_m('batches_learned_total')}{RATE})", "batches/s " + per_run)],
               unit=TOKENS_PER_S, units={"B": BATCHES_PER_S}, description="Tokens learned per second and batches learned per second."),
        _panel("timeseries", "Step latency (p50, p95)",
               [(_latency(metric, q), f"{metric.split('_')[0]} p{round(q * 100)} {per_run}")
                for metric in ("predict_seconds", "learn_seconds") for q in (0.5, 0.95)],
               unit="s", description="Quantiles of the time to score and to learn a batch."),
        _row("Kafka"),
        _panel("timeseries", "Consumer lag, queue depth and streams waited for",
               [(_m("consumer_lag_records"), "lag p{{partition}} " + per_run),
                (_m("queue_depth"), "queue " + per_run),
                (_m("streams_waited_for"), "streams waited for " + per_run)],
               unit=RECORDS, units={"B": BATCHES, "C": STREAMS},
               description="Records the learner has not yet taken into batches, per partition; batches cut whose "
                           "results are not yet taken in (the step in flight included); streams the next batch "
                           "waits for while the others send (a stream that stopped: the learning stops)."),
        _panel("timeseries", "Dead letters by reason",
               [(f"sum by (run, strategy, reason) ({_m('run_dead_letters')}) > 0 or on (run, strategy) "
                 f"label_replace(0 * sum by (run, strategy) ({_m('batches_learned_total')}), \"reason\", \"none\", \"run\", \".*\")",
                 "{{reason}} " + per_run)],
               unit=RECORDS, description="Records sent to the dead-letter topic over the whole run, by reason (a "
               "reason's line from its first): the run's totals, which a restart takes from the checkpoint, as the "
               "console and status.json show them; a run without dead letters draws one line at 0, reason 'none'."),
        _panel("timeseries", "Records read again", [(_m("records_read_again_total"), per_run)],
               unit=RECORDS, width=24, height=6,
               description="Records the consumer read more than once (each read after the first), the run's "
               "total (after a crash, as every counter, since the learner's restart). A stream that held more "
               "than --keep-windows windows while the learning waited for another had its further records left "
               "in Kafka (memory stays bounded); the counter grows as they are read "
               "again, once it has room. A flat line at 0: no stream was ever that far ahead."),
        _row("Drift detector"),
        _panel("timeseries", "Switches: true vs detected",
               [(_m("run_switches"), "{{kind}} " + per_run)],
               unit=SWITCHES, description="Ground-truth class switches (true, evaluation only) beside the drift "
               "detector's detections, over the whole run: the run's totals, which a restart takes from the "
               "checkpoint, as the console and the report count them."),
        _panel("timeseries", "Batches since detected switch", [(_m("batches_since_detected_switch"), per_run)],
               unit=BATCHES, description="The drift detector's state: batches since it last fired."),
        _panel("timeseries", "Detector precision, recall and delay",
               [(_m("detection_precision"), "precision " + per_run), (_m("detection_recall"), "recall " + per_run),
                (_m("detection_delay_batches"), "delay (batches) " + per_run)],
               optional=True, width=24, unit="percentunit", units={"C": BATCHES},
               description="The detector scored against the true switches (tolerance 10 batches; evaluation only). "
               "Precision and delay exist once the detector has fired."),
        _row("Operations"),
        _panel("stat", "Checkpoint age", [(_m("checkpoint_age_seconds"), per_run)], unit="s",
               description="Seconds since the last checkpoint was written.", **_stat_options()),
        _panel("timeseries", "GPU memory", [(_m("gpu_memory_bytes"), per_run)], unit="bytes", optional=True,
               description="Memory allocated on the GPU; only runs on a GPU."),
    ]


def _layout(panels: list[dict]) -> list[dict]:
    """Give panels ids and flow them left to right, top to bottom, on Grafana's 24-column grid."""
    x = y = row_height = 0
    for panel_id, panel in enumerate(panels, start=1):
        pos = panel["gridPos"]
        if x + pos["w"] > 24 or panel["type"] == "row":
            x, y, row_height = 0, y + row_height, 0
        panel["id"] = panel_id
        pos.update(x=x, y=y)
        x += pos["w"]
        row_height = max(row_height, pos["h"])
    return panels


def _variable(name: str, query: str) -> dict:
    return {
        "name": name, "label": name, "type": "query", "datasource": PROMETHEUS,
        "definition": query, "query": {"query": query, "refId": f"{name}-values"},
        "multi": True, "includeAll": True, "allValue": ".*", "refresh": 2, "sort": 1, "hide": 0,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "regex": "",
    }


def _pushed_annotation(name: str, kind: str, colour: str) -> dict:
    """Annotations `streamer monitor push` posts, found by tag (all tags must match); off by default,
    since the Prometheus queries below draw the same switches without a pushing process."""
    return {"name": name, "datasource": GRAFANA_ANNOTATIONS, "enable": False, "hide": False, "iconColor": colour,
            "target": {"type": "tags", "tags": ["streamer", "switch", kind], "matchAny": False, "limit": 1000}}


def switch_marker_query(kind: str) -> str:
    """The latest switches' times in ms, one series per slot (Grafana's "series value as timestamp"
    reads ms): each distinct value is one marker, and switches closer than a scrape keep theirs."""
    selector = _m("switch_timestamp_seconds", f'kind="{kind}"')
    return f"{selector} * 1000"


def _switch_annotation(name: str, kind: str, colour: str) -> dict:
    """Switch markers from Prometheus: one per distinct value of the switch-time gauges."""
    expr = switch_marker_query(kind)
    return {"name": name, "datasource": PROMETHEUS, "enable": True, "hide": False, "iconColor": colour,
            # step: Grafana merges markers closer than it into a region; 5 s is the provisioned scrape interval
            "expr": expr, "useValueForTime": True, "step": "5s", "titleFormat": f"{kind} switch",
            "textFormat": "{{run}} {{strategy}}", "tagKeys": "kind,run,strategy",
            "target": {"expr": expr, "refId": f"{kind}-switches", "useValueForTime": True}}


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model (schemaVersion 39)."""
    # Grafana's default built-in query, left on: the switch annotations carry this dashboard's uid, and
    # Grafana versions differ on whether a tag query returns dashboard-scoped annotations; where both
    # return them the markers coincide.
    builtin = {"builtIn": 1, "datasource": GRAFANA_ANNOTATIONS, "enable": True, "hide": True,
               "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
               "target": {"type": "dashboard", "limit": 100, "matchAny": False, "tags": []}}
    return {
        "id": None, "uid": DASHBOARD_UID, "title": "streamer: online continual learning",
        "description": "Prequential loss, CALM metrics, throughput, Kafka and drift detection of streamer runs.",
        "tags": ["streamer"], "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "timezone": "", "fiscalYearStartMonth": 0,
        "liveNow": False, "links": [],
        "annotations": {"list": [builtin, _switch_annotation("True switches", "true", "rgba(255, 255, 255, 0.8)"),
                                 _switch_annotation("Detected switches", "detected", "red"),
                                 _pushed_annotation("Pushed true switches (monitor push)", "true", "rgba(255, 255, 255, 0.6)"),
                                 _pushed_annotation("Pushed detected switches (monitor push)", "detected", "orange")]},
        "templating": {"list": [
            _variable("run", "label_values(streamer_batches_learned_total, run)"),
            _variable("strategy", 'label_values(streamer_batches_learned_total{run=~"$run"}, strategy)'),
        ]},
        "panels": _layout(_panels()),
    }


def panel_queries(dashboard: dict | None = None) -> list[tuple[str, str, bool]]:
    """(panel title, PromQL expression, optional) for every target of every panel."""
    dashboard = dashboard if dashboard is not None else build_dashboard()
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # panels inside a collapsed row
    return [(panel["title"], target["expr"], bool(panel.get("streamer_optional", False)))
            for panel in panels for target in panel.get("targets", [])]


def annotation_queries(dashboard: dict | None = None) -> dict[str, str]:
    """{annotation name: PromQL} of the dashboard's Prometheus annotation queries."""
    dashboard = dashboard if dashboard is not None else build_dashboard()
    return {a["name"]: a["expr"] for a in dashboard["annotations"]["list"] if a["datasource"] == PROMETHEUS}


def render_dashboard(dashboard: dict | None = None) -> str:
    """The committed file's exact text."""
    return json.dumps(dashboard if dashboard is not None else build_dashboard(), indent=2, sort_keys=True) + "\n"


def write_dashboard(path: str | Path = DEFAULT_PATH) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_dashboard(), encoding="utf-8")
    return path
