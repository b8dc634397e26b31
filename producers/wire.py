"""The wire record: the only thing producers and the learner share.

key = stream id, value = UTF-8 text, headers = ground truth for evaluation
only. The model path reads `stream` and `text`; `truth` travels beside it.

What the learner accepts (anything else is dead-lettered with one reason, never raised past the
consumer). Checked in this order, the first failing rule gives the reason:

    too_large      key + value + header names and values over `max_record_bytes` (--max-record-bytes)
    missing_key    no key
    bad_key        a key that is not a stream id: ASCII decimal digits only, no sign, no spaces, no
                   leading zero ("0" itself is fine), 0 <= id < 2**31. So "²", "٣", "-1", "+1", "01",
                   " 1", "", "abc" and invalid UTF-8 are bad keys; "2147483648" is too large.
    missing_value  a null value (a tombstone)
    empty_value    a value of zero bytes
    bad_utf8       a value that is not valid UTF-8
    nul_byte       a value holding a NUL (U+0000): binary or corrupt data, never text
    bad_headers    some truth headers present but not all four, or one that is null, not UTF-8, not a
                   decimal fragment/position (0 <= n < 10**18), a non-finite `produced`, an empty or
                   over-long (> 256 bytes) class or label. Other headers are ignored, whatever their
                   value bytes.
    unreadable     a record the Kafka client cannot parse at all: a header *name* that is not UTF-8
                   (aiokafka decodes names strictly) or a failed CRC. Its copy holds no key or value;
                   records after it in the same producer batch cannot be parsed either and are
                   dead-lettered the same way (streamer.kafka.dead_letters).

and, after decoding, by the learner's batcher (streamer.batching, streamer.utterance_batching):

    extra_stream    a stream id beyond the b rows of a language-model run (id >= b)
    missing_label   a classifier run's record without the streamer.label header
    label_overflow  a new label beyond the head's max_labels

Two more counters, not a record's fault: `dead_letter_failed` counts dead-letter sends that failed
anyway (the record itself is counted under its reason too), and `deleted_before_read` the records
retention deleted from the topic before the learner read them (never read, so never copied to the
dead-letter topic). `REASONS` lists them all.

A dead-lettered record goes to `<topic>.dlq` as `dead_letter_copy` makes it: the key, value and
headers cut to a size whose send cannot fail (a `streamer.truncated` header says when), with
`streamer.reason`, `streamer.detail` and `streamer.source` (topic:partition:offset) last.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Record", "Truth", "WireError", "encode", "decode", "stream_id", "record_bytes", "largest_record_bytes",
           "dead_letter_copy",
           "REASONS", "MAX_STREAM_ID", "MAX_RECORD_BYTES", "MAX_NAME_BYTES"]

REASONS = ("too_large", "missing_key", "bad_key", "missing_value", "empty_value", "bad_utf8", "nul_byte",
           "bad_headers", "unreadable", "extra_stream", "missing_label", "label_overflow", "dead_letter_failed",
           "deleted_before_read")
MAX_STREAM_ID = 2**31  # stream ids are 0 <= id < MAX_STREAM_ID
MAX_RECORD_BYTES = 1_000_000  # the default of --max-record-bytes

_HEADER_CLASS = "streamer.class"
_HEADER_FRAGMENT = "streamer.fragment"
_HEADER_POSITION = "streamer.position"
_HEADER_PRODUCED = "streamer.produced"
_HEADER_LABEL = "streamer.label"  # optional: the label of an utterance record
_REQUIRED = (_HEADER_CLASS, _HEADER_FRAGMENT, _HEADER_POSITION, _HEADER_PRODUCED)
_STREAM_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # ASCII only: str patterns match Unicode digits with \d, not [0-9]
_COUNT = re.compile(rb"0|[1-9][0-9]{0,17}")  # fragment, position: 0 <= n < 10**18
MAX_NAME_BYTES = 256  # class and label names

# The dead-letter copy: small enough that its send cannot fail (Kafka's default limit is ~1 MB)
DLQ_KEY_BYTES, DLQ_VALUE_BYTES, DLQ_HEADERS, DLQ_HEADER_BYTES, DLQ_NAME_CHARS = 1024, 64 * 1024, 16, 1024, 256


class WireError(ValueError):
    """A record that cannot be decoded; `reason` is a short counter label (one of REASONS)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Truth:
    """Ground truth of a record, for evaluation only."""

    class_name: str
    fragment: int
    position: int  # token offset of the record's first token within its stream
    produced: float  # producer wall-clock time, seconds since the epoch
    label: str | None = None  # utterance streams: the example's label (intent, act)


