"""Turn labelled utterance records into classifier batches: b utterances per batch, one per row.

Rows are filled in arrival order across all stream keys (any number of keys; the
synchronised utterance producer interleaves its b streams, so a batch holds one
utterance of each). Each text is tokenized by the model's `encode`, cut to
`max_length` ids and padded with the model's pad id, so every row has the same
shape and replay memories can stack them. The `streamer.label` header is the
revealed supervision: it becomes the row's target id in a label vocabulary that
grows as labels appear; class and fragment stay evaluation truth beside the batch.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass

import torch

from monitor.results import BatchTruth
from streamer.batching import ReadyBatch, truth_from_plain, truth_to_plain, vote
from streamer.offsets import OffsetTracker
from streamer.strategies.base import Batch
from producers.wire import Record

__all__ = ["LabelVocabulary", "UtteranceBatcher", "pad_ids", "majority_truth"]


class LabelVocabulary:
    """Label name -> id in order of first appearance, at most `capacity` labels (None: no limit).

    Written by the fetch side, read by probes in the worker thread: changes hold a lock."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, label: str) -> int | None:
        return self._ids.get(label)

    @property
    def full(self) -> bool:
        return self.capacity is not None and len(self._ids) >= self.capacity

    def add(self, label: str) -> int | None:
        """The label's id, adding it when new; None when it is new and the vocabulary is full."""
        with self._lock:
            if label not in self._ids:
                if self.capacity is not None and len(self._ids) >= self.capacity:
                    return None
                self._ids[label] = len(self._ids)
            return self._ids[label]

    def names(self) -> tuple[str, ...]:
        """All labels, in id order."""
        with self._lock:
            return tuple(self._ids)

    def load_names(self, names) -> None:
        """Restore the labels of a checkpoint, in id order."""
        with self._lock:
            self._ids = {name: i for i, name in enumerate(names)}


def pad_ids(ids, pad_id: int, max_length: int) -> list[int]:
    """Token ids cut to max_length and padded with pad_id to exactly max_length."""
    ids = list(ids)[:max_length]
    return ids + [pad_id] * (max_length - len(ids))


def majority_truth(truths) -> BatchTruth | None:
    """The class with most utterances, then its largest fragment (as streamer.batching, one vote
    per utterance instead of per token). Ties go to the class, then the fragment, seen earliest."""
    return vote(Counter((t.class_name, t.fragment) for t in truths if t is not None))


@dataclass(frozen=True)
class _Pending:
    ids: list[int]  # padded token ids
    label: int
    labels_known: int  # vocabulary size right after this record was added
    truth: object  # wire Truth (evaluation only)
    handle: tuple | None  # (tp, offset) for commits


class UtteranceBatcher:
    """The learner's batcher interface (accepts, rejects, add, ready, pop, offsets) for classifiers."""

    def __init__(self, rows: int, encode, *, pad_id: int, max_length: int, max_labels: int | None = None,
                 device: torch.device | str = "cpu"):
        if rows < 1 or max_length < 2:
            raise ValueError(f"need rows >= 1 and max_length >= 2, got {rows} and {max_length}")
        self.rows = rows
        self.encode = encode
        self.pad_id = pad_id
        self.max_length = max_length
        self.device = torch.device(device)
        self.vocabulary = LabelVocabulary(max_labels)
        self.offsets = OffsetTracker()
        self._pending: deque[_Pending] = deque()

    def accepts(self, stream: str) -> bool:
        """Any stream key: rows are filled in arrival order, not owned by keys."""
        return True

    def rejects(self, record: Record) -> tuple[str, str] | None:
        """(reason, detail) for a record that cannot be learned: the dead-letter path, never a crash."""
        label = record.truth.label if record.truth is not None else None
        if label is None:
            return "missing_label", "a classifier run needs the streamer.label header on every record"
        if self.vocabulary.get(label) is None and self.vocabulary.full:
            return "label_overflow", f"label {label!r} beyond the head's {self.vocabulary.capacity} labels (max_labels)"
        return None

    def tokenize(self, text: str) -> list[int]:
        return pad_ids(self.encode(text), self.pad_id, self.max_length)

    def add(self, record: Record, tp=None, offset: int | None = None) -> None:
        """Queue one utterance; the caller checks `rejects` first (a rejected record raises ValueError)."""
        problem = self.rejects(record)
        if problem is not None:
            raise ValueError(f"record of stream {record.stream!r} cannot be learned: {problem[1]}")
        label = self.vocabulary.add(record.truth.label)
        handle = None if tp is None else (tp, offset)
        if handle is not None:
            self.offsets.seen(tp, offset)
        self._pending.append(_Pending(self.tokenize(record.text), label, len(self.vocabulary), record.truth, handle))

    def ready(self) -> bool:
        return len(self._pending) >= self.rows

    def ahead(self, windows: int) -> set:
        """No partition is ahead (Batcher.ahead): any stream's utterances make a batch, none waits for one."""
        return set()

    def short_streams(self) -> tuple[int, ...]:
        """None: any stream's utterances fill a batch (Batcher.short_streams)."""
        return ()

    def far_ahead(self, windows: int) -> bool:
        return False

    def pop(self) -> ReadyBatch:
        """The next b utterances as one batch; call only when `ready()`."""
        items = [self._pending.popleft() for _ in range(self.rows)]
        inputs = torch.tensor([item.ids for item in items], dtype=torch.long)
        targets = torch.tensor([item.label for item in items], dtype=torch.long)
        for item in items:
            if item.handle is not None:
                self.offsets.finish(*item.handle)
        batch = Batch(inputs=inputs.to(self.device), targets=targets.to(self.device),
                      labels_known=items[-1].labels_known)
        return ReadyBatch(batch=batch, truth=majority_truth(item.truth for item in items),
                          commit=self.offsets.commit_positions())

    def state_dict(self) -> dict:
        """The carry-over: utterances waiting for a batch, the label vocabulary, the offsets."""
        return {
            "labels": list(self.vocabulary.names()),
            "pending": [(list(item.ids), item.label, item.labels_known, truth_to_plain(item.truth),
                         None if item.handle is None else (list(item.handle[0]), item.handle[1]))
                        for item in self._pending],
            "offsets": self.offsets.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.vocabulary.load_names(state["labels"])
        self._pending = deque(
            _Pending(list(ids), label, known, truth_from_plain(truth),
                     None if handle is None else (tuple(handle[0]), handle[1]))
            for ids, label, known, truth, handle in state["pending"])
        self.offsets.load_state_dict(state["offsets"])
