"""Run monitoring without torch: CALM metrics (offline and live), the loss log, plots and reports."""

from monitor.calm import CalmTracker, calm_metrics, format_table
from monitor.losslog import LossLogWriter, read_loss_log
from monitor.plots import plot_loss_curve
from monitor.report import build_report, load_run, resolve_from_fragment, write_report

__all__ = [
    "CalmTracker",
    "LossLogWriter",
    "build_report",
    "calm_metrics",
    "format_table",
    "load_run",
    "plot_loss_curve",
    "read_loss_log",
    "resolve_from_fragment",
    "write_report",
]
