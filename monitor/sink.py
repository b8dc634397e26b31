"""The Prometheus sink: publishes a run tracker's numbers on the metrics of monitor.exporter.

Gauges hold states (the latest loss of a class, the rolling perplexity, the last switch's
spike); counters and histograms accumulate what happens between scrapes. `state_dict()`
keeps the gauges' and counters' current values as plain values, so a resumed run shows the
same states and, after a clean stop, its counters continue (after a crash they start at 0, see
`load_state_dict`); histograms (timings, batch losses) start again, as after any restart of a
Prometheus target.

Class labels come from `Observation.class_label` (a fixed set: the manifest's classes or
"other"). A non-finite loss reaches only the `batch_loss` gauge (StreamerLossNotFinite
watches it): the loss counters and histogram stay finite, so their windows stay usable.
"""

from __future__ import annotations

import math
import time

from monitor.exporter import NAMESPACE, SWITCH_SLOTS, Metrics
from monitor.tracker import Observation, RunTracker

__all__ = ["PrometheusSink"]

PHASES = ("after_switch", "steady")
# readings that the next report replaces, and the wall-clock checkpoint age: not saved
_READINGS = {"checkpoint_age_seconds", "consumer_lag_records", "queue_depth", "streams_waited_for", "tokens_per_second"}


