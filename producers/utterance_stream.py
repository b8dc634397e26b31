"""Utterance streams: one labelled utterance per record, in any schedule.

Fragment lengths count utterances (lambda = mean utterances per fragment over all
b streams). Each class's utterances are shuffled once with the seed and read on in
that order by every stream, wrapping when exhausted; the last `probe_examples` of
each class are held out as its probe split, never streamed. The label travels in
the `streamer.label` header, the class in `streamer.class`, for evaluation only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from producers.schedule import Schedule, fragment_numbers, plan_streams
from producers.wire import Record, Truth

__all__ = ["build_utterance_stream"]


def build_utterance_stream(examples: dict[str, list[tuple[str, str | None]]], schedule: Schedule,
                           probe_examples: int = 0, produced: float = 0.0):
    """examples: class -> [(text, label)]. Returns (records in production order, manifest)."""
    schedule.validate()
    classes = sorted(examples)
    rng = np.random.default_rng(schedule.seed)
    pools, probes = {}, {}
    for name in classes:
        items = list(examples[name])
        order = rng.permutation(len(items))
        items = [items[i] for i in order]
        if probe_examples and probe_examples >= len(items) // 2:
            from producers.orders import ScheduleError
            raise ScheduleError(f"a probe split of {probe_examples} utterances would take half of class {name!r}")
        cut = len(items) - probe_examples
        # each payload built once: a recycled utterance's records share it (a new string per record took
        # 21 GB for one 3 MB utterance read over and over)
        pools[name] = [(payload, len(payload.encode("utf-8")), label)
                       for payload, label in ((text.replace("\n", " ").strip() + "\n", label)
                                              for text, label in items[:cut])]
        probes[name] = items[cut:]
    b = schedule.streams
    per_fragment = dataclasses.replace(schedule, window=1)  # lengths in utterances, not windows of bytes
    plans = plan_streams(per_fragment, classes, {c: len(pools[c]) for c in classes}, rng)
    cursors = {name: 0 for name in classes}
    synchronised = schedule.kind != "independent"
    number = fragment_numbers(plans)  # (independent: numbered in the order they start)
    timed, per_stream, positions = [], [], [0] * b
    for s, plan in enumerate(plans):
        step, fragments = 0, []
        for k, (name, n) in enumerate(plan):
            index = k if synchronised else number[s, k]
            start = step
            for _ in range(n):
                payload, size, label = pools[name][cursors[name] % len(pools[name])]
                cursors[name] += 1
                timed.append((step, s, Record(str(s), payload, Truth(name, index, positions[s], produced, label))))
                positions[s] += size
                step += 1
            fragments.append({"index": index, "class": name, "n_utterances": n, "start_utterance": start})
        per_stream.append(fragments)
    timed.sort(key=lambda item: (item[0], item[1]))
    records = [record for _, _, record in timed]
    manifest = {
        "schedule": schedule.kind, "level": "utterance", "classes": classes, **dataclasses.asdict(schedule),
        "n_fragments": len(per_stream[0]) if synchronised else len(number),
        "total_records": len(records),
        # the byte learner cuts w-byte windows; every stream must hold w + 1 bytes for a batch
        "total_batches": max(0, (min(positions) - 1) // schedule.window),
        "probe": {"examples": probe_examples,
                  "classes": {name: {"text": "\n".join(t for t, _ in probes[name]),
                                     "labels": [label for _, label in probes[name]],
                                     "bytes": sum(len(t.encode("utf-8")) + 1 for t, _ in probes[name])}
                              for name in classes if probes[name]}},
    }
    key = "fragments" if synchronised else "stream_fragments"
    manifest[key] = per_stream[0] if synchronised else per_stream
    return records, manifest
