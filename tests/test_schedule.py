from collections import defaultdict

import numpy as np
import pytest

from producers.schedule import (CalmSchedule, Schedule, ScheduleError, build_stream, class_order, plan_fragments,
                                split_probe)

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


def test_a_sequence_stream_is_the_hand_cut_text_window_by_window():
    """Two streams of 4-byte windows, 2 windows a class (lambda 16 over b x w = 8), records of 3 bytes. Class
    a's 11 characters split into columns of ceil(11 / 2) = 6 ("012345", "6789X"), each read on and wrapped to
    fill its 8 bytes; b's 10 into "ABCDE" and "FGHIJ"."""
    schedule = Schedule(kind="sequence", order="given", given_order=("a", "b"), streams=2, window=4,
                        mean_tokens=16, record_tokens=3)
    records, manifest = build_stream({"a": "0123456789X", "b": "ABCDEFGHIJ"}, schedule)
    got = [(r.stream, r.text, r.truth.position, r.truth.class_name, r.truth.fragment) for r in records]
    assert got == [
        ("0", "012", 0, "a", 0), ("0", "345", 3, "a", 0), ("1", "678", 0, "a", 0), ("1", "9X6", 3, "a", 0),
        ("0", "01", 6, "a", 0), ("1", "78", 6, "a", 0),
        ("0", "ABC", 8, "b", 1), ("0", "DEA", 11, "b", 1), ("1", "FGH", 8, "b", 1), ("1", "IJF", 11, "b", 1),
        ("0", "BC", 14, "b", 1), ("1", "GH", 14, "b", 1),
        ("0", "\n", 16, "b", 1), ("1", "\n", 16, "b", 1)]
    assert manifest["fragments"] == [
        {"index": 0, "class": "a", "n_batches": 2, "start_batch": 0, "tokens": [0, 8], "char_spans": [[0, 2], [0, 3]]},
        {"index": 1, "class": "b", "n_batches": 2, "start_batch": 2, "tokens": [8, 16],
         "char_spans": [[0, 3], [0, 3]]}]
    assert (manifest["total_batches"], manifest["total_records"], manifest["tokens_per_batch"]) == (4, 14, 8)
    assert manifest["wrapped"] == {"a": 2, "b": 2}  # every column of both classes wrapped once


def test_a_character_that_straddles_a_window_is_left_for_the_next_and_the_window_padded():
    """x = "abé": the 2-byte é does not fit the 3-byte window after "ab", so the window is "ab " (a space pads
    it to exactly w bytes) and é is not dropped, nor the class wrapped around it."""
    schedule = Schedule(kind="sequence", order="given", given_order=("x", "y"), streams=1, window=3, mean_tokens=3)
    records, manifest = build_stream({"x": "abé", "y": "xyz"}, schedule)
    assert [(r.text, r.truth.position) for r in records] == [("ab ", 0), ("xyz", 3), ("\n", 6)]
    assert manifest["fragments"][0]["char_spans"] == [[0, 2]] and manifest["wrapped"] == {"x": 0, "y": 0}


def test_a_sequence_fragment_is_lambda_over_b_times_w_windows_rounded_to_the_nearest():
    schedule = Schedule(kind="sequence", order="given", given_order=("a", "b"), streams=2, window=4, mean_tokens=22)
    _, manifest = build_stream({"a": "a" * 100, "b": "b" * 100}, schedule)
    assert [f["n_batches"] for f in manifest["fragments"]] == [3, 3]  # 22 / 8 = 2.75


def test_a_class_shorter_than_the_number_of_streams_fills_every_stream():
    """"ab" over 3 streams: columns of 1 character leave the third empty; it reads the whole class instead
    (an empty column never fills its window: the build did not end)."""
    schedule = Schedule(kind="sequence", order="given", given_order=("a", "b"), streams=3, window=2, mean_tokens=6)
    records, _ = build_stream({"a": "ab", "b": "cd"}, schedule)
    first = {r.stream: r.text for r in records if r.truth.fragment == 0}
    assert first == {"0": "aa", "1": "bb", "2": "ab"}


def test_the_stream_does_not_depend_on_the_order_the_classes_were_read_in():
    schedule = CalmSchedule(n_fragments=6, mean_tokens=300, streams=2, window=10, seed=3)
    forward = build_stream(dict(CORPUS), schedule)
    backward = build_stream(dict(reversed(list(CORPUS.items()))), schedule)
    assert forward == backward and forward[1]["classes"] == ["cs", "en", "fr"]


def test_independent_streams_are_trimmed_to_the_shortest_without_empty_fragments():
    schedule = Schedule(kind="independent", n_fragments=8, mean_tokens=400, streams=3, window=10, seed=2)
    _, manifest = build_stream(CORPUS, schedule)
    fragments = manifest["stream_fragments"]
    assert all(f["n_batches"] >= 1 for stream in fragments for f in stream)
    assert [sum(f["n_batches"] for f in stream) for stream in fragments] == [manifest["total_batches"]] * 3
    assert manifest["n_fragments"] == sum(len(stream) for stream in fragments)


@pytest.mark.parametrize("field", ["n_fragments", "mean_tokens", "streams", "window", "record_tokens", "repeats"])
def test_a_count_of_zero_is_refused(field):
    with pytest.raises(ScheduleError, match=f"{field} must be at least 1, got 0"):
        build_stream(CORPUS, Schedule(**{field: 0}))


@pytest.mark.parametrize("field", ["probe_tokens", "seed"])
def test_a_negative_seed_or_probe_is_refused(field):
    with pytest.raises(ScheduleError, match=f"{field} must be >= 0, got -1"):
        build_stream(CORPUS, Schedule(**{field: -1}))


def test_a_class_of_only_whitespace_is_refused_by_name():
    with pytest.raises(ScheduleError, match="class 'b' has no text"):
        build_stream({"a": "some text", "b": " \n\t "}, Schedule(n_fragments=2, mean_tokens=40, streams=2, window=2))


def test_a_probe_of_half_the_class_is_refused():
    with pytest.raises(ScheduleError, match="half of a class of 20 bytes"):
        split_probe("x" * 20, 10)
    assert split_probe("x" * 20, 9) == ("x" * 11, "x" * 9)


def test_a_probe_split_whose_only_newline_opens_the_text_cuts_at_the_byte_budget():
    """The one newline is at 0: cutting there would stream nothing of the class."""
    assert split_probe("\n" + "x" * 40, 10) == ("\n" + "x" * 30, "x" * 10)