class PrometheusSink:
    """Writes one run's (run, strategy) series; every label value comes from the tracker."""

    def __init__(self, metrics: Metrics, run: str, strategy: str, dead_letter_reasons=()):
        self.metrics = metrics
        self.labels = (run, strategy)
        self._spikes: dict[str, float] = {}  # kind -> worst loss so far of the latest switch's first k batches
        self._switches: dict[str, int] = {}  # kind -> switches so far: the next one's slot is this modulo SWITCH_SLOTS
        self._children: dict = {}  # (metric, extra label values) -> its series: each batch writes ~20
        # exported at 0 from the start: increase() and rate() see the first (a series whose first sample is
        # already above 0 counts nothing before its second), and StreamerLearnerStalled sees a learner stuck
        # on its first batch
        for metric in (metrics.batches_learned_total, metrics.tokens_total, metrics.skipped_updates_total,
                       metrics.records_read_again_total):
            metric.labels(run, strategy)
        for reason in dead_letter_reasons:
            metrics.dead_letter_total.labels(run, strategy, reason)
            metrics.run_dead_letters.labels(run, strategy, reason)
        self._read_again = 0  # the loop's total of records read again, as published

    def _child(self, metric, *extra):
        """This run's series of `metric` with the `extra` label values (prometheus_client's labels()
        takes a lock and checks every value; the learner writes about twenty a batch)."""
        key = (metric, extra)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*self.labels, *extra)
        return child

    def step(self, result, seen: Observation, tracker: RunTracker) -> None:
        """After the tracker observed `result`: update what that batch changed."""
        m, name = self.metrics, seen.class_label
        self._child(m.batch_loss, name).set(result.loss)
        self._loss_counters(result, seen)
        self._last_switch(result, seen, tracker)
        for label, mean in ((name, tracker.class_loss_mean(seen.class_name)), ("all", tracker.class_loss_mean())):
            if mean is not None:  # (before the evaluated span starts: no ppl, as no ppl@sw)
                self._child(m.class_loss_mean, label).set(mean)
        if tracker.has_detector:  # (none: "batches since" counted from the start, and recall was 0)
            self._child(m.batches_since_detected_switch).set(tracker.batches_since_detected)
        if seen.detected:
            self._child(m.switches_detected_total).inc()
        gpu_memory = getattr(result, "gpu_memory_bytes", None)
        if gpu_memory is not None:
            self._child(m.gpu_memory_bytes).set(gpu_memory)
        if tracker.has_detector and (seen.switched or seen.detected):  # precision, recall and delay change only then
            snap = tracker.detection.snapshot()
            for gauge, key in ((m.detection_precision, "precision"), (m.detection_recall, "recall"),
                               (m.detection_delay_batches, "mean_delay_batches")):
                if snap[key] is not None:
                    self._child(gauge).set(snap[key])
        self._child(m.rolling_perplexity).set(tracker.rolling_perplexity())
        self._child(m.tokens_total).inc(result.tokens)
        self._child(m.batches_learned_total).inc()
        self._child(m.skipped_updates_total).inc(int(getattr(result, "skipped", False)))
        self._child(m.predict_seconds).observe(result.predict_s)
        if tracker.accuracy.utterances and getattr(result, "predicted", None) is not None:
            self._accuracy(tracker, seen.class_name, name)
        self._child(m.learn_seconds).observe(result.learn_s)
        if seen.switched:
            self._child(m.switches_total).inc()
            self._switch_metrics(tracker)
        if seen.switched or seen.detected:
            self.totals(tracker)
        if seen.reference is not None:  # a revisit: what StreamerSwitchSpike compares its first batches with
            self._child(m.previous_fragment_loss_nats, name).set(seen.reference)

    def _loss_counters(self, result, seen: Observation) -> None:
        """Loss and tokens per class and phase, and the batch-loss histogram: every batch counts."""
        m, name = self.metrics, seen.class_label
        for phase in PHASES:  # both phases exist from the class's first batch, so increase() sees every step
            self._child(m.loss_nats_total, name, phase)
            self._child(m.scored_tokens_total, name, phase)
        if not math.isfinite(result.loss):
            return
        phase = "after_switch" if seen.after_switch else "steady"
        self._child(m.loss_nats_total, name, phase).inc(result.loss * result.tokens)
        self._child(m.scored_tokens_total, name, phase).inc(result.tokens)
        self._child(m.batch_loss_nats, name).observe(result.loss)

    def _last_switch(self, result, seen: Observation, tracker: RunTracker) -> None:
        """Each true and detected switch's time, in the next of SWITCH_SLOTS slots (a switch that
        follows within a scrape takes another slot, so the markers drawn from them keep both), and
        the latest one's worst batch among its first k."""
        k = tracker.calm.k
        spans = (("true", seen.switched, tracker.batches_since_switch < k),
                 ("detected", seen.detected, tracker.batches_since_detected < k))
        for kind, starts, within in spans:
            if starts:
                at = getattr(result, "finished_at", None) or time.time()
                slot = self._switches.get(kind, 0)
                self._child(self.metrics.switch_timestamp_seconds, kind, str(slot % SWITCH_SLOTS)).set(at)
                self._switches[kind] = slot + 1
                self._spikes[kind] = -math.inf
            if within and kind in self._spikes and math.isfinite(result.loss):
                self._spikes[kind] = max(self._spikes[kind], result.loss)
                self._child(self.metrics.last_switch_spike_nats, kind).set(self._spikes[kind])

    def _accuracy(self, tracker: RunTracker, class_name: str, name: str) -> None:
        """Classifiers: prequential accuracy and macro-F1, overall, rolling and of this batch's class."""
        m, labels = self.metrics, self.labels
        snap = tracker.accuracy.snapshot()
        m.accuracy.labels(*labels).set(snap["accuracy"])
        m.macro_f1.labels(*labels).set(snap["macro_f1"])
        m.accuracy_rolling.labels(*labels).set(snap["rolling"]["accuracy"])
        m.macro_f1_rolling.labels(*labels).set(snap["rolling"]["macro_f1"])
        m.class_accuracy.labels(*labels, name).set(snap["per_class"][class_name]["accuracy"])
        m.class_macro_f1.labels(*labels, name).set(snap["per_class"][class_name]["macro_f1"])

    def _switch_metrics(self, tracker: RunTracker) -> None:
        """Revisit metrics change only when a fragment closes, i.e. at a switch."""
        m, labels = self.metrics, self.labels
        snap = tracker.calm.snapshot()
        live = snap["live"]
        last_class = live.get("last_revisit_class")
        if live["last_loss_after_switch"] is not None:
            cls = tracker.class_label(last_class) if last_class else "all"
            m.loss_after_switch_last.labels(*labels, cls).set(live["last_loss_after_switch"])
            m.recovery_batches_last.labels(*labels, cls).set(live["last_rec"])
        if live["mean_loss_after_switch"] is not None:
            m.loss_after_switch_mean.labels(*labels, "all").set(live["mean_loss_after_switch"])
            m.recovery_batches_mean.labels(*labels, "all").set(live["mean_rec"])
        for cls, values in snap["per_class"].items():
            if values["ppl@sw"] is not None:
                m.loss_after_switch_mean.labels(*labels, tracker.class_label(cls)).set(math.log(values["ppl@sw"]))
                m.recovery_batches_mean.labels(*labels, tracker.class_label(cls)).set(values["rec"])

    def lag(self, lag_by_partition: dict) -> None:
        for partition, lag in lag_by_partition.items():
            self.metrics.consumer_lag_records.labels(*self.labels, str(partition)).set(lag)

    def queue_depth(self, depth: int) -> None:
        self.metrics.queue_depth.labels(*self.labels).set(depth)

    def streams_waited_for(self, count: int) -> None:
        self.metrics.streams_waited_for.labels(*self.labels).set(count)

    def read_again(self, total: int) -> None:
        """The loop's total of records read again (a reading, raised to it: a counter never goes down)."""
        if total > self._read_again:
            self._child(self.metrics.records_read_again_total).inc(total - self._read_again)
            self._read_again = total

    def dead_letter(self, reason: str, run_total: int, count: int = 1) -> None:
        """`count` more records of `reason` dead-lettered; `run_total`: the run's, checkpoint included."""
        self.metrics.dead_letter_total.labels(*self.labels, reason).inc(count)
        self.metrics.run_dead_letters.labels(*self.labels, reason).set(run_total)

    def totals(self, tracker: RunTracker) -> None:
        """The run's totals the checkpoint carries (switches true and detected, dead letters by reason), as
        gauges: after a crash the counters start again at 0 (right for rate()), these stay the console's,
        status.json's and the report's."""
        self._child(self.metrics.run_switches, "true").set(tracker.switches)
        if tracker.has_detector:
            self._child(self.metrics.run_switches, "detected").set(tracker.detected_switches)
        for reason, count in tracker.dead_letters.items():
            self._child(self.metrics.run_dead_letters, reason).set(count)

    def forgetting(self, by_class: dict[str, float], tracker: RunTracker) -> None:
        for name, value in by_class.items():
            self.metrics.forgetting.labels(*self.labels, tracker.class_label(name)).set(value)

    def checkpointed(self, at: float) -> None:
        """A checkpoint was written at wall time `at`; its age is computed at each scrape."""
        self.metrics.checkpoint_age_seconds.labels(*self.labels).set_function(lambda: time.time() - at)

    def _series(self):
        """(family name, kind, extra label values, value) of this run's gauges and counters."""
        run, strategy = self.labels
        for name, family in self.metrics.families.items():
            if name in _READINGS:
                continue
            for metric in family.collect():
                if metric.type not in ("gauge", "counter"):
                    continue
                wanted = f"{NAMESPACE}_{name}" if metric.type == "gauge" else f"{NAMESPACE}_{name.removesuffix('_total')}_total"
                for sample in metric.samples:
                    if sample.name == wanted and (sample.labels.get("run"), sample.labels.get("strategy")) == (run, strategy):
                        extra = [value for key, value in sample.labels.items() if key not in ("run", "strategy")]
                        yield name, metric.type, extra, sample.value

    def state_dict(self) -> dict:
        """The current value of this run's gauges and counters (plain values)."""
        return {"series": [[name, kind, extra, value] for name, kind, extra, value in self._series()]}

    def load_state_dict(self, state: dict, counters: bool = True) -> None:
        """Set the gauges; raise the counters to their saved totals (a counter never goes down), or, with
        `counters=False`, leave them at 0 as any restarted target's: after a crash the checkpoint's totals
        are below what Prometheus last scraped, and a counter that comes back lower, not at 0, has its
        whole value counted again by increase() and rate() (a reset: every window over the restart, the
        spike alert's among them, counted the run's batches, tokens and losses twice)."""
        current = {(name, tuple(extra)): value for name, kind, extra, value in self._series() if kind == "counter"}
        latest: dict[str, tuple[float, int]] = {}  # kind -> (time, slot) of its latest switch
        for name, kind, extra, value in state["series"]:
            if name not in self.metrics.families:  # a metric this version no longer exports (an older checkpoint)
                continue
            child = self.metrics.families[name].labels(*self.labels, *extra)
            if kind == "gauge":
                child.set(value)
                if name == "last_switch_spike_nats":
                    self._spikes[extra[0]] = value
                if name == "switch_timestamp_seconds":
                    latest[extra[0]] = max(latest.get(extra[0], (-math.inf, 0)), (value, int(extra[1])))
            elif counters and value > current.get((name, tuple(extra)), 0.0):
                child.inc(value - current.get((name, tuple(extra)), 0.0))
            if name == "records_read_again_total":  # the loop's total restored: what comes after it is counted
                self._read_again = max(self._read_again, int(value))
        self._switches.update({kind: slot + 1 for kind, (_, slot) in latest.items()})
