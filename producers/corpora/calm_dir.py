"""The CALM corpus directory: one UTF-8 `<class>.txt` file per class.

This is the format every corpus in the cache is built into, and the format a
user points the producer at for their own data.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CorpusError", "load_corpus_dir", "CLASS_SUFFIX"]

CLASS_SUFFIX = ".txt"


class CorpusError(ValueError):
    """A user-facing data problem; the message is one line that says what to fix."""


def load_corpus_dir(path: Path) -> dict[str, str]:
    """Read a CALM corpus directory: class name (file stem) -> text, sorted by class.

    Raises CorpusError when the directory is missing, holds fewer than two
    classes, or a class file is empty or not valid UTF-8.
    """
    path = Path(path)
    if not path.is_dir():
        raise CorpusError(f"corpus directory {path} does not exist or is not a directory")
    class_files = sorted(
        (file for file in path.iterdir() if file.suffix == CLASS_SUFFIX and file.is_file()),
        key=lambda file: file.stem,
    )
    if len(class_files) < 2:
        found = ", ".join(file.name for file in class_files) or "none"
        raise CorpusError(
            f"corpus directory {path} needs at least 2 class files named <class>{CLASS_SUFFIX} "
            f"(found {len(class_files)}: {found})"
        )
    return {file.stem: _read_class_file(file) for file in class_files}


def _read_class_file(file: Path) -> str:
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"class file {file} is not valid UTF-8: byte 0x{data[error.start]:02x} "
            f"at byte offset {error.start} ({error.reason})"
        ) from None
    if not text.strip():
        raise CorpusError(f"class file {file} is empty; every class needs some text")
    return text
