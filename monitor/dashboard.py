"""The Grafana dashboard of streamer, as code, and the `streamer monitor` subcommand.

The dashboard is built from plain Python dicts rather than grafana-foundation-sdk:
it is a dozen panels, the JSON it writes is small and diffs well in review, and
the SDK would be one more dependency (and one more schema version to track) for
that. `build_dashboard()` is the single source; deploy/grafana/dashboards/streamer.json
is its output, committed so Grafana's file provisioning can load it, and a test
fails when the two differ (`streamer monitor dashboard` regenerates the file).

Every query filters on the `run` and `strategy` template variables. Panels whose
metric exists only in some runs (forgetting needs probe sets, GPU memory a GPU)
carry ``"streamer_optional": true`` so checks against a CPU run without probes
can skip them.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "DASHBOARD_UID", "DEFAULT_PATH", "PROMETHEUS_UID", "build_dashboard",
    "panel_queries", "render_dashboard", "write_dashboard",
]

DASHBOARD_UID = "streamer"
DEFAULT_PATH = Path("deploy/grafana/dashboards/streamer.json")
PROMETHEUS_UID = "prometheus"  # deploy/grafana/provisioning/datasources/prometheus.yml
PROMETHEUS = {"type": "prometheus", "uid": PROMETHEUS_UID}
GRAFANA_ANNOTATIONS = {"type": "grafana", "uid": "-- Grafana --"}  # the built-in "Annotations & Alerts" source
FILTER = 'run=~"$run", strategy=~"$strategy"'
RATE = "[$__rate_interval]"


def _m(name: str, extra: str = "") -> str:
    """A selector of `name` filtered by the run and strategy variables (plus `extra` matchers)."""
    return f"streamer_{name}{{{FILTER}{', ' + extra if extra else ''}}}"


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": PROMETHEUS, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(kind: str, title: str, targets: list[tuple[str, str]], *, unit: str = "short",
           description: str = "", optional: bool = False, width: int = 12, height: int = 8, **options) -> dict:
    panel = {
        "type": kind, "title": title, "description": description, "datasource": PROMETHEUS,
        "targets": [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
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


def _panels() -> list[dict]:
    """Rows and panels, in reading order; `_layout` assigns ids and positions."""
    per_run = "{{run}} {{strategy}}"
    return [
        _row("Learning"),
        _panel("timeseries", "Batch loss per class", [(_m("batch_loss"), "{{class}} " + per_run)], unit="none",
               description="Recorded (pre-update) loss of the latest batch, nats. Markers: true and detected switches."),
        _panel("timeseries", "Rolling perplexity", [(_m("rolling_perplexity"), per_run)], unit="none",
               description="exp of the mean recorded loss over the last 100 batches."),
        _row("CALM metrics per class"),
        _panel("bargauge", "ppl and ppl@sw per class",
               [(f"exp({_m('class_loss_mean')})", "{{class}} ppl " + per_run),
                (f"exp({_m('loss_after_switch_mean')})", "{{class}} ppl@sw " + per_run)],
               unit="none", description="ppl = exp(mean loss of the class so far); ppl@sw = exp(mean loss of the "
               "first k batches after a revisit). The gap is the switch spike; class 'all' is overall.",
               **_bar_options()),
        _panel("bargauge", "Recovery time per class", [(_m("recovery_batches_mean"), "{{class}} " + per_run)],
               unit="none", description="Mean batches until the loss falls below the previous fragment's mean (rec).",
               **_bar_options()),
        _panel("timeseries", "Forgetting per class", [(_m("forgetting"), "{{class}} " + per_run)], unit="none",
               optional=True, width=24, description="Loss increase on each class's probe set; only runs with probes."),
        _row("Throughput and latency"),
        _panel("timeseries", "Throughput",
               [(_m("tokens_per_second"), "tokens/s " + per_run),
                (f"rate({_m('batches_learned_total')}{RATE})", "batches/s " + per_run)],
               description="Tokens learned per second and batches learned per second."),
        _panel("timeseries", "Step latency (p50, p95)",
               [(_latency(metric, q), f"{metric.split('_')[0]} p{round(q * 100)} {per_run}")
                for metric in ("predict_seconds", "learn_seconds") for q in (0.5, 0.95)],
               unit="s", description="Quantiles of the time to score and to learn a batch."),
        _row("Kafka"),
        _panel("timeseries", "Consumer lag and queue depth",
               [(_m("consumer_lag_records"), "lag p{{partition}} " + per_run),
                (_m("queue_depth"), "queue " + per_run)],
               description="Records beyond the consumer position per partition; batches waiting for the model."),
        _panel("timeseries", "Dead letters by reason",
               [(f"sum by (run, strategy, reason) ({_m('dead_letter_total')})", "{{reason}} " + per_run)],
               description="Records sent to the dead-letter topic, by reason."),
        _row("Drift detector"),
        _panel("timeseries", "Switches: true vs detected",
               [(_m("switches_total"), "true " + per_run), (_m("switches_detected_total"), "detected " + per_run)],
               description="Ground-truth class switches (evaluation only) beside the drift detector's detections."),
        _panel("timeseries", "Batches since detected switch", [(_m("batches_since_detected_switch"), per_run)],
               description="The drift detector's state: batches since it last fired."),
        _panel("timeseries", "Detector precision, recall and delay",
               [(_m("detection_precision"), "precision " + per_run), (_m("detection_recall"), "recall " + per_run),
                (_m("detection_delay_batches"), "delay (batches) " + per_run)],
               optional=True, width=24,
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


def _switch_annotation(name: str, kind: str, colour: str) -> dict:
    """Annotations `streamer monitor push` posts, found by tag (all tags must match)."""
    return {"name": name, "datasource": GRAFANA_ANNOTATIONS, "enable": True, "hide": False, "iconColor": colour,
            "target": {"type": "tags", "tags": ["streamer", "switch", kind], "matchAny": False, "limit": 1000}}


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
        "annotations": {"list": [builtin, _switch_annotation("True switches", "true", "rgba(255, 255, 255, 0.6)"),
                                 _switch_annotation("Detected switches", "detected", "red")]},
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


def render_dashboard(dashboard: dict | None = None) -> str:
    """The committed file's exact text."""
    return json.dumps(dashboard if dashboard is not None else build_dashboard(), indent=2, sort_keys=True) + "\n"


def write_dashboard(path: str | Path = DEFAULT_PATH) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_dashboard(), encoding="utf-8")
    return path
