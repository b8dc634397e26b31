"""The CALM stream schedule: fragments, seeded class order, b parallel streams.

Fragment lengths follow the CALM library: drawn in chunks of b x w tokens
from a truncated exponential (loc 0.1 s, scale s, s = lambda / (b w)),
rounded, at least one chunk. Classes come in seeded random order and a class
never follows itself. Tokens are UTF-8 bytes; each stream's slice of a
fragment is exactly n_batches x w bytes (cut at a character boundary and
padded with spaces), so every batch belongs to exactly one fragment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from streamer.wire import Record, Truth

__all__ = ["CalmSchedule", "ScheduleError", "plan_fragments", "class_order", "build_stream"]


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class CalmSchedule:
    n_fragments: int = 100
    mean_tokens: int = 10_000  # lambda: mean fragment length in tokens over all b streams
    streams: int = 10  # b
    window: int = 20  # w
    record_tokens: int = 20  # bytes of text per record, cut at a character boundary
    seed: int = 0

    def validate(self) -> None:
        for name in ("n_fragments", "mean_tokens", "streams", "window", "record_tokens"):
            if getattr(self, name) < 1:
                raise ScheduleError(f"{name} must be at least 1, got {getattr(self, name)}")


def plan_fragments(schedule: CalmSchedule, rng: np.random.Generator) -> list[int]:
    """Fragment lengths in batches (chunks of b x w tokens)."""
    scale = schedule.mean_tokens / (schedule.streams * schedule.window)
    # truncated exponential on [loc, loc + 10 s], as in the CALM library
    u = rng.random(schedule.n_fragments)
    width = 1.0 - np.exp(-10.0)
    draws = 0.1 * scale - scale * np.log1p(-u * width)
    return [int(n) for n in np.maximum(1, np.rint(draws))]


def class_order(classes: list[str], n_fragments: int, rng: np.random.Generator) -> list[str]:
    """Balanced, shuffled, with no class twice in a row."""
    if len(classes) < 2 and n_fragments > 1:
        raise ScheduleError("a CALM stream needs at least two classes")
    order = [classes[i % len(classes)] for i in range(n_fragments)]
    rng.shuffle(order)
    for _ in range(100 * n_fragments):
        repeats = [i for i in range(1, len(order)) if order[i] == order[i - 1]]
        if not repeats:
            return order
        i = repeats[0]
        j = int(rng.integers(len(order)))
        order[i], order[j] = order[j], order[i]
    raise ScheduleError("could not order the classes without repeats; use more classes or fragments")


def _take(text: str, start: int, budget: int) -> tuple[str, int]:
    """Longest run of characters from `start` whose UTF-8 size fits `budget`."""
    end, used = start, 0
    while end < len(text):
        size = len(text[end].encode("utf-8"))
        if used + size > budget:
            break
        used += size
        end += 1
    return text[start:end], end


class _Column:
    """One stream's share of a class's text, read on and wrapped when exhausted."""

    def __init__(self, text: str):
        self.text, self.cursor, self.wraps = text, 0, 0

    def read(self, budget: int) -> tuple[str, int, int]:
        chunks, start = [], self.cursor
        while budget > 0:
            piece, end = _take(self.text, self.cursor, budget)
            if not piece:
                if self.cursor < len(self.text):  # a character wider than the budget
                    break
                self.cursor, self.wraps = 0, self.wraps + 1
                continue
            chunks.append(piece)
            budget -= len(piece.encode("utf-8"))
            self.cursor = end
        return "".join(chunks) + " " * budget, start, self.cursor


def _records(text: str, stream: str, position: int, size: int, truth: dict) -> list[tuple[int, Record]]:
    out, cursor = [], 0
    while cursor < len(text):
        piece, end = _take(text, cursor, size)
        if not piece:  # a single character wider than `size` bytes
            piece, end = text[cursor], cursor + 1
        out.append((position, Record(stream, piece, Truth(position=position, **truth))))
        position += len(piece.encode("utf-8"))
        cursor = end
    return out


def build_stream(corpus: dict[str, str], schedule: CalmSchedule, produced: float = 0.0):
    """Return (records in production order, manifest dict)."""
    schedule.validate()
    classes = sorted(corpus)
    rng = np.random.default_rng(schedule.seed)
    lengths = plan_fragments(schedule, rng)
    order = class_order(classes, schedule.n_fragments, rng)
    b, w = schedule.streams, schedule.window
    columns = {}
    for name in classes:
        text = corpus[name]
        if not text:
            raise ScheduleError(f"class {name!r} has no text")
        size = -(-len(text) // b)
        columns[name] = [_Column(text[i * size:(i + 1) * size] or text) for i in range(b)]
    timed: list[tuple[int, int, Record]] = []
    fragments, batch = [], 0
    for index, (name, n_batches) in enumerate(zip(order, lengths)):
        spans = []
        for s in range(b):
            text, start, end = columns[name][s].read(n_batches * w)
            truth = {"class_name": name, "fragment": index, "produced": produced}
            for position, record in _records(text, str(s), batch * w, schedule.record_tokens, truth):
                timed.append((position // w, s, record))
            spans.append([start, end])
        fragments.append({
            "index": index, "class": name, "n_batches": n_batches, "start_batch": batch,
            "tokens": [batch * w, (batch + n_batches) * w], "char_spans": spans,
        })
        batch += n_batches
    for s in range(b):  # one closing byte so the last window has its last target
        last = fragments[-1]
        timed.append((batch, s, Record(str(s), "\n", Truth(last["class"], last["index"], batch * w, produced))))
    timed.sort(key=lambda item: (item[0], item[1]))
    records = [record for _, _, record in timed]
    manifest = {
        "schedule": "calm", "level": "byte", "classes": classes, **asdict(schedule),
        "n_fragments": schedule.n_fragments, "total_batches": batch, "total_records": len(records),
        "tokens_per_batch": b * w,
        "wrapped": {name: sum(c.wraps for c in columns[name]) for name in classes},
        "fragments": fragments,
    }
    return records, manifest
