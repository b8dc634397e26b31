"""Turn decoded records into b x w byte windows, per stream, in arrival order.

Each of the b streams (stream ids 0..b-1, producers.wire.stream_id) keeps a token buffer (UTF-8 bytes by
default; a model's tokenizer otherwise); a batch is emitted when every stream
holds w + 1 unconsumed tokens (w inputs and the next token as the last target). Evaluation truth rides beside the batch, never inside it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from monitor.results import BatchTruth
from streamer.offsets import OffsetTracker
from streamer.strategies.base import Batch
from producers.wire import Record, Truth, stream_id

__all__ = ["ReadyBatch", "Batcher", "vote", "truth_to_plain", "truth_from_plain"]


def vote(votes: Mapping[tuple[str, int], int]) -> BatchTruth | None:
    """From {(class, fragment): votes}: the class with most votes (independent streams mix
    classes), then its largest fragment; ties go to the earlier fragment."""
    if not votes:
        return None
    if len(votes) == 1:  # the common batch: every row in one fragment
        return BatchTruth(*next(iter(votes)))
    by_class: Counter = Counter()
    for (class_name, _), count in votes.items():
        by_class[class_name] += count
    winner = max(by_class.items(), key=lambda kv: (kv[1], -min(f for c, f in votes if c == kv[0])))[0]
    fragment = max((f for c, f in votes if c == winner), key=lambda f: (votes[(winner, f)], -f))
    return BatchTruth(winner, fragment)


@dataclass(frozen=True)
class ReadyBatch:
    batch: Batch
    truth: BatchTruth | None
    commit: dict  # {(topic, partition): next offset to commit} once this batch is learned
    # ((class, fragment, tokens), ...): what `truth` was voted from (Batcher._votes); ranks add up every
    # rank's for the global batch's truth (streamer.rank_agreement.global_truth)
    votes: tuple = ()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8")


def truth_to_plain(truth: Truth | None) -> tuple | None:
    """A wire Truth as a tuple of plain values (checkpoints hold no Python objects)."""
    if truth is None:
        return None
    return (truth.class_name, truth.fragment, truth.position, truth.produced, truth.label)


def truth_from_plain(values) -> Truth | None:
    return None if values is None else Truth(*values)


@dataclass
class _Stream:
    data: bytearray | list = field(default_factory=bytearray)  # bytes, or token ids from a tokenizer
    # (end position in `data` coordinates, truth or None, offset handle) per record
    spans: deque = field(default_factory=deque)
    base: int = 0  # absolute position of data[0]


class Batcher:
    """Cuts b x w batches; stream id first_stream + n owns row n for the run's life."""

    def __init__(self, streams: int, window: int, device: torch.device | str = "cpu", encode=None,
                 first_stream: int = 0):
        """`encode(text)` gives a record's token ids (bytes or a list of ints); UTF-8 bytes by default.
        `first_stream`: the stream id of row 0 (a distributed learner's rank owns ids first_stream ..
        first_stream + streams - 1; streamer.distributed)."""
        self.first_stream = first_stream
        self.streams = streams
        self.window = window
        self.device = torch.device(device)
        self.encode = encode or _utf8
        self._bytes = isinstance(self.encode("a"), (bytes, bytearray))
        self._rows: dict[str, int] = {}
        self._buffers = [_Stream(bytearray() if self._bytes else []) for _ in range(streams)]
        self._short = streams  # rows holding fewer than window + 1 tokens (ready() is asked after every record)
        self.offsets = OffsetTracker()
        self._carried: dict = {}  # partition -> the rows whose records it has carried (since this start)

    def _row(self, stream: str) -> int | None:
        """Stream id first_stream + n (producers.wire.stream_id: "0", "1", ...) owns row n; None for an
        id outside them and for a key that is not a stream id (never a row taken from another stream)."""
        known = self._rows.get(stream)  # the ids seen so far (checked once, when first seen)
        if known is not None:
            return known
        row = stream_id(stream)
        if row is None:
            return None
        row -= self.first_stream
        return row if 0 <= row < self.streams else None

    def accepts(self, stream: str) -> bool:
        return self._row(stream) is not None

    def add(self, record: Record, tp=None, offset: int | None = None) -> None:
        """Append a record's bytes to its stream; caller checks `accepts` first (else ValueError)."""
        row = self._row(record.stream)
        if row is None:
            raise ValueError(f"stream {record.stream[:40]!r} has no row: not a stream id below {self.streams}")
        self._rows[record.stream] = row
        buf = self._buffers[row]
        short = len(buf.data) <= self.window
        buf.data += self.encode(record.text)
        self._short -= short and len(buf.data) > self.window
        handle = None if tp is None else (tp, offset)
        if handle is not None:
            self.offsets.seen(tp, offset, row)
            self._carried.setdefault(tp, set()).add(row)
        buf.spans.append((buf.base + len(buf.data), record.truth, handle))

    def admit(self, tp, offset: int, stream: str | None, keep_windows: int) -> str:
        """Whether to take the record read at `offset` of partition `tp`, of `stream` (None: undecodable):
        OffsetTracker.admit, a stream being over when it holds more than `keep_windows` windows (at least
        2): its further records are left in Kafka until `rewinds` finds it room."""
        row = None if stream is None else self._row(stream)
        over = row is not None and len(self._buffers[row].data) > self._kept(keep_windows)
        return self.offsets.admit(tp, offset, row, over)

    def rewinds(self, keep_windows: int, apply: bool = True) -> dict:
        """{partition: offset} to read again from: those that skipped a stream now holding half of
        `keep_windows` windows or less (OffsetTracker.rewinds; not with `apply`: only which)."""
        room = self._kept(keep_windows) // 2
        return self.offsets.rewinds(lambda row: len(self._buffers[row].data) <= room, apply)

    def _kept(self, keep_windows: int) -> int:
        """The most tokens a stream keeps while a batch waits for another: `keep_windows` windows, at least 2."""
        return max(keep_windows, 2) * self.window

    def skipped_streams(self, tp) -> tuple[int, ...]:
        """The stream ids whose records in partition `tp` are left in Kafka now (admit)."""
        return tuple(sorted(self.first_stream + row for row in self.offsets.skipping(tp)))

    def ready(self) -> bool:
        return not self._short and len(self._rows) == self.streams

    def short_streams(self) -> tuple[int, ...]:
        """The stream ids the next batch waits for: those holding a window or less (() while one can be cut)."""
        if self.ready():
            return ()
        return tuple(self.first_stream + row for row, buf in enumerate(self._buffers) if len(buf.data) <= self.window)

    def silent_streams(self) -> tuple[int, ...]:
        """The stream ids the next batch waits for that have sent no record since this start, while another
        stream holds more than a window (a producer of fewer streams than --streams); () otherwise."""
        if self.ready() or self._short == self.streams:
            return ()
        seen = set(self._rows.values())
        return tuple(self.first_stream + row for row, buf in enumerate(self._buffers)
                     if row not in seen and len(buf.data) <= self.window)

    def far_ahead(self, windows: int) -> bool:
        """Whether a stream holds more than `windows` windows (at least 1): the others' fall behind."""
        enough = max(windows, 1) * self.window
        return any(len(buf.data) > enough for buf in self._buffers)

    def ahead(self, windows: int) -> set:
        """The partitions not worth reading now: while the next batch waits for a stream that is short
        (a window or less, or not seen yet), those that have carried records (since this start) only of
        streams holding more than `windows` windows (at least 1: a short stream is never one of them).
        Without it a backlog's partitions were read whole, one after another, into their streams'
        buffers (and the checkpoint) before the first batch could be cut (aiokafka returns one
        partition's records, then the next's). None while a batch can be cut."""
        if self.ready():
            return set()
        enough = max(windows, 1) * self.window
        full = {row for row, buf in enumerate(self._buffers) if len(buf.data) > enough}
        return {tp for tp, rows in self._carried.items() if rows <= full}

    def _count_short(self) -> None:
        self._short = sum(len(b.data) <= self.window for b in self._buffers)

    def pop(self) -> ReadyBatch:
        """Cut one b x w batch; call only when `ready()`. The grid is cut with numpy: on the fetch side,
        every torch call hands the GIL to the step thread and waits to get it back."""
        w = self.window
        if self._bytes:
            grid = np.frombuffer(b"".join([b.data[: w + 1] for b in self._buffers]), dtype=np.uint8)
        else:
            grid = np.array([b.data[: w + 1] for b in self._buffers], dtype=np.int64)
        grid = grid.reshape(self.streams, w + 1)
        votes = self._votes()
        for row, buf in enumerate(self._buffers):
            del buf.data[:w]
            buf.base += w
            self._release(buf, row)
        self._count_short()
        inputs, targets = torch.from_numpy(grid[:, :w].astype(np.int64)), torch.from_numpy(grid[:, 1:].astype(np.int64))
        if self.device.type != "cpu":
            inputs, targets = inputs.to(self.device), targets.to(self.device)
        batch = Batch(inputs=inputs, targets=targets)
        return ReadyBatch(batch=batch, truth=vote(votes), commit=self.offsets.commit_positions(),
                          votes=tuple((*key, tokens) for key, tokens in votes.items()))

    def state_dict(self) -> dict:
        """The carry-over: each row's unconsumed tokens and record spans, the key-to-row map, the offsets.
        A copy: the fetch side goes on adding while a checkpoint is written."""
        return {
            "rows": dict(self._rows),
            "buffers": [{"data": bytes(b.data) if self._bytes else list(b.data), "base": b.base,
                         "spans": [(end, truth_to_plain(truth), None if handle is None else (list(handle[0]), handle[1]))
                                   for end, truth, handle in b.spans]} for b in self._buffers],
            "offsets": self.offsets.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._rows = dict(state["rows"])
        self._buffers = []
        for saved in state["buffers"]:
            spans = deque((end, truth_from_plain(truth), None if handle is None else (tuple(handle[0]), handle[1]))
                          for end, truth, handle in saved["spans"])
            data = bytearray(saved["data"]) if self._bytes else list(saved["data"])
            self._buffers.append(_Stream(data, spans, saved["base"]))
        self._count_short()
        self.offsets.load_state_dict(state["offsets"])

    def _votes(self) -> dict:
        """{(class, fragment): tokens of this batch's rows that carry it}, for `vote`."""
        votes: dict = {}
        window = self.window
        for buf in self._buffers:
            start = buf.base
            end = start + window
            span_start = start  # the oldest span may begin before `base`
            for span_end, truth, _ in buf.spans:
                if truth is not None:
                    overlap = (span_end if span_end < end else end) - (span_start if span_start > start else start)
                    if overlap > 0:
                        key = (truth.class_name, truth.fragment)
                        votes[key] = votes.get(key, 0) + overlap
                if span_end >= end:
                    break
                span_start = span_end
        return votes

    def _release(self, buf: _Stream, row: int) -> None:
        """Forget records whose bytes are all consumed (position <= base)."""
        while buf.spans and buf.spans[0][0] <= buf.base:
            _, _, handle = buf.spans.popleft()
            if handle is not None:
                self.offsets.finish(*handle, row)
