"""The user's own data: a file or directory turned into classes to stream from.

Two kinds come out. *Running* text (one long text per class, streamed as a
character sequence) comes from a CALM corpus directory or a directory of
`<class>/*.txt` files. *Utterances* (short texts, each with a class and an
optional label) come from JSONL, CSV/TSV or a Hugging Face `save_to_disk`
directory. Everything wrong with the data is a one-line CorpusError that names
the file, and the line or row where there is one.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from producers.wire import MAX_NAME_BYTES, MAX_RECORD_BYTES

from .calm_dir import (CLASS_SUFFIX, UTF8_BOM, CorpusError, load_corpus_dir, refuse_nul, refuse_oversized,
                       refuse_undecodable_name, refuse_unencodable)

__all__ = ["FORMATS", "UserData", "UserExample", "load_user_data"]

FORMATS = ("auto", "calm", "class_dirs", "jsonl", "csv", "tsv", "hf")
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}
_DELIMITERS = {"csv": ",", "tsv": "\t"}


@dataclass(frozen=True)
class UserExample:
    """One utterance: its text and an optional finer label (an intent, say)."""

    text: str
    label: str | None


@dataclass(frozen=True)
class UserData:
    """Loaded user data; classes are sorted, examples keep file order.

    kind "running" fills `texts` (class -> text); kind "utterance" fills
    `examples` (class -> examples). `source` is the path it came from and
    `format` the format it was read as.
    """

    kind: str
    texts: dict[str, str]
    examples: dict[str, list[UserExample]]
    source: str
    format: str

    @property
    def classes(self) -> list[str]:
        return list(self.texts if self.kind == "running" else self.examples)


@dataclass(frozen=True)
class _Fields:
    text: str
    class_: str
    label: str | None


def load_user_data(
    path: Path | str,
    *,
    format: str = "auto",
    text_field: str = "text",
    class_field: str = "class",
    label_field: str | None = "label",
    split: str | None = None,
    columns: list[str] | None = None,
) -> UserData:
    """Load the user's data from `path`, guessing the format unless `format` names one.

    `text_field`, `class_field` and `label_field` name the fields (JSONL keys,
    CSV/TSV header columns, dataset columns) of utterance data; the label is
    optional and `label_field=None` ignores it. `split` picks a split of a
    saved DatasetDict ("train" by default). `columns` names the columns of a
    CSV/TSV file that has no header row (MTOP's files, say).
    """
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"user data {path} does not exist")
    if format not in FORMATS:
        raise CorpusError(f"unknown format {format!r} for {path}; use one of {', '.join(FORMATS)}")
    if format == "auto":
        format = _detect_format(path)
    needs_directory = format in ("calm", "class_dirs", "hf")
    if needs_directory != path.is_dir():
        wanted = "a directory" if needs_directory else "a file"
        raise CorpusError(f"format {format!r} needs {wanted}, but {path} is not one")
    if format == "calm":
        return UserData("running", load_corpus_dir(path), {}, str(path), format)
    if format == "class_dirs":
        return UserData("running", _load_class_dirs(path), {}, str(path), format)
    fields = _Fields(text_field, class_field, label_field)
    if format == "jsonl":
        examples = _load_jsonl(path, fields)
    elif format == "hf":
        examples = _load_hf(path, fields, split)
    else:
        examples = _load_delimited(path, fields, _DELIMITERS[format], columns)
    _check_classes(path, examples, f" in field {class_field!r}")
    return UserData("utterance", {}, dict(sorted(examples.items())), str(path), format)


def _detect_format(path: Path) -> str:
    if path.is_file():
        if path.suffix.lower() in _SUFFIX_FORMATS:
            return _SUFFIX_FORMATS[path.suffix.lower()]
        raise CorpusError(
            f"unknown format for {path}: suffix {path.suffix or '(none)'!r} is not one of "
            f"{', '.join(_SUFFIX_FORMATS)}: give the file one of those suffixes"
        )
    if any((path / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json")):
        return "hf"
    has_class_files = any(_is_class_file(file) for file in path.iterdir())
    has_class_dirs = any(any(_is_class_file(file) for file in sub.iterdir()) for sub in _class_dirs(path))
    if has_class_files and has_class_dirs:
        raise CorpusError(
            f"directory {path} holds both <class>{CLASS_SUFFIX} files and <class>/ directories; "
            "keep one of the two layouts"
        )
    if has_class_dirs:
        return "class_dirs"
    if has_class_files:
        return "calm"
    raise CorpusError(
        f"unknown format for directory {path}: no <class>{CLASS_SUFFIX} files, no <class>/*{CLASS_SUFFIX} "
        "directories and no dataset_dict.json/state.json of a datasets save_to_disk directory"
    )


def _is_class_file(file: Path) -> bool:
    return file.suffix == CLASS_SUFFIX and file.is_file()


def _class_dirs(path: Path) -> list[Path]:
    return sorted(sub for sub in path.iterdir() if sub.is_dir() and not sub.name.startswith("."))


# Running text


def _load_class_dirs(path: Path) -> dict[str, str]:
    texts = {}
    for class_dir in _class_dirs(path):
        refuse_undecodable_name(class_dir)
        files = sorted(file for file in class_dir.iterdir() if _is_class_file(file))
        if not files:
            raise CorpusError(f"class directory {class_dir} holds no *{CLASS_SUFFIX} files")
        pieces = [_read_utf8(file).rstrip("\r\n") for file in files]
        text = "\n".join(piece for piece in pieces if piece.strip())
        if not text:
            raise CorpusError(
                f"class directory {class_dir} is empty: its {len(files)} *{CLASS_SUFFIX} files hold no text"
            )
        texts[class_dir.name] = text
    _check_classes(path, texts, " (class directories)")
    return texts


def _read_utf8(file: Path) -> str:
    """The file's text (a leading BOM dropped); bad bytes name the line and byte offset."""
    data = file.read_bytes()
    start = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        line = data.count(b"\n", 0, offset) + 1
        raise CorpusError(
            f"{file}:{line}: not valid UTF-8: byte 0x{data[offset]:02x} at byte offset {offset} ({error.reason})"
        ) from None
    refuse_nul(file, data)
    return text


def _check_classes(path: Path, by_class: Mapping[str, object], where: str) -> None:
    if len(by_class) >= 2:
        return
    found = ", ".join(repr(name) for name in by_class) or "none"
    raise CorpusError(
        f"{path} has {len(by_class)} class{'es' if len(by_class) != 1 else ''} ({found}){where}; "
        "a stream needs at least 2 classes"
    )


# Utterances


def _example(record: Mapping[str, object], where: str, fields: _Fields) -> tuple[str, UserExample]:
    """The class and example of one record; `where` is "file:line" or "dir row N"."""
    for field in (fields.text, fields.class_):
        if field not in record:
            present = ", ".join(repr(name) for name in record) or "none"
            raise CorpusError(f"{where}: missing field {field!r} (fields present: {present}); {_rename(fields)}")
    text = record[fields.text]
    if text is not None and not isinstance(text, str):
        raise CorpusError(f"{where}: field {fields.text!r} is a {type(text).__name__}, expected a string")
    if text is None or not text.strip():
        raise CorpusError(f"{where}: empty text in field {fields.text!r}")
    _refuse_nul_in(text, where, fields.text)
    refuse_unencodable(text, where, fields.text)
    class_name = _as_name(record[fields.class_], where, fields.class_)
    if class_name is None:
        raise CorpusError(f"{where}: empty class in field {fields.class_!r}")
    label = None
    if fields.label is not None and fields.label in record:
        label = _as_name(record[fields.label], where, fields.label)
    refuse_oversized(text, class_name, label, where)
    return class_name, UserExample(text, label)


def _rename(fields: _Fields) -> str:
    """What to do about a missing field: what `streamer produce --corpus` reads (the defaults), or what the
    caller of load_user_data named."""
    label = f", optionally {fields.label!r} for a finer label" if fields.label else ""
    return f"the data needs a {fields.text!r} field for the text and a {fields.class_!r} field{label}: rename yours"


def _as_name(value: object, where: str, field: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise CorpusError(
            f"{where}: field {field!r} is a {type(value).__name__}, expected a string or an integer"
        )
    name = str(value)  # a record's header: what a learner dead-letters (producers.wire, bad_headers) is refused here
    _refuse_nul_in(name, where, field)
    refuse_unencodable(name, where, field)
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise CorpusError(f"{where}: field {field!r} holds {len(name.encode('utf-8'))} bytes; a class or label "
                          f"name holds at most {MAX_NAME_BYTES}")
    return name


def _refuse_nul_in(value: str, where: str, field: str) -> None:
    """A NUL in a field's text or name (a JSON \\u0000; the file's bytes hold none, refuse_nul): a learner
    dead-letters such a record (producers.wire: nul_byte in a value, bad_headers in a name)."""
    if "\0" in value:
        raise CorpusError(f"{where}: a NUL character (U+0000) in field {field!r} at {value.index(chr(0))}: "
                          "binary or corrupt data, not text")


def _add(examples: dict[str, list[UserExample]], item: tuple[str, UserExample]) -> None:
    examples.setdefault(item[0], []).append(item[1])


def _load_jsonl(path: Path, fields: _Fields) -> dict[str, list[UserExample]]:
    examples: dict[str, list[UserExample]] = {}
    for number, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CorpusError(f"{path}:{number}: bad JSON at column {error.colno}: {error.msg}") from None
        if not isinstance(record, dict):
            raise CorpusError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        _add(examples, _example(record, f"{path}:{number}", fields))
    return examples


def _load_delimited(
    path: Path, fields: _Fields, delimiter: str, columns: list[str] | None
) -> dict[str, list[UserExample]]:
    """The rows of a CSV/TSV file, its fields allowed up to MAX_RECORD_BYTES characters while it is read (the csv
    module's default of 131,072 refused utterances JSONL takes): the process-wide limit is restored afterwards, so
    other csv readers keep theirs. A longer field could not fit a record anyway: it is refused as too large."""
    previous = csv.field_size_limit(MAX_RECORD_BYTES)
    try:
        return _read_delimited(path, fields, delimiter, columns)
    finally:
        csv.field_size_limit(previous)


def _read_delimited(
    path: Path, fields: _Fields, delimiter: str, columns: list[str] | None
) -> dict[str, list[UserExample]]:
    reader = csv.reader(io.StringIO(_read_utf8(path), newline=""), delimiter=delimiter)
    try:
        header = list(columns) if columns is not None else next(reader)
    except (StopIteration, csv.Error) as error:
        raise CorpusError(f"{path}:1: no header row ({str(error) or 'the file is empty'})") from None
    for field in (fields.text, fields.class_):
        if field not in header:
            names = ", ".join(repr(name) for name in header) or "none"
            where = "the columns given" if columns is not None else "the header row"
            headerless = "" if columns is not None else " (a file without a header row needs one added)"
            raise CorpusError(f"{path}: missing column {field!r} in {where} (columns: {names}); "
                              f"{_rename(fields)}{headerless}")
    examples: dict[str, list[UserExample]] = {}
    next_line = reader.line_num + 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            if str(error).startswith("field larger than field limit"):
                raise CorpusError(f"{path}:{next_line}: a field of over {MAX_RECORD_BYTES:,} characters: its record "
                                  f"would be over the {MAX_RECORD_BYTES:,} bytes a learner takes (and Kafka's default "
                                  "limit); split or shorten it") from None
            kind = "TSV" if delimiter == "\t" else "CSV"
            raise CorpusError(f"{path}:{next_line}: bad {kind} row: {error}") from None
        where, next_line = f"{path}:{next_line}", reader.line_num + 1
        if not any(cell.strip() for cell in row):
            continue
        _add(examples, _example(dict(zip(header, row)), where, fields))
    return examples


def _load_hf(path: Path, fields: _Fields, split: str | None) -> dict[str, list[UserExample]]:
    directory = _hf_split_dir(path, split)
    try:
        table, class_names = _hf_columns_with_datasets(directory)
    except ImportError:
        try:
            table, class_names = _hf_columns_with_pyarrow(directory)
        except ImportError:
            raise CorpusError(
                f"{path} is a Hugging Face datasets directory; reading it needs `pip install datasets` "
                "(or pyarrow)"
            ) from None
    for field in (fields.text, fields.class_):
        if field not in table:
            names = ", ".join(repr(name) for name in table) or "none"
            raise CorpusError(f"{directory}: missing column {field!r} (columns: {names}); {_rename(fields)}")
    wanted = [name for name in (fields.text, fields.class_, fields.label) if name in table]
    for name in wanted:
        if name in class_names:  # ClassLabel columns hold indices into the names
            names = class_names[name]
            table[name] = [None if index is None or index < 0 else names[index] for index in table[name]]
    examples: dict[str, list[UserExample]] = {}
    for row in range(len(table[fields.text])):
        record = {name: table[name][row] for name in wanted}
        _add(examples, _example(record, f"{directory} row {row}", fields))
    return examples


def _hf_split_dir(path: Path, split: str | None) -> Path:
    dict_file = path / "dataset_dict.json"
    if not dict_file.is_file():
        if split is not None:
            raise CorpusError(f"{path} is a single dataset, not a DatasetDict; leave out split={split!r}")
        return path
    splits = _read_json(dict_file).get("splits", [])
    chosen = split or "train"
    if chosen not in splits:
        raise CorpusError(
            f"{dict_file} has no split {chosen!r} (splits: {', '.join(splits) or 'none'}); pick one with split="
        )
    return path / chosen


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(_read_utf8(file))
    except json.JSONDecodeError as error:
        raise CorpusError(f"{file}:{error.lineno}: bad JSON: {error.msg}") from None
    if not isinstance(data, dict):
        raise CorpusError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _hf_columns_with_datasets(directory: Path) -> tuple[dict[str, list], dict[str, list[str]]]:
    import datasets

    dataset = datasets.load_from_disk(str(directory))
    class_names = {
        name: list(feature.names)
        for name, feature in dataset.features.items()
        if isinstance(feature, datasets.ClassLabel)
    }
    return dataset.to_dict(), class_names


def _hf_columns_with_pyarrow(directory: Path) -> tuple[dict[str, list], dict[str, list[str]]]:
    """Read the Arrow IPC stream files that state.json lists, as save_to_disk writes them."""
    import pyarrow
    import pyarrow.ipc

    state_file = directory / "state.json"
    if not state_file.is_file():
        raise CorpusError(f"datasets directory {directory} has no state.json")
    data_files = [entry["filename"] for entry in _read_json(state_file).get("_data_files", [])]
    tables = []
    for name in data_files:
        with pyarrow.memory_map(str(directory / name)) as source:
            tables.append(pyarrow.ipc.open_stream(source).read_all())
    if not tables:
        raise CorpusError(f"{state_file} lists no data files")
    info_file = directory / "dataset_info.json"
    features = _read_json(info_file).get("features", {}) if info_file.is_file() else {}
    class_names = {
        name: list(feature["names"])
        for name, feature in features.items()
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel"
    }
    return pyarrow.concat_tables(tables).to_pydict(), class_names
