"""The CALM corpus directory: one UTF-8 `<class>.txt` file per class.

This is the format every corpus in the cache is built into, and the format a
user points the producer at for their own data.
"""

from __future__ import annotations

import os
from pathlib import Path

from producers.wire import MAX_RECORD_BYTES, largest_record_bytes

__all__ = ["CorpusError", "load_corpus_dir", "CLASS_SUFFIX"]

CLASS_SUFFIX = ".txt"
UTF8_BOM = b"\xef\xbb\xbf"  # a byte-order mark some editors write first: not text, dropped when read


class CorpusError(ValueError):
    """A user-facing data problem; the message is one line that says what to fix."""


def load_corpus_dir(path: Path) -> dict[str, str]:
    """Read a CALM corpus directory: class name (file stem) -> text, sorted by class.

    Raises CorpusError when the directory is missing, holds fewer than two
    classes, or a class file is empty or not valid UTF-8.
    """
    return {file.stem: _read_class_file(file) for file in class_files(Path(path), CLASS_SUFFIX, "corpus")}


def class_files(path: Path, suffix: str, kind: str) -> list[Path]:
    """The `<class><suffix>` files of a directory, sorted by class; at least two, or a CorpusError."""
    if not path.is_dir():
        raise CorpusError(f"{kind} directory {path} does not exist or is not a directory")
    files = sorted((file for file in path.iterdir() if file.suffix == suffix and file.is_file()),
                   key=lambda file: file.stem)
    if len(files) < 2:
        found = ", ".join(file.name for file in files) or "none"
        raise CorpusError(
            f"{kind} directory {path} needs at least 2 class files named <class>{suffix} (found {len(files)}: {found})"
        )
    for file in files:
        refuse_undecodable_name(file)
    return files


def refuse_undecodable_name(file: Path) -> None:
    """A CorpusError for a class file or directory whose name is not UTF-8: the class is named by it, and the
    name's undecodable bytes (held as lone surrogates) made produce a UnicodeEncodeError traceback at the record's
    class header. The name is shown as bytes, which any terminal prints."""
    try:
        file.name.encode("utf-8")
    except UnicodeEncodeError:
        raise CorpusError(f"{file.parent}: the name {os.fsencode(file.name)!r} is not UTF-8, and a class is named "
                          "by it: rename it") from None


def decode_class_file(file: Path, data: bytes) -> str:
    """The UTF-8 text of a class file, a leading byte-order mark dropped as JSONL and `<class>/*.txt` drop it
    (before, a CALM class file streamed it as text), or a CorpusError naming the bad byte and its offset."""
    start = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        raise CorpusError(
            f"class file {file} is not valid UTF-8: byte 0x{data[offset]:02x} "
            f"at byte offset {offset} ({error.reason})"
        ) from None
    refuse_nul(file, data)
    return text


def refuse_nul(file: Path, data: bytes) -> None:
    """A CorpusError naming the line and offset of a NUL byte in `data`, the bytes of `file`: binary or
    corrupt data, never text (a learner dead-letters such a record: producers.wire, nul_byte)."""
    offset = data.find(b"\0")
    if offset >= 0:
        line = data.count(b"\n", 0, offset) + 1
        raise CorpusError(f"{file}:{line}: a NUL byte at byte offset {offset}: binary or corrupt data, not text")


def refuse_unencodable(value: str, where: str, field: str) -> None:
    """A CorpusError naming `where` (file:line) and `field` for a string UTF-8 cannot encode: a lone surrogate, which
    a JSON line's unpaired \\ud800 escape gives (the file's bytes decode; the string does not encode). Refused at
    load: before, it was a UnicodeEncodeError traceback when produce encoded the record or the class name."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        what = f"a lone surrogate (U+{code:04X}) in field {field!r} at {error.start}"
        reason = f"not encodable as UTF-8 (a JSON \\u{code:04x} escape without its pair?); fix or drop it"
        raise CorpusError(f"{where}: {what}: {reason}") from None


def refuse_oversized(text: str, class_name: str, label: str | None, where: str) -> None:
    """A CorpusError naming `where` (file:line) for an utterance whose record would be larger than a
    learner takes by default and Kafka's default limit allows (producers.wire.MAX_RECORD_BYTES)."""
    if len(text) * 4 + 1024 < MAX_RECORD_BYTES:  # (most utterances: no need to encode them to know)
        return
    size = largest_record_bytes(text.replace("\n", " ").strip(), class_name, label)
    if size > MAX_RECORD_BYTES:
        raise CorpusError(f"{where}: an utterance of {len(text.encode('utf-8')):,} bytes: its record would take "
                          f"{size:,}, over the {MAX_RECORD_BYTES:,} a learner takes (and Kafka's default limit); "
                          f"split or shorten it")


def _read_class_file(file: Path) -> str:
    text = decode_class_file(file, file.read_bytes())
    if not text.strip():
        raise CorpusError(f"class file {file} is empty; every class needs some text")
    return text
