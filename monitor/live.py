"""Live monitoring: one consumer of step results, composed of a tracker and a Prometheus sink.

`LiveMonitor.observe(result)` hands a monitor.results.StepResult (any object with its
fields) to the `RunTracker` (every live number, torch-free), then to the `PrometheusSink`
when metrics are exported, and returns the batch's loss-log line; `snapshot()` freezes
the tracker's numbers; `read(reading)` takes the loop's state a few times a second (an
ActivityClock makes the activity, the compute/waiting split and the rates of it) and
`console_snapshot()` is what the terminal view, the plain log and `streamer status` render.
`state_dict()` / `load_state_dict()` carry the tracker and the sink across a checkpoint as
plain values (the clock's wall-time readings start again).
"""

from __future__ import annotations

import time
from dataclasses import replace

from monitor.console import ActivityClock, ConsoleSnapshot, LoopReading, TimeSplit
from monitor.losslog import loss_log_line
from monitor.sink import PHASES, PrometheusSink
from monitor.tracker import UNLABELLED, RunTracker, ViewSnapshot

__all__ = ["LiveMonitor", "ViewSnapshot", "ConsoleSnapshot", "LoopReading", "UNLABELLED"]

STATE_VERSION = 1


class LiveMonitor:
    """The facade a learner composes: tracker, optional Prometheus sink, loss-log lines."""

    def __init__(self, *, run: str, strategy: str, classes=(), k: int = 10, from_fragment: int = 0,
                 total_batches: int | None = None, metrics=None, spark_width: int = 60,
                 detector: str = "page-hinkley", detection_tolerance: int = 10, recent_window_s: float = 5.0,
                 compute_window_s: float = 60.0, dead_letter_reasons=(), oracle: bool = False):
        self.run, self.strategy = run, strategy
        self.metrics = metrics
        self.run_tracker = RunTracker(
            run=run, strategy=strategy, classes=classes, k=k, from_fragment=from_fragment,
            total_batches=total_batches, spark_width=spark_width, detector=detector,
            detection_tolerance=detection_tolerance, oracle=oracle)
        self.sink = None if metrics is None else PrometheusSink(metrics, run, strategy, dead_letter_reasons)
        if self.sink is not None:
            self.sink.totals(self.run_tracker)
        for name in classes if metrics is not None else ():
            # the manifest's classes: their loss and token counters exist, at 0, before their first batch;
            # else the first scrape of a class holds its first batches already, and increase() over a window
            # that starts before it extrapolates the two counters differently (their ratio is then off)
            for phase in PHASES:
                metrics.loss_nats_total.labels(run, strategy, name, phase)
                metrics.scored_tokens_total.labels(run, strategy, name, phase)
        self.clock = ActivityClock(recent_window_s=recent_window_s, compute_window_s=compute_window_s)
        self._checkpoint_at: float | None = None

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
        now = time.monotonic()
        self.clock.learned(result.tokens, now)
        if self.sink is not None:
            self.sink.step(result, seen, self.run_tracker)
            self._publish_rate(now)
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

    def read(self, reading: LoopReading) -> None:
        """The loop's state now (streamer.learner reads it a few times a second): activity, lag, queue,
        and the tokens/s gauge, which thus falls to zero while nothing is learned."""
        if reading.checkpoint_at is None and self._checkpoint_at is not None:
            reading = replace(reading, checkpoint_at=self._checkpoint_at)
        now = time.monotonic()
        self.clock.read(reading, now)
        if reading.lag:
            self.set_lag(reading.lag)
        self.set_queue_depth(reading.queue_depth)
        if self.sink is not None:
            self.sink.streams_waited_for(len(reading.waiting_for))
            self.sink.read_again(reading.read_again)
            self._publish_rate(now)

    def _publish_rate(self, now: float) -> None:
        self.metrics.tokens_per_second.labels(self.run, self.strategy).set(self.clock.recent_rate(now))

    def console_snapshot(self) -> ConsoleSnapshot:
        """The view's snapshot with the latest reading: activity, rates, lag per partition, timings."""
        return self.clock.snapshot(self.snapshot(), time.monotonic(), time.time())

    def time_split(self) -> TimeSplit:
        """Compute and waiting time so far (see monitor.console.ActivityClock)."""
        return self.clock.split(time.monotonic())

    def checkpointed(self, at: float) -> None:
        """A checkpoint was written at wall time `at`; the exporter reports its age."""
        self._checkpoint_at = at
        if self.sink is not None:
            self.sink.checkpointed(at)

    def set_queue_depth(self, depth: int) -> None:
        self.run_tracker.set_queue_depth(depth)
        if self.sink is not None:
            self.sink.queue_depth(depth)

    def dead_letter(self, reason: str, count: int = 1) -> None:
        """`count` more records of `reason` (retention's gap of millions is one call)."""
        self.run_tracker.dead_letter(reason, count)
        if self.sink is not None:
            self.sink.dead_letter(reason, self.run_tracker.dead_letters[reason], count)

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

    def load_state_dict(self, state: dict, counters: bool = True) -> None:
        """Continue from :meth:`state_dict`: the live numbers then equal an uninterrupted monitor's (the
        Prometheus counters too unless `counters=False`: see PrometheusSink.load_state_dict)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"monitor state version {state.get('version')!r}, expected {STATE_VERSION}")
        self.run_tracker.load_state_dict(state["tracker"])
        if self.sink is not None and state["prometheus"] is not None:
            self.sink.load_state_dict(state["prometheus"], counters=counters)
        if self.sink is not None:  # the run's totals from the tracker (a checkpoint older than their gauges)
            self.sink.totals(self.run_tracker)
