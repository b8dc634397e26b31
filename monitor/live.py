"""Live monitoring: one consumer of step results feeding the tracker, exporter and view.

Duck-typed on the step result (loss, tokens, truth, timings) so monitor/ never
imports torch or a model.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass

from river import stats, utils

from monitor.accuracy import AccuracyTracker
from monitor.calm import CalmTracker
from monitor.detection import DetectionTracker
from monitor.drift import make_detector

__all__ = ["LiveMonitor", "ViewSnapshot"]

UNLABELLED = "unlabelled"


@dataclass(frozen=True)
class ViewSnapshot:
    """Everything the terminal view shows, frozen at one moment."""

    run: str
    strategy: str
    batches: int
    total_batches: int | None
    last_loss: float | None
    rolling_ppl: float | None
    recent_losses: tuple[float, ...]
    recent_switches: tuple[bool, ...]  # True where a true switch happened at that batch
    current_class: str | None
    overall: dict  # ppl, ppl@sw, rec over the evaluated span
    per_class: dict  # class -> {ppl, ppl@sw, rec, n_batches}
    from_fragment: int
    switches: int
    detected_switches: int
    tokens_per_s: float
    lag: int
    queue_depth: int
    dead_letters: dict
    elapsed_s: float
    accuracy: dict | None = None  # classifiers: monitor.accuracy's snapshot (prequential accuracy, macro-F1)


def _exp(x: float | None) -> float | None:
    if x is None:
        return None
    return math.exp(x) if x < 700 else math.inf


class LiveMonitor:
    def __init__(self, *, run: str, strategy: str, classes=(), k: int = 10, from_fragment: int = 0,
                 total_batches: int | None = None, metrics=None, spark_width: int = 60,
                 detector: str = "page-hinkley", detection_tolerance: int = 10):
        self.run, self.strategy = run, strategy
        self.total_batches = total_batches
        self.from_fragment = from_fragment
        self.tracker = CalmTracker(k=k, from_fragment=from_fragment)
        self.metrics = metrics
        self._class_ids = {name: i for i, name in enumerate(classes)}
        self._rolling = utils.Rolling(stats.Mean, window_size=100)
        self._recent = deque(maxlen=spark_width)
        self._recent_switch = deque(maxlen=spark_width)
        self._rate_window = deque()
        self._batches = 0
        self._last_loss = None
        self._last_key = None
        self._switches = 0
        self._lag = 0
        self._queue_depth = 0
        self._dead = Counter()
        self._started = time.monotonic()
        self._detector = make_detector(detector)
        self.detection = DetectionTracker(tolerance=detection_tolerance)
        self._detected = 0
        self._since_detected = 0
        self._class_sums: dict[str, list] = {}  # class -> [sum of losses, batches]
        self._probe_trained: set[str] = set()  # classes whose first fragment has ended
        self._probe_best: dict[str, float] = {}
        self.accuracy = AccuracyTracker()  # classifiers only: fed by rows' predicted and revealed labels

    def class_id(self, name: str) -> int:
        return self._class_ids.setdefault(name, len(self._class_ids))

    def observe(self, result) -> dict:
        """Account one step result; return its loss-log line (CALM format plus extras)."""
        truth = result.truth
        name = truth.class_name if truth else UNLABELLED
        fragment = truth.fragment if truth else 0
        domain = self.class_id(name)
        switched = self._last_key is not None and self._last_key != fragment
        self._last_key = fragment
        self._switches += switched
        self._batches += 1
        self._last_loss = result.loss
        self._rolling.update(result.loss)
        self._recent.append(result.loss)
        self._recent_switch.append(switched)
        now = time.monotonic()
        self._rate_window.append((now, result.tokens))
        while self._rate_window and now - self._rate_window[0][0] > 5.0:
            self._rate_window.popleft()
        self.tracker.update(result.loss, domain, name, fragment)
        sums = self._class_sums.setdefault(name, [0.0, 0])
        sums[0] += result.loss
        sums[1] += 1
        detected = self._detect(result.loss)
        predicted, labels = getattr(result, "predicted", None), getattr(result, "labels", None)
        if predicted is not None and labels is not None:
            self.accuracy.update(predicted, labels, name)
        if truth is not None:  # scoring the detector needs the ground truth (evaluation only)
            self.detection.update(self._batches - 1, fragment, detected)
        if self.metrics is not None:
            self._export(result, name, switched, detected)
        line = {
            "loss": result.loss, "domain": domain, "domain_name": name, "sequence": fragment,
            "batch": result.index, "tokens": result.tokens, "train_loss": result.train_loss,
            "predict_s": round(result.predict_s, 6), "learn_s": round(result.learn_s, 6),
            "time": round(result.finished_at, 3), "detected_switch": detected,
        }
        for key in ("gates", "predicted", "labels"):  # mixtures and classifiers only
            value = getattr(result, key, None)
            if value is not None:
                line[key] = [round(v, 6) for v in value] if key == "gates" else list(value)
        return line

    def _detect(self, loss: float) -> bool:
        """Feed the label-free detector; True when it signals a switch at this batch."""
        self._since_detected += 1
        if self._detector is None or not math.isfinite(loss):
            return False
        self._detector.update(loss)
        if self._detector.drift_detected:
            self._detected += 1
            self._since_detected = 0
            return True
        return False

    def set_lag(self, lag_by_partition: dict) -> None:
        """Lag per partition ({partition: records}); the view shows the sum."""
        self._lag = sum(lag_by_partition.values())
        if self.metrics is not None:
            for partition, lag in lag_by_partition.items():
                self.metrics.consumer_lag_records.labels(self.run, self.strategy, str(partition)).set(lag)

    def probed(self, row: dict) -> None:
        """A probe evaluation: per class, forgetting = current held-out loss minus the best
        (lowest) held-out loss it had at an earlier evaluation after it was first learned
        (Chaudhry et al.'s per-class forgetting, with the sign flipped for losses). Classifier
        probes score accuracy (row["unit"]): forgetting = best (highest) accuracy minus current."""
        if row.get("ended_class"):
            self._probe_trained.add(row["ended_class"])
        sign = -1.0 if row.get("unit") == "accuracy" else 1.0  # as a loss: lower is better
        for name, value in row["scores"].items():
            loss = sign * value
            best = self._probe_best.get(name)
            if name in self._probe_trained and best is not None and self.metrics is not None:
                self.metrics.forgetting.labels(self.run, self.strategy, name).set(max(0.0, loss - best))
            if name in self._probe_trained:
                self._probe_best[name] = loss if best is None else min(best, loss)

    def checkpointed(self, at: float) -> None:
        """A checkpoint was written at wall time `at`; the exporter reports its age."""
        if self.metrics is not None:
            self.metrics.checkpoint_age_seconds.labels(self.run, self.strategy).set_function(
                lambda: time.time() - at)

    def set_queue_depth(self, depth: int) -> None:
        self._queue_depth = depth
        if self.metrics is not None:
            self.metrics.queue_depth.labels(self.run, self.strategy).set(depth)

    def dead_letter(self, reason: str) -> None:
        self._dead[reason] += 1
        if self.metrics is not None:
            self.metrics.dead_letter_total.labels(self.run, self.strategy, reason).inc()

    @property
    def dead_letters(self) -> dict:
        return dict(self._dead)

    def tokens_per_second(self) -> float:
        if len(self._rate_window) < 2:
            return 0.0
        span = self._rate_window[-1][0] - self._rate_window[0][0]
        tokens = sum(t for _, t in list(self._rate_window)[1:])
        return tokens / span if span > 0 else 0.0

    def _export(self, result, name: str, switched: bool, detected: bool) -> None:
        m, labels = self.metrics, (self.run, self.strategy)
        m.batch_loss.labels(*labels, name).set(result.loss)
        total, count = self._class_sums[name]
        m.class_loss_mean.labels(*labels, name).set(total / count)
        m.batches_since_detected_switch.labels(*labels).set(self._since_detected)
        if detected:
            m.switches_detected_total.labels(*labels).inc()
        gpu_memory = getattr(result, "gpu_memory_bytes", None)
        if gpu_memory is not None:
            m.gpu_memory_bytes.labels(*labels).set(gpu_memory)
        if switched or detected:  # precision, recall and delay change only then
            snap = self.detection.snapshot()
            for gauge, key in ((m.detection_precision, "precision"), (m.detection_recall, "recall"),
                               (m.detection_delay_batches, "mean_delay_batches")):
                if snap[key] is not None:
                    gauge.labels(*labels).set(snap[key])
        m.rolling_perplexity.labels(*labels).set(_exp(self._rolling.get()))
        m.tokens_per_second.labels(*labels).set(self.tokens_per_second())
        m.tokens_total.labels(*labels).inc(result.tokens)
        m.batches_learned_total.labels(*labels).inc()
        m.predict_seconds.labels(*labels).observe(result.predict_s)
        if self.accuracy.utterances and getattr(result, "predicted", None) is not None:
            self._export_accuracy(name)
        m.learn_seconds.labels(*labels).observe(result.learn_s)
        if switched:
            m.switches_total.labels(*labels).inc()
            self._export_switch_metrics()

    def _export_accuracy(self, name: str) -> None:
        """Classifiers: prequential accuracy and macro-F1, overall, rolling and of this batch's class."""
        m, labels = self.metrics, (self.run, self.strategy)
        snap = self.accuracy.snapshot()
        m.accuracy.labels(*labels).set(snap["accuracy"])
        m.macro_f1.labels(*labels).set(snap["macro_f1"])
        m.accuracy_rolling.labels(*labels).set(snap["rolling"]["accuracy"])
        m.macro_f1_rolling.labels(*labels).set(snap["rolling"]["macro_f1"])
        m.class_accuracy.labels(*labels, name).set(snap["per_class"][name]["accuracy"])
        m.class_macro_f1.labels(*labels, name).set(snap["per_class"][name]["macro_f1"])

    def _export_switch_metrics(self) -> None:
        """Revisit metrics change only when a fragment closes, i.e. at a switch."""
        m, labels = self.metrics, (self.run, self.strategy)
        snap = self.tracker.snapshot()
        live = snap["live"]
        last_class = live.get("last_revisit_class")
        if live["last_loss_after_switch"] is not None:
            cls = last_class or "all"
            m.loss_after_switch_last.labels(*labels, cls).set(live["last_loss_after_switch"])
            m.recovery_batches_last.labels(*labels, cls).set(live["last_rec"])
        if live["mean_loss_after_switch"] is not None:
            m.loss_after_switch_mean.labels(*labels, "all").set(live["mean_loss_after_switch"])
            m.recovery_batches_mean.labels(*labels, "all").set(live["mean_rec"])
        for cls, values in snap["per_class"].items():
            if values["ppl@sw"] is not None:
                m.loss_after_switch_mean.labels(*labels, cls).set(math.log(values["ppl@sw"]))
                m.recovery_batches_mean.labels(*labels, cls).set(values["rec"])

    def snapshot(self) -> ViewSnapshot:
        snap = self.tracker.snapshot()
        rolling = self._rolling.get() if self._batches else None
        return ViewSnapshot(
            run=self.run, strategy=self.strategy, batches=self._batches,
            total_batches=self.total_batches, last_loss=self._last_loss,
            rolling_ppl=_exp(rolling), recent_losses=tuple(self._recent),
            recent_switches=tuple(self._recent_switch),
            current_class=snap["live"].get("current_class"),
            overall={key: snap[key] for key in ("ppl", "ppl@sw", "rec")},
            per_class={cls: {key: v[key] for key in ("ppl", "ppl@sw", "rec", "n_batches")}
                       for cls, v in snap["per_class"].items()},
            from_fragment=self.from_fragment, switches=self._switches, detected_switches=self._detected,
            tokens_per_s=self.tokens_per_second(), lag=self._lag,
            queue_depth=self._queue_depth, dead_letters=dict(self._dead),
            elapsed_s=time.monotonic() - self._started, accuracy=self.accuracy.snapshot(),
        )
