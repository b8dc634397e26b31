"""Stream schedules: fragments of classes cut into b parallel byte streams.

Schedules (producers/orders.py): `calm` (CALM: N fragments, seeded order with no
class twice in a row, lengths from CALM's truncated exponential in chunks of
b x w tokens), `sequence` (each class once: given order, size high-to-low or
low-to-high, or one of the balanced permutations), `recurring` (R seeded rounds
over all classes) and `independent` (each stream follows its own CALM schedule,
so the b streams switch at different moments). Tokens are UTF-8 bytes; each
stream's slice of a fragment is exactly n x w bytes (cut at a character boundary
and padded with spaces), so with synchronised streams every batch belongs to
exactly one fragment. A held-out probe split per class (the tail of its text)
is never streamed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from producers.orders import (SCHEDULES, SEQUENCE_ORDERS, ScheduleError, calm_lengths, calm_order,
                              recurring_order, sequence_order)
from producers.wire import Record, Truth

__all__ = ["Schedule", "CalmSchedule", "ScheduleError", "plan_fragments", "class_order", "build_stream",
           "split_probe", "plan_streams"]


@dataclass(frozen=True)
class Schedule:
    kind: str = "calm"  # one of SCHEDULES
    n_fragments: int = 100  # calm and independent (per stream)
    mean_tokens: int = 10_000  # lambda: mean fragment length in tokens over all b streams
    streams: int = 10  # b
    window: int = 20  # w
    record_tokens: int = 20  # bytes of text per record, cut at a character boundary
    seed: int = 0
    order: str = "given"  # sequence: one of SEQUENCE_ORDERS
    given_order: tuple[str, ...] = ()  # sequence with order "given": the explicit order
    permutation: int = 0  # sequence with order "permutation": which balanced permutation
    repeats: int = 2  # recurring: R rounds
    probe_tokens: int = 0  # bytes of each class held out as its probe split (never streamed)

    def validate(self) -> None:
        if self.kind not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {self.kind!r}; choose from {', '.join(SCHEDULES)}")
        if self.order not in SEQUENCE_ORDERS:
            raise ScheduleError(f"unknown order {self.order!r}; choose from {', '.join(SEQUENCE_ORDERS)}")
        for name in ("n_fragments", "mean_tokens", "streams", "window", "record_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ScheduleError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("probe_tokens", "seed"):  # (numpy refuses a negative seed with a traceback)
            if getattr(self, name) < 0:
                raise ScheduleError(f"{name} must be >= 0, got {getattr(self, name)}")


CalmSchedule = Schedule  # the default kind is CALM's


def plan_fragments(schedule: Schedule, rng: np.random.Generator) -> list[int]:
    """CALM fragment lengths in batches (chunks of b x w tokens)."""
    return calm_lengths(schedule.n_fragments, schedule.mean_tokens / (schedule.streams * schedule.window), rng)


def class_order(classes: list[str], n_fragments: int, rng: np.random.Generator) -> list[str]:
    return calm_order(classes, n_fragments, rng)


def split_probe(text: str, probe_bytes: int) -> tuple[str, str]:
    """(streamed part, held-out probe): the probe is the last whole lines of about `probe_bytes`."""
    if probe_bytes <= 0:
        return text, ""
    data = text.encode("utf-8")
    if probe_bytes >= len(data) // 2:
        raise ScheduleError(f"a probe split of {probe_bytes} bytes would take half of a class of {len(data)} bytes")
    cut = text.rfind("\n", 0, len(data[:-probe_bytes].decode("utf-8", errors="ignore")))
    cut = cut if cut > 0 else len(data[:-probe_bytes].decode("utf-8", errors="ignore"))
    return text[:cut], text[cut:].lstrip("\n")


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


def plan_streams(schedule: Schedule, classes: list[str], sizes: dict[str, int], rng) -> list[list[tuple[str, int]]]:
    """Per stream, [(class, length in windows)]; synchronised schedules share one plan."""
    b, w = schedule.streams, schedule.window
    if schedule.kind == "independent":
        per_stream = schedule.mean_tokens / (b * w)  # each stream's own mean, in windows
        plans = [list(zip(calm_order(classes, schedule.n_fragments, rng),
                          calm_lengths(schedule.n_fragments, per_stream, rng))) for _ in range(b)]
        shortest = min(sum(n for _, n in plan) for plan in plans)
        return [_trim(plan, shortest) for plan in plans]
    if schedule.kind == "calm":
        order = calm_order(classes, schedule.n_fragments, rng)
        lengths = plan_fragments(schedule, rng)
    elif schedule.kind == "sequence":
        order = sequence_order(classes, schedule.order, sizes, given=schedule.given_order,
                               permutation=schedule.permutation)
        lengths = [max(1, round(schedule.mean_tokens / (b * w)))] * len(order)
    else:  # recurring
        order = recurring_order(classes, schedule.repeats, rng)
        lengths = calm_lengths(len(order), schedule.mean_tokens / (b * w), rng)
    return [list(zip(order, lengths))] * b


def _trim(plan: list[tuple[str, int]], total: int) -> list[tuple[str, int]]:
    out, used = [], 0
    for name, n in plan:
        if used >= total:
            break
        out.append((name, min(n, total - used)))
        used += out[-1][1]
    return out


def fragment_numbers(plans: list[list[tuple[str, int]]]) -> dict[tuple[int, int], int]:
    """Independent streams: {(stream s, its k-th fragment): its number}, every stream's fragments numbered
    in the order they start (then by stream), so a later fragment has a larger number and N/2 is the middle
    of the stream in time (numbered k*b + s, a stream of long fragments stopped at small numbers while
    another's went on: 'half' scored 3 of 75 batches)."""
    starts = []
    for s, plan in enumerate(plans):
        start = 0
        for k, (_, n) in enumerate(plan):
            starts.append((start, s, k))
            start += n
    return {(s, k): i for i, (_, s, k) in enumerate(sorted(starts))}


def build_stream(corpus: dict[str, str], schedule: Schedule, produced: float = 0.0):
    """Return (records in production order, manifest dict).

    The manifest's `probe` holds each class's held-out text under "text";
    `producers.stream.prepare_stream` moves those texts into files beside it.
    """
    schedule.validate()
    classes = sorted(corpus)
    if any(not corpus[name].strip() for name in classes):
        raise ScheduleError(f"class {next(n for n in classes if not corpus[n].strip())!r} has no text")
    split = {name: split_probe(corpus[name], schedule.probe_tokens) for name in classes}
    rng = np.random.default_rng(schedule.seed)
    sizes = {name: len(split[name][0].encode("utf-8")) for name in classes}
    plans = plan_streams(schedule, classes, sizes, rng)
    b, w = schedule.streams, schedule.window
    columns = {}
    for name in classes:
        text = split[name][0]
        size = -(-len(text) // b)
        columns[name] = [_Column(text[i * size:(i + 1) * size] or text) for i in range(b)]
    synchronised = schedule.kind != "independent"
    number = fragment_numbers(plans)
    timed: list[tuple[int, int, Record]] = []
    per_stream = []
    for s, plan in enumerate(plans):
        window, fragments = 0, []
        for k, (name, n) in enumerate(plan):
            index = k if synchronised else number[s, k]
            text, start, end = columns[name][s].read(n * w)
            truth = {"class_name": name, "fragment": index, "produced": produced}
            for position, record in _records(text, str(s), window * w, schedule.record_tokens, truth):
                timed.append((position // w, s, record))
            fragments.append({"index": index, "class": name, "n_batches": n, "start_batch": window,
                              "tokens": [window * w, (window + n) * w], "char_span": [start, end]})
            window += n
        last = fragments[-1]  # one closing byte so the last window has its last target
        timed.append((window, s, Record(str(s), "\n", Truth(last["class"], last["index"], window * w, produced))))
        per_stream.append(fragments)
    timed.sort(key=lambda item: (item[0], item[1]))
    records = [record for _, _, record in timed]
    total = sum(f["n_batches"] for f in per_stream[0])
    manifest = {
        "schedule": schedule.kind, "level": "byte", "classes": classes, **asdict(schedule),
        "n_fragments": len(per_stream[0]) if synchronised else len(number),
        "total_batches": total, "total_records": len(records), "tokens_per_batch": b * w,
        "wrapped": {name: sum(c.wraps for c in columns[name]) for name in classes},
        "probe": {"tokens": schedule.probe_tokens,
                  "classes": {name: {"text": split[name][1], "bytes": len(split[name][1].encode("utf-8"))}
                              for name in classes if split[name][1]}},
    }
    if synchronised:
        manifest["fragments"] = [{**f, "char_spans": [per_stream[s][i]["char_span"] for s in range(b)]}
                                 for i, f in enumerate(per_stream[0])]
        for f in manifest["fragments"]:
            del f["char_span"]
    else:
        manifest["stream_fragments"] = per_stream
    return records, manifest
