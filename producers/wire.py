"""The wire record: the only thing producers and the learner share.

key = stream id, value = UTF-8 text, headers = ground truth for evaluation
only. The model path reads `stream` and `text`; `truth` travels beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Record", "Truth", "WireError", "encode", "decode"]

_HEADER_CLASS = "streamer.class"
_HEADER_FRAGMENT = "streamer.fragment"
_HEADER_POSITION = "streamer.position"
_HEADER_PRODUCED = "streamer.produced"
_HEADER_LABEL = "streamer.label"  # optional: the label of an utterance record
_REQUIRED = (_HEADER_CLASS, _HEADER_FRAGMENT, _HEADER_POSITION, _HEADER_PRODUCED)


class WireError(ValueError):
    """A record that cannot be decoded; `reason` is a short counter label."""

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


def decode(key: bytes | None, value: bytes | None, headers) -> Record:
    """Inverse of `encode`; raises WireError with a reason label on bad input."""
    if key is None:
        raise WireError("missing_key", "record has no key (stream id)")
    if value is None:
        raise WireError("missing_value", "record has no value")
    try:
        stream = key.decode("utf-8")
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("bad_utf8", f"record is not valid UTF-8: {exc}") from None
    found = {name: raw for name, raw in (headers or ()) if name in _REQUIRED or name == _HEADER_LABEL}
    if not found:
        return Record(stream, text, None)
    missing = [name for name in _REQUIRED if name not in found]
    if missing:
        raise WireError("bad_headers", f"record lacks truth headers {missing}")
    try:
        truth = Truth(
            class_name=found[_HEADER_CLASS].decode("utf-8"),
            fragment=int(found[_HEADER_FRAGMENT]),
            position=int(found[_HEADER_POSITION]),
            produced=float(found[_HEADER_PRODUCED]),
            label=found[_HEADER_LABEL].decode("utf-8") if _HEADER_LABEL in found else None,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError("bad_headers", f"record has malformed truth headers: {exc}") from None
    return Record(stream, text, truth)
