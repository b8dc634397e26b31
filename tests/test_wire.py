import pytest

from producers.wire import Record, Truth, WireError, decode, encode


def test_round_trip_keeps_text_stream_and_truth():
    record = Record("3", "žluťoučký kůň", Truth("cs", 7, 140, 1700000000.25))
    assert decode(*encode(record)) == record


def test_record_without_truth_round_trips():
    record = Record("0", "plain text")
    key, value, headers = encode(record)
    assert headers == []
    assert decode(key, value, headers) == record


@pytest.mark.parametrize("key,value,headers,reason", [
    (None, b"x", [], "missing_key"),
    (b"0", None, [], "missing_value"),
    (b"0", b"\xff\xfe", [], "bad_utf8"),
    ("²".encode(), b"x", [], "bad_key"),
    (b"0", b"", [], "empty_value"),
    (b"0", b"x", [("streamer.class", b"en")], "bad_headers"),
    (b"0", b"x", [("streamer.class", b"en"), ("streamer.fragment", b"one"),
                  ("streamer.position", b"0"), ("streamer.produced", b"0")], "bad_headers"),
])
def test_bad_records_raise_with_a_reason(key, value, headers, reason):
    with pytest.raises(WireError) as info:
        decode(key, value, headers)
    assert info.value.reason == reason


def test_unrelated_headers_are_ignored():
    assert decode(b"1", b"hi", [("trace-id", b"abc")]) == Record("1", "hi")


def test_utterance_label_travels_as_an_optional_header():
    record = Record("2", "turn on the kitchen light\n", Truth("en", 3, 77, 1.5, label="HassTurnOn"))
    key, value, headers = encode(record)
    assert ("streamer.label", b"HassTurnOn") in headers
    assert decode(key, value, headers) == record


TRUTH = [("streamer.class", b"en"), ("streamer.fragment", b"0"), ("streamer.position", b"0"),
         ("streamer.produced", b"1.5")]


def _reason(key, value, headers, **limits):
    try:
        decode(key, value, headers, **limits)
    except WireError as exc:
        return exc.reason
    return None


def test_a_record_of_exactly_the_limit_is_learned_and_one_byte_more_is_too_large():
    """Key 1 byte, header name "ab" and value "cd" 4: a value of 95 bytes is 100, the limit; 96 is over it,
    counted with the header's name (without it, 99: learned)."""
    assert _reason(b"0", b"x" * 95, [("ab", b"cd")], max_record_bytes=100) is None
    assert _reason(b"0", b"x" * 96, [("ab", b"cd")], max_record_bytes=100) == "too_large"


def test_the_largest_record_a_producer_checks_is_the_widest_truth_on_the_widest_stream():
    """Key "2147483647" 10, "ab" and the closing newline 3, class header 14 + 2, fragment and position
    17 + 18 digits each, produced 17 + 24 (-1.2345678901234567e-300): 140; a label header 14 + 10 more."""
    from producers.wire import largest_record_bytes

    assert largest_record_bytes("ab", "en") == 140
    assert largest_record_bytes("ab", "en", "HassTurnOn") == 164


def test_the_last_of_a_repeated_truth_header_counts():
    record = decode(b"0", b"x", [*TRUTH, ("streamer.class", b"fr"), ("streamer.position", b"7")])
    assert record.truth == Truth("fr", 0, 7, 1.5)


@pytest.mark.parametrize("headers,reason", [
    ([("streamer.class", b"c" * 256), *TRUTH[1:]], None),  # 256 bytes: the longest class name
    ([("streamer.class", b"c" * 257), *TRUTH[1:]], "bad_headers"),
    ([("streamer.class", b"e\x00n"), *TRUTH[1:]], "bad_headers"),
    ([*TRUTH, ("streamer.label", b"")], "bad_headers"),
    ([*TRUTH, ("streamer.label", b"l" * 257)], "bad_headers"),
    ([*TRUTH, ("streamer.label", b"a\x00")], "bad_headers"),
    ([TRUTH[0], ("streamer.fragment", b"01"), *TRUTH[2:]], "bad_headers"),  # a leading zero
    ([TRUTH[0], ("streamer.fragment", b"00"), *TRUTH[2:]], "bad_headers"),
    ([*TRUTH[:2], ("streamer.position", b"9" * 18), TRUTH[3]], None),  # 10**18 - 1
    ([*TRUTH[:2], ("streamer.position", b"1" + b"0" * 18), TRUTH[3]], "bad_headers"),  # 10**18
    ([*TRUTH[:3], ("streamer.produced", b"inf")], "bad_headers"),
    ([*TRUTH[:3], ("streamer.produced", b"-inf")], "bad_headers"),
])
def test_truth_headers_at_their_bounds(headers, reason):
    assert _reason(b"0", b"x", headers) == reason


def test_a_record_with_neither_key_nor_value_is_counted_as_missing_its_key():
    """The reasons are checked in the documented order: the key before the value."""
    assert _reason(None, None, []) == "missing_key"


def test_produced_seconds_travel_to_the_last_digit():
    record = Record("0", "x", Truth("en", 1, 2, 1764489600.1234567))
    assert decode(*encode(record)).truth.produced == 1764489600.1234567


def test_the_dead_letter_copy_is_cut_one_byte_past_each_limit_and_not_at_it():
    from producers.wire import DLQ_HEADER_BYTES, DLQ_HEADERS, DLQ_NAME_CHARS, DLQ_VALUE_BYTES, dead_letter_copy

    def copy(value=b"x", headers=()):
        return dead_letter_copy(b"0", value, list(headers), reason="too_large", detail="d", source="t:0:1")

    at = copy(b"v" * DLQ_VALUE_BYTES, [("n" * DLQ_NAME_CHARS, b"h" * DLQ_HEADER_BYTES)] * DLQ_HEADERS)
    assert len(at[1]) == DLQ_VALUE_BYTES and len(at[2]) == DLQ_HEADERS + 3
    assert "streamer.truncated" not in dict(at[2])
    for past in (copy(b"v" * (DLQ_VALUE_BYTES + 1)), copy(headers=[("h", b"")] * (DLQ_HEADERS + 1)),
                 copy(headers=[("n" * (DLQ_NAME_CHARS + 1), b"")]),
                 copy(headers=[("h", b"h" * (DLQ_HEADER_BYTES + 1))])):
        assert dict(past[2])["streamer.truncated"] == b"1"
    assert len(copy(b"v" * (DLQ_VALUE_BYTES + 1))[1]) == DLQ_VALUE_BYTES
    assert copy(headers=[("n" * (DLQ_NAME_CHARS + 1), b"")])[2][0][0] == "n" * DLQ_NAME_CHARS


def test_decoding_ever_new_keys_does_not_grow_memory_with_them():
    """The decoder memoises keys, header names and class names, at most 4,096 of each: 100,000 streams'
    keys (each decoded once) hold no more than that."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for stream in range(10**6, 10**6 + 100_000):
            decode(str(stream).encode(), b"x", [("streamer.class", str(stream).encode()), *TRUTH[1:]])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 3_000_000
