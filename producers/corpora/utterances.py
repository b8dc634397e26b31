"""The labeled utterance directory: one UTF-8 `<class>.jsonl` file per class.

Each line of a class file is one JSON object with at least a "text" and a
"label" string (the label is finer than the class: an intent or a dialogue
act); other fields are allowed and ignored. Corpora of short labeled
utterances are built into this format, and a user can point the producer at
their own data in it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .calm_dir import CorpusError, class_files, decode_class_file, refuse_oversized, refuse_unencodable

__all__ = [
    "UTTERANCE_SUFFIX",
    "Utterance",
    "write_utterance_dir",
    "load_utterance_dir",
    "describe_utterance_dir",
]

UTTERANCE_SUFFIX = ".jsonl"


@dataclass(frozen=True)
class Utterance:
    """One labeled example: its text and its label within the class."""

    text: str
    label: str


def write_utterance_dir(out_dir: Path, classes: dict[str, list[Utterance]]) -> None:
    """Write one `<class>.jsonl` per class into out_dir (created if missing), examples in order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, utterances in classes.items():
        lines = (
            json.dumps({"text": utterance.text, "label": utterance.label}, ensure_ascii=False)
            for utterance in utterances
        )
        (out_dir / f"{name}{UTTERANCE_SUFFIX}").write_text(
            "".join(f"{line}\n" for line in lines), encoding="utf-8"
        )


def load_utterance_dir(path: Path) -> dict[str, list[Utterance]]:
    """Read a labeled utterance directory: class name (file stem) -> examples, sorted by class.

    Raises CorpusError when the directory is missing, holds fewer than two
    classes, a class file is empty, not valid UTF-8 or not JSON lines, or a
    line lacks a string "text" or "label".
    """
    return {file.stem: _parse(file, file.read_bytes()) for file in _class_files(Path(path))}


def describe_utterance_dir(path: Path) -> dict[str, dict[str, Any]]:
    """Per class: file, examples, labels (distinct), characters of text, bytes and sha256 of the file."""
    path = Path(path)
    described = {}
    for file in _class_files(path):
        data = file.read_bytes()
        utterances = _parse(file, data)
        described[file.stem] = {
            "file": file.name,
            "examples": len(utterances),
            "labels": len({utterance.label for utterance in utterances}),
            "characters": sum(len(utterance.text) for utterance in utterances),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return described


def _class_files(path: Path) -> list[Path]:
    return class_files(path, UTTERANCE_SUFFIX, "utterance")


def _parse(file: Path, data: bytes) -> list[Utterance]:
    text = decode_class_file(file, data)
    utterances = []
    # split on "\n" only: JSON text may hold U+2028 and other characters splitlines() breaks at
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            utterances.append(_parse_line(file, number, line))
    if not utterances:
        raise CorpusError(f"class file {file} has no examples; every class needs at least one")
    return utterances


def _parse_line(file: Path, number: int, line: str) -> Utterance:
    try:
        record = json.loads(line)
    except ValueError as error:
        reason = getattr(error, "msg", str(error))
        raise CorpusError(f"{file}:{number}: not a JSON object ({reason})") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{file}:{number}: not a JSON object (found {type(record).__name__})")
    for field in ("text", "label"):
        if not isinstance(record.get(field), str):
            problem = "is missing" if field not in record else "is not a string"
            raise CorpusError(
                f'{file}:{number}: field "{field}" {problem}; each line needs "text" and "label"'
            )
    for field in ("text", "label"):
        refuse_unencodable(record[field], f"{file}:{number}", field)
    refuse_oversized(record["text"], file.stem, record["label"], f"{file}:{number}")
    return Utterance(text=record["text"], label=record["label"])
