"""Held-out probe utterances for classifier runs: accuracy per class, and the representations DMI needs.

The learner scores the probe between steps, exactly when it would score a language
model's probe split (start, true switches, every N batches, and once more at the end
of the run). Each evaluation returns the accuracy of every class (language or domain)
on its held-out utterances, predicting among the labels the model has learned so far.
The evaluations DMI reads (the one that ends each class's first fragment, and the run's
last: streamer.probe.ProbeScheduler says which) also save the pooled encoder representations
of all probe utterances with their class and label to `<run>/probe_features/batch-<batch>.npz`;
monitor.dmi clusters them.
Eval mode, no gradient, the training flag restored: nothing the strategy owns changes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from monitor.dmi import FEATURES_DIR
from streamer.utterance_batching import UtteranceBatcher

__all__ = ["ClassifierProbe", "load_classifier_probe"]


class ClassifierProbe:
    """`score(model)` -> ({class: accuracy}, seconds); `progress()` gives (batches learned, labels known)."""

    unit = "accuracy"
    saves_features = True  # ProbeScheduler says which probes save theirs (score's `save_features`)

    def __init__(self, examples: dict[str, list[tuple[str, str]]], batcher: UtteranceBatcher, out_dir: Path,
                 progress: Callable[[], tuple[int, int | None]], chunk: int = 64):
        self.chunk = chunk
        self._vocabulary = batcher.vocabulary
        self._progress = progress
        self._out = Path(out_dir) / FEATURES_DIR
        rows = [(name, text, label) for name, items in sorted(examples.items()) for text, label in items]
        self._classes = np.array([name for name, _, _ in rows], dtype=str)
        self._labels = np.array([label for _, _, label in rows], dtype=str)
        self._inputs = torch.tensor([batcher.tokenize(text) for _, text, _ in rows], dtype=torch.long).view(
            len(rows), batcher.max_length)

    @property
    def classes(self) -> list[str]:
        return sorted(set(self._classes.tolist()))

    @torch.no_grad()
    def score(self, model, save_features: bool = True) -> tuple[dict[str, float], float]:
        """({class: accuracy}, seconds); with `save_features`, the probe utterances' representations are
        written to probe_features/batch-<batch>.npz (DMI's stages)."""
        started = time.perf_counter()
        batch, known = self._progress()
        known = known or 0
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        try:
            pooled, predicted = [], []
            for start in range(0, len(self._inputs), self.chunk):
                features, _ = model.features(self._inputs[start:start + self.chunk].to(device))
                pooled.append(features.float())
                if known:
                    predicted.append(model.classify(features)[:, :known].argmax(-1))
            # GPU sync point: one copy of the representations and predictions per evaluation
            features = torch.cat(pooled).cpu().numpy() if pooled else np.zeros((0, 0), np.float32)
            guesses = torch.cat(predicted).cpu().numpy() if predicted else np.full(len(self._labels), -1)
        finally:
            model.train(was_training)
        names = self._vocabulary.names()[:known]  # labels the model has learned: the only ones it can predict
        ids = {name: i for i, name in enumerate(names)}
        correct = guesses == np.array([ids.get(label, -2) for label in self._labels])
        scores = {name: float(correct[self._classes == name].mean()) for name in self.classes}
        if not save_features:
            return scores, time.perf_counter() - started
        self._out.mkdir(parents=True, exist_ok=True)
        np.savez(self._out / f"batch-{batch:08d}.npz", features=features, classes=self._classes,
                 labels=self._labels, predicted=guesses, vocabulary=np.array(names, dtype=str), batch=batch)
        return scores, time.perf_counter() - started


def load_classifier_probe(manifest: dict | None, batcher: UtteranceBatcher, out_dir: Path,
                          progress: Callable[[], tuple[int, int | None]]) -> ClassifierProbe | None:
    """The utterance probe split the producer saved (one utterance per line, labels in the
    manifest); None when the manifest has none. A class whose lines and labels disagree is skipped."""
    probe = (manifest or {}).get("probe") or {}
    directory = probe.get("dir")
    if not directory:
        return None
    examples = {}
    for name, entry in (probe.get("classes") or {}).items():
        path = Path(directory) / entry.get("file", "")
        labels = entry.get("labels")
        if not labels or not path.is_file():
            continue
        texts = path.read_text(encoding="utf-8").split("\n")
        if len(texts) == len(labels):
            examples[name] = list(zip(texts, labels))
    return ClassifierProbe(examples, batcher, out_dir, progress) if examples else None