@dataclass(frozen=True)
class Record:
    stream: str
    text: str
    truth: Truth | None = None


def stream_id(stream: str) -> int | None:
    """The stream id a key names (the rules above), or None when the key is not a stream id."""
    if not isinstance(stream, str) or _STREAM_ID.fullmatch(stream) is None:
        return None
    number = int(stream)
    return number if number < MAX_STREAM_ID else None


def encode(record: Record) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """Return (key, value, headers) for a Kafka producer."""
    headers: list[tuple[str, bytes]] = []
    if record.truth is not None:
        t = record.truth
        headers = [
            (_HEADER_CLASS, t.class_name.encode("utf-8")),
            (_HEADER_FRAGMENT, str(t.fragment).encode()),
            (_HEADER_POSITION, str(t.position).encode()),
            (_HEADER_PRODUCED, repr(t.produced).encode()),
        ]
        if t.label is not None:
            headers.append((_HEADER_LABEL, t.label.encode("utf-8")))
    return record.stream.encode("utf-8"), record.text.encode("utf-8"), headers


def largest_record_bytes(text: str, class_name: str, label: str | None = None) -> int:
    """The most bytes a record of `text` with this class and label can take on any stream, at any
    fragment, position and time: what a producer checks against MAX_RECORD_BYTES before it streams it."""
    widest = Truth(class_name, 10**18 - 1, 10**18 - 1, -1.2345678901234567e-300, label)
    return record_bytes(*encode(Record(str(MAX_STREAM_ID - 1), text + "\n", widest)))


def record_bytes(key: bytes | None, value: bytes | None, headers) -> int:
    """A record's size as --max-record-bytes counts it: key, value, header names and values."""
    size = len(key or b"") + len(value or b"")
    for name, raw in headers or ():
        named = _NAME_SIZES.get(name) if isinstance(name, str) else None
        if named is None:
            named = len(name.encode("utf-8", "surrogatepass") if isinstance(name, str) else name or b"")
            if named <= MAX_NAME_BYTES:
                _remember(_NAME_SIZES, name, named)
        size += named + len(raw or b"")
    return size


# Bounded memos of the decoding's repeated values: a topic has a few stream keys, header names and
# class names, decoded the same way every record (a memo holds only values that passed, of at most
# 256 bytes, and stops growing at _MEMO entries: a topic of ever-new keys costs the plain decoding,
# never memory). Decoding 3.4 -> 2.3 us a record with the regex-free counts below.
_MEMO = 4096
_NAME_SIZES: dict = {}  # header name (str) -> its UTF-8 bytes
_STREAMS: dict = {}  # key bytes -> its stream id string (valid keys only)
_NAMES: dict = {}  # class or label header bytes -> the name (valid names only)


def _remember(memo: dict, key, value) -> None:
    if len(memo) < _MEMO and isinstance(key, (str, bytes)):
        memo[key] = value


def decode(key: bytes | None, value: bytes | None, headers, *, max_record_bytes: int | None = None) -> Record:
    """Inverse of `encode`; raises WireError with a reason label on bad input (the rules above)."""
    if max_record_bytes is not None and (size := record_bytes(key, value, headers)) > max_record_bytes:
        raise WireError("too_large", f"record of {size} bytes is over the limit of {max_record_bytes} (--max-record-bytes)")
    if key is None:
        raise WireError("missing_key", "record has no key (stream id)")
    stream = _STREAMS.get(key) if type(key) is bytes else None
    if stream is None:
        stream = _stream_of(key)
        _remember(_STREAMS, key, stream)
    if value is None:
        raise WireError("missing_value", "record has no value")
    if not value:
        raise WireError("empty_value", "record has an empty value")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("bad_utf8", f"record is not valid UTF-8: {exc}") from None
    if "\x00" in text:
        raise WireError("nul_byte", f"record holds a NUL byte at {text.index(chr(0))}: binary, not text")
    return Record(stream, text, _truth(headers))


