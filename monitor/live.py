"""Live monitoring: one consumer of step results, composed of a tracker and a Prometheus sink.

`LiveMonitor.observe(result)` hands a monitor.results.StepResult (any object with its
fields) to the `RunTracker` (every live number, torch-free), then to the `PrometheusSink`
when metrics are exported, and returns the batch's loss-log line; `snapshot()` is what
the terminal view renders. `state_dict()` / `load_state_dict()` carry both across a
checkpoint as plain values.
"""

from __future__ import annotations

from monitor.losslog import loss_log_line
from monitor.sink import PrometheusSink
from monitor.tracker import UNLABELLED, RunTracker, ViewSnapshot

__all__ = ["LiveMonitor", "ViewSnapshot", "UNLABELLED"]

STATE_VERSION = 1


class LiveMonitor:
    """The facade a learner composes: tracker, optional Prometheus sink, loss-log lines."""

    def __init__(self, *, run: str, strategy: str, classes=(), k: int = 10, from_fragment: int = 0,
                 total_batches: int | None = None, metrics=None, spark_width: int = 60,
                 detector: str = "page-hinkley", detection_tolerance: int = 10):
        self.run, self.strategy = run, strategy
        self.metrics = metrics
        self.run_tracker = RunTracker(
            run=run, strategy=strategy, classes=classes, k=k, from_fragment=from_fragment,
            total_batches=total_batches, spark_width=spark_width, detector=detector,
            detection_tolerance=detection_tolerance)
        self.sink = None if metrics is None else PrometheusSink(metrics, run, strategy)

    # the parts, for callers that read them directly
    @property
    def tracker(self):
        """The CALM tracker (monitor.calm_tracker.CalmTracker)."""
        return self.run_tracker.calm

    @property
    def detection(self):
        return self.run_tracker.detection

    @property
    def accuracy(self):
        return self.run_tracker.accuracy

    @property
    def from_fragment(self) -> int:
        return self.run_tracker.from_fragment

    @property
    def total_batches(self) -> int | None:
        return self.run_tracker.total_batches

    @total_batches.setter
    def total_batches(self, value: int | None) -> None:
        self.run_tracker.total_batches = value

    def class_id(self, name: str) -> int:
        return self.run_tracker.class_id(name)

    def observe(self, result) -> dict:
        """Account one step result; return its loss-log line (CALM format plus extras)."""
        seen = self.run_tracker.observe(result)
        if self.sink is not None:
            self.sink.step(result, seen, self.run_tracker)
        return loss_log_line(result, domain=seen.domain, class_name=seen.class_name,
                             fragment=seen.fragment, detected=seen.detected)

    def set_lag(self, lag_by_partition: dict) -> None:
        """Lag per partition ({partition: records}); the view shows the sum."""
        self.run_tracker.set_lag(lag_by_partition)
        if self.sink is not None:
            self.sink.lag(lag_by_partition)

    def probed(self, row: dict) -> None:
        """A probe evaluation: the exporter shows each class's forgetting (see RunTracker.probed)."""
        forgetting = self.run_tracker.probed(row)
        if self.sink is not None:
            self.sink.forgetting(forgetting, self.run_tracker)

    def checkpointed(self, at: float) -> None:
        """A checkpoint was written at wall time `at`; the exporter reports its age."""
        if self.sink is not None:
            self.sink.checkpointed(at)

    def set_queue_depth(self, depth: int) -> None:
        self.run_tracker.set_queue_depth(depth)
        if self.sink is not None:
            self.sink.queue_depth(depth)

    def dead_letter(self, reason: str) -> None:
        self.run_tracker.dead_letter(reason)
        if self.sink is not None:
            self.sink.dead_letter(reason)

    @property
    def dead_letters(self) -> dict:
        return self.run_tracker.dead_letters

    def tokens_per_second(self) -> float:
        return self.run_tracker.tokens_per_second()

    def snapshot(self) -> ViewSnapshot:
        return self.run_tracker.snapshot()

    def state_dict(self) -> dict:
        """The tracker's and the sink's state, plain values only (torch.load(weights_only=True) reads it)."""
        return {"version": STATE_VERSION, "run": self.run, "strategy": self.strategy,
                "tracker": self.run_tracker.state_dict(),
                "prometheus": None if self.sink is None else self.sink.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`: the live numbers then equal an uninterrupted monitor's."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"monitor state version {state.get('version')!r}, expected {STATE_VERSION}")
        self.run_tracker.load_state_dict(state["tracker"])
        if self.sink is not None and state["prometheus"] is not None:
            self.sink.load_state_dict(state["prometheus"])
