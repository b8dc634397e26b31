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