def _stream_of(key: bytes) -> str:
    try:
        stream = key.decode("ascii")
    except UnicodeDecodeError:
        stream = None
    if stream is None or stream_id(stream) is None:
        shown = repr(bytes(key[:40])) + ("..." if len(key) > 40 else "")
        raise WireError("bad_key", f"key {shown} is not a stream id (ASCII decimal, 0 <= id < 2**31, no leading zero)")
    return stream


_SLOTS = {_HEADER_CLASS: 0, _HEADER_FRAGMENT: 1, _HEADER_POSITION: 2, _HEADER_PRODUCED: 3, _HEADER_LABEL: 4}
_ABSENT = object()


def _truth(headers) -> Truth | None:
    if not headers:
        return None
    found = [_ABSENT] * 5  # class, fragment, position, produced, label: the last of each name counts
    for name, raw in headers:
        slot = _SLOTS.get(name) if isinstance(name, str) else None
        if slot is not None:
            found[slot] = raw
    class_raw, fragment, position, produced, label = found
    if class_raw is _ABSENT or fragment is _ABSENT or position is _ABSENT or produced is _ABSENT:
        if found.count(_ABSENT) == 5:
            return None
        missing = [name for name, raw in zip(_REQUIRED, found) if raw is _ABSENT]
        raise WireError("bad_headers", f"record lacks truth headers {missing}")
    try:  # Truth(class_name, fragment, position, produced, label)
        return Truth(_name(class_raw, _HEADER_CLASS), _count(fragment, _HEADER_FRAGMENT),
                     _count(position, _HEADER_POSITION), _seconds(produced),
                     None if label is _ABSENT else _name(label, _HEADER_LABEL))
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise WireError("bad_headers", f"record has malformed truth headers: {exc}") from None


def _name(raw: bytes | None, header: str) -> str:
    name = _NAMES.get(raw) if type(raw) is bytes else None
    if name is not None:
        return name
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"{header} must hold 1 to {MAX_NAME_BYTES} bytes")
    name = raw.decode("utf-8")
    if "\x00" in name:
        raise ValueError(f"{header} holds a NUL byte")
    _remember(_NAMES, raw, name)
    return name


def _count(raw: bytes | None, header: str) -> int:
    # _COUNT's rule without the regex: 1 to 18 ASCII digits (bytes.isdigit), no leading zero
    if type(raw) is not bytes or not 0 < len(raw) <= 18 or not raw.isdigit() or (raw[0] == 48 and len(raw) > 1):
        if raw is None or _COUNT.fullmatch(raw) is None:
            raise ValueError(f"{header} must be a decimal number, 0 <= n < 10**18")
    return int(raw)


def _seconds(raw: bytes | None) -> float:
    seconds = float(raw.decode("ascii")) if raw is not None and len(raw) <= 64 else math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"{_HEADER_PRODUCED} must be a finite number of seconds")
    return seconds


def dead_letter_copy(key: bytes | None, value: bytes | None, headers, *, reason: str, detail: str,
                     source: str) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]:
    """(key, value, headers) of a record's copy on the dead-letter topic: each part cut to the DLQ_*
    sizes (so the send cannot fail on size), the original headers first (at most DLQ_HEADERS), then
    `streamer.truncated` when anything was cut, then `streamer.reason`, `.detail` and `.source`."""
    cut = False

    def capped(raw, limit):
        nonlocal cut
        if raw is not None and len(raw) > limit:
            cut = True
            return bytes(raw[:limit])
        return raw

    key, value = capped(key, DLQ_KEY_BYTES), capped(value, DLQ_VALUE_BYTES)
    if key is None and value is None:  # Kafka allows it; aiokafka's producer does not
        value = b""
    headers = list(headers or ())
    if len(headers) > DLQ_HEADERS:
        cut, headers = True, headers[:DLQ_HEADERS]
    copied = []
    for name, raw in headers:
        name = name if isinstance(name, str) else bytes(name or b"").decode("utf-8", "replace")
        if len(name) > DLQ_NAME_CHARS:
            cut, name = True, name[:DLQ_NAME_CHARS]
        copied.append((name.encode("utf-8", "replace").decode("utf-8"), capped(raw, DLQ_HEADER_BYTES)))
    if cut:
        copied.append(("streamer.truncated", b"1"))
    copied += [("streamer.reason", reason.encode()), ("streamer.detail", detail.encode("utf-8", "replace")[:1024]),
               ("streamer.source", source.encode("utf-8", "replace")[:512])]
    return key, value, copied
