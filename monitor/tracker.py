"""The run tracker: every live number of a run, from step results, without torch or Prometheus.

`RunTracker.observe(result)` accounts one monitor.results.StepResult (any object with its
fields) and returns an `Observation`: what the Prometheus sink and the loss log need to
know about that batch. `snapshot()` freezes what the terminal view shows. `state_dict()`
holds everything accumulated as plain values; `load_state_dict()` continues from it with
the numbers of an uninterrupted tracker. Not saved: the tokens-per-second window (wall-clock
readings), the consumer lag and queue depth (readings that the next report replaces).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass

from river import stats, utils

from monitor.accuracy import AccuracyTracker
from monitor.calm_tracker import CalmTracker
from monitor.detection import DetectionTracker
from monitor.drift import detector_state, load_detector, make_detector
from monitor.river_state import load_rolling, rolling_state

__all__ = ["RunTracker", "Observation", "ViewSnapshot", "UNLABELLED", "OTHER_CLASS", "CLASS_LABEL_LIMIT",
           "CLASS_NOTICE_LIMIT", "exp_or_inf"]

UNLABELLED = "unlabelled"
OTHER_CLASS = "other"  # the metric label of a class outside the fixed set (issue 13 item 4)
CLASS_LABEL_LIMIT = 64  # without a manifest, the first 64 classes seen keep their own label
# past this many classes the learner says so once: each is kept apart for the life of the run (about 1 KB of
# memory, 0.2 KB of every checkpoint), which a truth header with a value per record (a request id) grows for ever.
# They are not folded together: CALM's revisits (ppl@sw, rec) and the report would count new classes as revisits
CLASS_NOTICE_LIMIT = 10_000
RATE_WINDOW_S = 5.0  # tokens per second over the last few seconds


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
    oracle: bool = False  # the strategy is told the class (the learner says: its strategy's `oracle`)


@dataclass(frozen=True)
class Observation:
    """What the tracker made of one step result."""

    class_name: str  # from the truth headers, or UNLABELLED
    domain: int  # the class id of the loss log
    fragment: int
    switched: bool  # a true switch (the fragment changed) at this batch
    detected: bool  # the label-free detector fired at this batch
    after_switch: bool = False  # one of the first k batches after a revisit (CALM's ppl@sw span)
    class_label: str = UNLABELLED  # the class as a metric label: a fixed set (see RunTracker.class_label)
    reference: float | None = None  # at a revisit's first batch: the mean loss of the class's previous fragment


def exp_or_inf(x: float | None) -> float | None:
    if x is None:
        return None
    return math.exp(x) if x < 700 else math.inf


class RunTracker:
    """CALM, detection and accuracy trackers, the drift detector, rolling windows and counters."""

    def __init__(self, *, run: str, strategy: str, classes=(), k: int = 10, from_fragment: int = 0,
                 total_batches: int | None = None, spark_width: int = 60, detector: str = "page-hinkley",
                 detection_tolerance: int = 10, oracle: bool = False, class_limit: int = CLASS_NOTICE_LIMIT):
        self.run, self.strategy, self.oracle = run, strategy, oracle
        self.class_limit = class_limit
        self.past_limit: str | None = None  # the first class seen past class_limit classes (the learner says it)
        self.total_batches = total_batches
        self.from_fragment = from_fragment
        self.calm = CalmTracker(k=k, from_fragment=from_fragment)
        self.detection = DetectionTracker(tolerance=detection_tolerance)
        self.accuracy = AccuracyTracker()  # classifiers only: fed by rows' predicted and revealed labels
        self._class_ids = {name: i for i, name in enumerate(classes)}
        self._manifest_classes = frozenset(classes)
        self._k = k
        self._since_switch = k  # batches since the latest true switch; the first fragment is steady
        self._revisiting = False  # the latest true switch went back to a class seen before
        self._rolling = utils.Rolling(stats.Mean, window_size=100)
        self._recent = deque(maxlen=spark_width)
        self._recent_switch = deque(maxlen=spark_width)
        self._rate_window = deque()
        self._rate_tokens = 0  # the tokens in _rate_window, kept as it changes (read once per batch)
        self._batches = 0
        self._tokens = 0
        self._last_loss = None
        self._last_key = None
        self._switches = 0
        self._lag = 0
        self._queue_depth = 0
        self._dead = Counter()
        self._started = time.monotonic()
        self._detector = make_detector(detector)
        self._detected = 0
        self._since_detected = 0
        self._class_sums: dict[str, list] = {}  # class -> [sum of losses, batches], whole stream: classes seen
        self._probe_trained: set[str] = set()  # classes whose first fragment has ended
        self._probe_best: dict[str, float] = {}
        self._fragment = [0.0, 0]  # the current fragment's summed finite loss and batches
        self._fragment_class: str | None = None
        self._fragment_means: dict[str, float] = {}  # class -> mean loss of its latest finished fragment

    def class_id(self, name: str) -> int:
        known = self._class_ids.get(name)
        if known is not None:
            return known
        if len(self._class_ids) == self.class_limit and self.past_limit is None:
            self.past_limit = name
        return self._class_ids.setdefault(name, len(self._class_ids))

    def class_label(self, name: str) -> str:
        """`name` as a metric label value from a fixed set: a class of the manifest, else "other";
        without a manifest the first CLASS_LABEL_LIMIT classes seen, then "other"."""
        if self._manifest_classes:
            return name if name in self._manifest_classes or name == UNLABELLED else OTHER_CLASS
        return name if self.class_id(name) < CLASS_LABEL_LIMIT else OTHER_CLASS

    def observe(self, result) -> Observation:
        """Account one step result."""
        truth = result.truth
        name = truth.class_name if truth else UNLABELLED
        fragment = truth.fragment if truth else 0
        domain = self.class_id(name)
        switched = self._last_key is not None and self._last_key != fragment
        reference = self._close_fragment(name) if switched else None
        self._fragment_class = name
        self._last_key = fragment
        self._switches += switched
        self._since_switch = 0 if switched else self._since_switch + 1
        if switched:
            self._revisiting = name in self._class_sums  # checked before this batch counts for the class
        self._batches += 1
        self._tokens += result.tokens
        self._last_loss = result.loss
        self._rolling.update(result.loss)
        self._recent.append(result.loss)
        self._recent_switch.append(switched)
        now = time.monotonic()
        self._rate_window.append((now, result.tokens))
        self._rate_tokens += result.tokens
        while self._rate_window and now - self._rate_window[0][0] > RATE_WINDOW_S:
            self._rate_tokens -= self._rate_window.popleft()[1]
        self.calm.update(result.loss, domain, name, fragment)
        sums = self._class_sums.setdefault(name, [0.0, 0])
        sums[0] += result.loss
        sums[1] += 1
        if math.isfinite(result.loss):
            self._fragment[0] += result.loss
            self._fragment[1] += 1
        detected = self._detect(result.loss)
        predicted, labels = getattr(result, "predicted", None), getattr(result, "labels", None)
        if predicted is not None and labels is not None:
            self.accuracy.update(predicted, labels, name)
        if truth is not None:  # scoring the detector needs the ground truth (evaluation only)
            self.detection.update(self._batches - 1, fragment, detected)
        return Observation(class_name=name, domain=domain, fragment=fragment, switched=switched, detected=detected,
                           after_switch=self._revisiting and self._since_switch < self._k,
                           class_label=self.class_label(name), reference=reference)

    def _close_fragment(self, entering: str) -> float | None:
        """At a switch into `entering`: keep the mean loss of the fragment that ended (its class
        is the previous batch's) and return the one `entering` had last time (None: first visit)."""
        total, count = self._fragment
        if count and self._fragment_class is not None:
            self._fragment_means[self._fragment_class] = total / count
        self._fragment = [0.0, 0]
        return self._fragment_means.get(entering)

    @property
    def has_detector(self) -> bool:
        """Whether a label-free detector runs (not --detector none: no detection to score)."""
        return self._detector is not None

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

    def probed(self, row: dict) -> dict[str, float]:
        """A probe evaluation; returns the forgetting of each class that has one.

        Per class, forgetting = current held-out loss minus the best (lowest) held-out loss
        it had at an earlier evaluation after it was first learned (Chaudhry et al.'s
        per-class forgetting, with the sign flipped for losses). Classifier probes score
        accuracy (row["unit"]): forgetting = best (highest) accuracy minus current."""
        if row.get("ended_class"):
            self._probe_trained.add(row["ended_class"])
        sign = -1.0 if row.get("unit") == "accuracy" else 1.0  # as a loss: lower is better
        forgetting = {}
        for name, value in row["scores"].items():
            loss = sign * value
            best = self._probe_best.get(name)
            if name in self._probe_trained and best is not None:
                forgetting[name] = max(0.0, loss - best)
            if name in self._probe_trained:
                self._probe_best[name] = loss if best is None else min(best, loss)
        return forgetting

    def set_lag(self, lag_by_partition: dict) -> None:
        self._lag = sum(lag_by_partition.values())

    def set_queue_depth(self, depth: int) -> None:
        self._queue_depth = depth

    def dead_letter(self, reason: str, count: int = 1) -> None:
        self._dead[reason] += count

    @property
    def dead_letters(self) -> dict:
        return dict(self._dead)

    @property
    def switches(self) -> int:
        """True switches so far in the run (a resumed tracker's include the checkpoint's)."""
        return self._switches

    @property
    def detected_switches(self) -> int:
        return self._detected

    @property
    def batches_since_switch(self) -> int:
        """Batches since the latest true switch (0 at the switch's batch)."""
        return self._since_switch

    @property
    def batches_since_detected(self) -> int:
        return self._since_detected

    def class_loss_mean(self, name: str | None = None) -> float | None:
        """Mean loss of class `name` (None: of every class) over the evaluated span, fragments >=
        from_fragment: the span of ppl@sw, of the view and of the report; None before it has a batch there."""
        return self.calm.loss_mean(None if name is None else self.class_id(name))

    def rolling_perplexity(self) -> float | None:
        """exp of the mean loss of the last 100 batches (None before the first)."""
        return exp_or_inf(self._rolling.get()) if self._batches else None

    def tokens_per_second(self) -> float:
        if len(self._rate_window) < 2:
            return 0.0
        span = self._rate_window[-1][0] - self._rate_window[0][0]
        tokens = self._rate_tokens - self._rate_window[0][1]  # the first entry's tokens predate the span
        return tokens / span if span > 0 else 0.0

    def snapshot(self) -> ViewSnapshot:
        snap = self.calm.snapshot()
        return ViewSnapshot(
            run=self.run, strategy=self.strategy, batches=self._batches,
            total_batches=self.total_batches, last_loss=self._last_loss,
            rolling_ppl=self.rolling_perplexity(), recent_losses=tuple(self._recent),
            recent_switches=tuple(self._recent_switch),
            current_class=snap["live"].get("current_class"),
            overall={key: snap[key] for key in ("ppl", "ppl@sw", "rec")},
            per_class={cls: {key: v[key] for key in ("ppl", "ppl@sw", "rec", "n_batches")}
                       for cls, v in snap["per_class"].items()},
            from_fragment=self.from_fragment, switches=self._switches, detected_switches=self._detected,
            tokens_per_s=self.tokens_per_second(), lag=self._lag,
            queue_depth=self._queue_depth, dead_letters=dict(self._dead),
            elapsed_s=time.monotonic() - self._started, accuracy=self.accuracy.snapshot(), oracle=self.oracle,
        )

    _SCALARS = ("_batches", "_tokens", "_last_loss", "_last_key", "_switches", "_detected", "_since_detected",
                "_since_switch", "_revisiting", "past_limit")

    def state_dict(self) -> dict:
        """Everything accumulated so far, as plain values (torch.load(weights_only=True) reads them)."""
        return {
            **{name.lstrip("_"): getattr(self, name) for name in self._SCALARS},
            "class_ids": [[name, i] for name, i in self._class_ids.items()],
            "rolling": rolling_state(self._rolling),
            "recent": list(self._recent), "recent_switch": list(self._recent_switch),
            "dead": [[reason, count] for reason, count in self._dead.items()],
            "elapsed_s": time.monotonic() - self._started,
            "detector": detector_state(self._detector),
            "class_sums": [[name, list(sums)] for name, sums in self._class_sums.items()],
            "probe_trained": sorted(self._probe_trained),
            "probe_best": [[name, best] for name, best in self._probe_best.items()],
            "fragment": list(self._fragment), "fragment_class": self._fragment_class,
            "fragment_means": [[name, mean] for name, mean in self._fragment_means.items()],
            "calm": self.calm.state_dict(), "detection": self.detection.state_dict(),
            "accuracy": self.accuracy.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (the tracker was built with the same settings)."""
        for name in self._SCALARS:
            key = name.lstrip("_")
            older = {"since_switch": self._k, "revisiting": False, "past_limit": None}  # (written before these)
            setattr(self, name, state.get(key, older[key]) if key in older else state[key])
        self._class_ids = {name: i for name, i in state["class_ids"]}
        load_rolling(self._rolling, state["rolling"])
        self._recent = deque(state["recent"], maxlen=self._recent.maxlen)
        self._recent_switch = deque(state["recent_switch"], maxlen=self._recent_switch.maxlen)
        self._rate_window, self._rate_tokens = deque(), 0
        self._dead = Counter({reason: count for reason, count in state["dead"]})
        self._started = time.monotonic() - state["elapsed_s"]
        self._detector = load_detector(state["detector"])
        self._class_sums = {name: list(sums) for name, sums in state["class_sums"]}
        self._probe_trained = set(state["probe_trained"])
        self._probe_best = {name: best for name, best in state["probe_best"]}
        self._fragment = list(state.get("fragment", [0.0, 0]))  # states written before these existed lack them
        self._fragment_class = state.get("fragment_class")
        self._fragment_means = {name: mean for name, mean in state.get("fragment_means", [])}
        self.calm.load_state_dict(state["calm"])
        self.detection.load_state_dict(state["detection"])
        self.accuracy.load_state_dict(state["accuracy"])
