"""Run monitoring without torch: live tracking, Prometheus metrics, the terminal view, loss logs and reports."""

__all__ = [
    "accuracy", "calm", "calm_tracker", "compare", "dashboard", "detection", "dmi", "drift", "exporter",
    "figures", "forgetting", "grafana_push", "live", "losslog", "plots", "reference", "report", "results",
    "river_state", "sink", "sums", "tracker", "view",
]
