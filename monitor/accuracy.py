"""Prequential accuracy and macro-F1 of a classifier run, from its loss-log rows (torch-free).

A classifier's loss-log line carries `predicted` and `labels`: one label id per
utterance of the batch, predicted before the model learned from that batch. Every
utterance counts once, in stream order:

- accuracy: correct predictions / utterances;
- macro-F1: river's MacroF1, the mean over the labels that occur (as truth or as a
  prediction) of each label's F1, a label with no correct prediction counting 0;
- rolling: both over the last `window` utterances;
- per class: the same over the utterances of batches whose truth class (the batch's
  majority language or domain, from headers) is that class. With synchronised
  schedules every utterance of a batch has that class; with independent streams a
  batch mixes classes and the batch's majority class stands for all its rows.

The same tracker runs live (monitor.live) and offline (`accuracy_metrics`), so both
give identical numbers on the same run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from river import metrics, utils

from monitor.river_state import confusion_state, load_confusion, load_rolling, rolling_state

__all__ = ["AccuracyTracker", "accuracy_metrics", "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 1000  # utterances


class _Scores:
    """Accuracy and macro-F1 over everything seen."""

    def __init__(self):
        self.utterances = 0
        self.accuracy = metrics.Accuracy()
        self.macro_f1 = metrics.MacroF1()

    def update(self, label: int, predicted: int) -> None:
        self.utterances += 1
        self.accuracy.update(label, predicted)
        self.macro_f1.update(label, predicted)

    def state_dict(self) -> dict:
        return {"utterances": self.utterances, "accuracy": confusion_state(self.accuracy),
                "macro_f1": confusion_state(self.macro_f1)}

    def load_state_dict(self, state: dict) -> None:
        self.utterances = state["utterances"]
        load_confusion(self.accuracy, state["accuracy"])
        load_confusion(self.macro_f1, state["macro_f1"])

    def snapshot(self) -> dict:
        seen = self.utterances > 0
        return {"utterances": self.utterances, "accuracy": self.accuracy.get() if seen else None,
                "macro_f1": self.macro_f1.get() if seen else None}


class AccuracyTracker:
    """Overall, rolling and per-class prequential accuracy and macro-F1."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        if window < 1:
            raise ValueError(f"window must be at least 1 utterance, got {window}")
        self.window = window
        self._overall = _Scores()
        self._rolling_accuracy = utils.Rolling(metrics.Accuracy, window_size=window)
        self._rolling_f1 = utils.Rolling(metrics.MacroF1, window_size=window)
        self._per_class: dict[str, _Scores] = {}
        self._batches = 0

    @property
    def utterances(self) -> int:
        return self._overall.utterances

    def update(self, predicted: Sequence[int], labels: Sequence[int], class_name: str) -> None:
        """One batch: predicted and revealed label ids, row by row, and the batch's truth class."""
        if len(predicted) != len(labels):
            raise ValueError(f"{len(predicted)} predictions for {len(labels)} labels")
        scores = self._per_class.setdefault(class_name, _Scores())
        for guess, label in zip(predicted, labels):
            self._overall.update(label, guess)
            self._rolling_accuracy.update(label, guess)
            self._rolling_f1.update(label, guess)
            scores.update(label, guess)
        self._batches += 1

    def state_dict(self) -> dict:
        """Counts, confusion matrices and rolling windows as plain values (see :meth:`load_state_dict`)."""
        return {
            "window": self.window, "batches": self._batches, "overall": self._overall.state_dict(),
            "rolling_accuracy": rolling_state(self._rolling_accuracy), "rolling_f1": rolling_state(self._rolling_f1),
            "per_class": [[name, scores.state_dict()] for name, scores in self._per_class.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; the window must match."""
        if state["window"] != self.window:
            raise ValueError(f"saved accuracy window of {state['window']} utterances, this one {self.window}")
        self._batches = state["batches"]
        self._overall = _Scores()
        self._overall.load_state_dict(state["overall"])
        load_rolling(self._rolling_accuracy, state["rolling_accuracy"])
        load_rolling(self._rolling_f1, state["rolling_f1"])
        self._per_class = {}
        for name, values in state["per_class"]:
            self._per_class[name] = _Scores()
            self._per_class[name].load_state_dict(values)

    def snapshot(self) -> dict | None:
        """The metrics so far; None before any prediction (a language-model run)."""
        if not self.utterances:
            return None
        rolling = min(self.window, self.utterances)
        return {
            **self._overall.snapshot(), "batches": self._batches,
            "rolling": {"window": self.window, "utterances": rolling,
                        "accuracy": self._rolling_accuracy.get(), "macro_f1": self._rolling_f1.get()},
            "per_class": {name: scores.snapshot() for name, scores in self._per_class.items()},
        }


def accuracy_metrics(records: Iterable[Mapping], window: int = DEFAULT_WINDOW) -> dict | None:
    """The tracker's snapshot over a loss log's rows; None when no row has predictions."""
    tracker = AccuracyTracker(window)
    for record in records:
        if record.get("predicted") is not None and record.get("labels") is not None:
            tracker.update(record["predicted"], record["labels"], record["domain_name"])
    return tracker.snapshot()
