from collections import defaultdict

import numpy as np
import pytest

from producers.schedule import CalmSchedule, ScheduleError, build_stream, class_order, plan_fragments

CORPUS = {"en": "hello world " * 2000, "fr": "bonjour le monde " * 2000, "cs": "ahoj světe čeština " * 2000}


def test_no_class_follows_itself_and_classes_are_balanced():
    rng = np.random.default_rng(0)
    for n in (2, 5, 30, 100):
        order = class_order(["a", "b", "c"], n, rng)
        assert all(x != y for x, y in zip(order, order[1:]))
        counts = [order.count(c) for c in "abc"]
        assert max(counts) - min(counts) <= 1


def test_one_class_is_rejected():
    with pytest.raises(ScheduleError, match="two classes"):
        class_order(["a"], 3, np.random.default_rng(0))


def test_fragment_lengths_follow_the_calm_truncated_exponential():
    schedule = CalmSchedule(n_fragments=20000, mean_tokens=10_000, streams=10, window=20)
    lengths = np.array(plan_fragments(schedule, np.random.default_rng(0)))
    scale = 10_000 / 200  # 50 chunks
    assert lengths.min() >= 1
    assert abs(lengths.mean() - 1.1 * scale) < 0.02 * 1.1 * scale  # loc 0.1 s shifts the mean
    assert lengths.max() <= 11 * scale + 1  # truncated at loc + 10 s


def test_every_stream_slice_is_exactly_its_windows_and_records_are_ordered():
    schedule = CalmSchedule(n_fragments=9, mean_tokens=900, streams=3, window=10, record_tokens=7, seed=1)
    records, manifest = build_stream(CORPUS, schedule)
    per_stream = defaultdict(bytes)
    # production order is time order: window by window, stream 0 to b-1 within one (sorted by stream first,
    # each stream's records all before the next stream's, this test passed)
    moments = [(r.truth.position // 10, int(r.stream)) for r in records]
    assert moments == sorted(moments) and len({stream for _, stream in moments[:6]}) == 3
    for record in records:
        assert len(record.text.encode()) <= 7 or len(record.text) == 1
        assert record.truth.position == len(per_stream[record.stream])  # contiguous positions
        per_stream[record.stream] += record.text.encode()
    total = manifest["total_batches"]
    assert total == sum(f["n_batches"] for f in manifest["fragments"])
    for data in per_stream.values():
        assert len(data) == total * 10 + 1  # plus the closing byte for the last target
    # the bytes of each window belong to exactly one fragment, the one the manifest says
    for fragment in manifest["fragments"]:
        start, end = fragment["tokens"]
        assert (end - start) == fragment["n_batches"] * 10
        inside = [r for r in records if start <= r.truth.position < end]
        assert {r.truth.fragment for r in inside} == {fragment["index"]}
        assert {r.truth.class_name for r in inside} == {fragment["class"]}


def test_small_class_text_wraps_instead_of_failing():
    schedule = CalmSchedule(n_fragments=4, mean_tokens=4000, streams=2, window=10)
    records, manifest = build_stream({"a": "abc def ", "b": "xyz uvw "}, schedule)
    assert sum(manifest["wrapped"].values()) > 0
    assert len(records) > 0
