"""load_user_data: every format loads, every problem is a one-line CorpusError naming where."""

import json
import sys

import pytest

from producers.corpora.calm_dir import CorpusError
from producers.corpora.user import UserExample, load_user_data

pyarrow = pytest.importorskip("pyarrow")

try:
    import datasets
except ImportError:
    datasets = None

ROWS = [
    {"text": "wake me at seven", "class": "alarm", "label": "set_alarm"},
    {"text": "play some jazz", "class": "music", "label": "play_music"},
    {"text": "cancel my alarm", "class": "alarm", "label": "cancel_alarm"},
    {"text": "next song", "class": "music"},
]
EXPECTED = {
    "alarm": [UserExample("wake me at seven", "set_alarm"), UserExample("cancel my alarm", "cancel_alarm")],
    "music": [UserExample("play some jazz", "play_music"), UserExample("next song", None)],
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def error_for(path, **options) -> str:
    with pytest.raises(CorpusError) as caught:
        load_user_data(path, **options)
    message = str(caught.value)
    assert "\n" not in message
    return message


# Formats


def test_calm_corpus_directory_is_running_text(tmp_path):
    (tmp_path / "fr.txt").write_text("le chien dort\n", encoding="utf-8")
    (tmp_path / "en.txt").write_text("the dog sleeps\n", encoding="utf-8")
    data = load_user_data(tmp_path)
    assert (data.kind, data.format, data.source) == ("running", "calm", str(tmp_path))
    assert list(data.texts) == ["en", "fr"] == data.classes
    assert data.texts["fr"] == "le chien dort\n"
    assert data.examples == {}


def test_class_directories_join_sorted_files(tmp_path):
    for class_name, files in {"zh": {"b.txt": "二\n", "a.txt": "一\n"}, "cs": {"1.txt": "kůň", "2.txt": " \n"}}.items():
        (tmp_path / class_name).mkdir()
        for name, text in files.items():
            (tmp_path / class_name / name).write_text(text, encoding="utf-8")
    (tmp_path / "zh" / "notes.md").write_text("not a class file")
    (tmp_path / ".cache").mkdir()
    data = load_user_data(tmp_path)
    assert (data.kind, data.format) == ("running", "class_dirs")
    assert data.texts == {"cs": "kůň", "zh": "一\n二"}


def test_jsonl_keeps_file_order_and_sorts_classes(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(path, ROWS[:2]).read_bytes() + b"\n")
    with path.open("a", encoding="utf-8") as file:
        file.writelines(json.dumps(record) + "\n" for record in ROWS[2:])
    data = load_user_data(path)
    assert (data.kind, data.format, data.texts) == ("utterance", "jsonl", {})
    assert data.examples == EXPECTED
    assert data.classes == ["alarm", "music"]


def test_jsonl_with_named_fields_like_massive(tmp_path):
    records = [
        {"id": "1", "utt": "wake me up at nine", "scenario": "alarm", "intent": "alarm_set"},
        {"id": "2", "utt": "what's the weather", "scenario": "weather", "intent": "weather_query"},
    ]
    data = load_user_data(
        write_jsonl(tmp_path / "en-US.jsonl", records), text_field="utt", class_field="scenario", label_field="intent"
    )
    assert data.examples == {
        "alarm": [UserExample("wake me up at nine", "alarm_set")],
        "weather": [UserExample("what's the weather", "weather_query")],
    }


def test_csv_with_header(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text(
        'class,label,text\nalarm,set_alarm,wake me at seven\nmusic,play_music,"play some jazz"\n'
        'alarm,cancel_alarm,"cancel my alarm"\nmusic,,next song\n',
        encoding="utf-8",
    )
    data = load_user_data(path)
    assert (data.kind, data.format) == ("utterance", "csv")
    assert data.examples == EXPECTED


def test_tsv_with_named_columns(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_text("utterance\tdomain\nset an alarm, please\talarm\nplay jazz\tmusic\n", encoding="utf-8")
    data = load_user_data(path, text_field="utterance", class_field="domain", label_field=None)
    assert data.format == "tsv"
    assert data.examples == {"alarm": [UserExample("set an alarm, please", None)], "music": [UserExample("play jazz", None)]}


def test_headerless_tsv_like_mtop(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(
        "1\tIN:SET_ALARM\t\twake me at 7\talarm\ten_XX\n2\tIN:PLAY_MUSIC\t\tplay jazz\tmusic\ten_XX\n", encoding="utf-8"
    )
    data = load_user_data(
        path,
        format="tsv",
        columns=["id", "intent", "slots", "utterance", "domain", "locale"],
        text_field="utterance",
        class_field="domain",
        label_field="intent",
    )
    assert data.examples == {
        "alarm": [UserExample("wake me at 7", "IN:SET_ALARM")],
        "music": [UserExample("play jazz", "IN:PLAY_MUSIC")],
    }


def save_dataset(directory, columns, class_labels=None):
    """Write a datasets save_to_disk directory: with datasets when it is installed, else with pyarrow."""
    if datasets is not None:
        features = datasets.Features(
            {
                name: datasets.ClassLabel(names=class_labels) if name == "class" and class_labels else datasets.Value("string")
                for name in columns
            }
        )
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(directory))
    else:
        write_arrow_dataset(directory, columns, class_labels)
    return directory


def write_arrow_dataset(directory, columns, class_labels=None):
    """The layout save_to_disk writes: an Arrow IPC stream, state.json and dataset_info.json."""
    directory.mkdir(parents=True)
    table = pyarrow.table(columns)
    with pyarrow.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
        with pyarrow.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    features = {name: {"dtype": "string", "_type": "Value"} for name in columns}
    if class_labels:
        features["class"] = {"names": class_labels, "_type": "ClassLabel"}
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": features}))
    return directory


def hf_columns():
    return {
        "text": [row["text"] for row in ROWS],
        "class": [row["class"] for row in ROWS],
        "label": [row.get("label") for row in ROWS],
    }


def test_hf_dataset_directory(tmp_path):
    data = load_user_data(save_dataset(tmp_path / "ds", hf_columns()))
    assert (data.kind, data.format) == ("utterance", "hf")
    assert data.examples == EXPECTED


def test_hf_class_label_column_reads_names(tmp_path):
    columns = {"text": ["wake me", "play jazz"], "class": [1, 0]}
    data = load_user_data(save_dataset(tmp_path / "ds", columns, class_labels=["music", "alarm"]))
    assert data.examples == {"alarm": [UserExample("wake me", None)], "music": [UserExample("play jazz", None)]}


def test_hf_pyarrow_fallback_without_datasets(tmp_path, monkeypatch):
    directory = write_arrow_dataset(tmp_path / "ds", hf_columns())
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    assert load_user_data(directory).examples == EXPECTED
    columns = {"text": ["wake me", "play jazz"], "class": [1, 0]}
    labelled = write_arrow_dataset(tmp_path / "labelled", columns, class_labels=["music", "alarm"])
    assert load_user_data(labelled).classes == ["alarm", "music"]


@pytest.mark.skipif(datasets is None, reason="needs datasets to write a DatasetDict")
def test_hf_dataset_dict_uses_train_or_the_named_split(tmp_path):
    train = datasets.Dataset.from_dict(hf_columns())
    test = datasets.Dataset.from_dict({"text": ["a", "b"], "class": ["x", "y"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    assert load_user_data(tmp_path / "dd").examples == EXPECTED
    assert load_user_data(tmp_path / "dd", split="test").classes == ["x", "y"]
    message = error_for(tmp_path / "dd", split="validation")
    assert "dataset_dict.json" in message and "'validation'" in message and "train, test" in message


# Errors, one by one


def test_missing_path(tmp_path):
    message = error_for(tmp_path / "nowhere.jsonl")
    assert str(tmp_path / "nowhere.jsonl") in message and "does not exist" in message


def test_unknown_format_name(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    message = error_for(path, format="parquet")
    assert "unknown format 'parquet'" in message and str(path) in message and "jsonl, csv, tsv" in message


def test_unknown_file_suffix(tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_bytes(b"PK")
    message = error_for(path)
    assert "unknown format" in message and str(path) in message and "'.xlsx'" in message
    assert "give the file one of those suffixes" in message and "format=" not in message


def test_unrecognised_directory(tmp_path):
    (tmp_path / "readme.md").write_text("hello")
    message = error_for(tmp_path)
    assert f"unknown format for directory {tmp_path}" in message


def test_format_needs_a_directory(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    assert f"format 'hf' needs a directory, but {path}" in error_for(path, format="hf")


def test_missing_field_in_jsonl_names_the_fields_present(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], {"utt": "hello", "class": "greet"}])
    message = error_for(path)
    assert message.startswith(f"{path}:2: missing field 'text'")
    # what `streamer produce --corpus` can act on (it has no text_field= to give)
    assert "fields present: 'utt', 'class'" in message and "needs a 'text' field" in message
    assert "rename yours" in message and "text_field=" not in message


def test_missing_column_in_csv_header(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("utterance,intent\nhi,greet\n", encoding="utf-8")
    message = error_for(path, text_field="utterance")
    assert f"{path}: missing column 'class'" in message and "columns: 'utterance', 'intent'" in message
    assert "needs a 'utterance' field for the text and a 'class' field" in message and "class_field=" not in message
    assert "a file without a header row needs one added" in message


def test_missing_column_in_hf_dataset(tmp_path):
    directory = save_dataset(tmp_path / "ds", {"sentence": ["a", "b"], "class": ["x", "y"]})
    message = error_for(directory)
    assert f"{directory}: missing column 'text'" in message and "'sentence', 'class'" in message


def test_empty_class_directory(tmp_path):
    for class_name, text in {"en": "hello", "fr": "  \n\n"}.items():
        (tmp_path / class_name).mkdir()
        (tmp_path / class_name / "a.txt").write_text(text, encoding="utf-8")
    message = error_for(tmp_path)
    assert f"class directory {tmp_path / 'fr'} is empty" in message


def test_class_directory_without_text_files(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "a.txt").write_text("hello", encoding="utf-8")
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "a.md").write_text("bonjour", encoding="utf-8")
    assert f"class directory {tmp_path / 'fr'} holds no *.txt files" in error_for(tmp_path, format="class_dirs")


def test_empty_calm_class_file(tmp_path):
    (tmp_path / "en.txt").write_text("hello", encoding="utf-8")
    (tmp_path / "fr.txt").write_text("", encoding="utf-8")
    assert f"class file {tmp_path / 'fr.txt'} is empty" in error_for(tmp_path)


def test_undecodable_bytes_in_jsonl_give_line_and_offset(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "ok", "class": "a"}\n{"text": "caf\xe9", "class": "b"}\n')
    message = error_for(path)
    assert message.startswith(f"{path}:2: not valid UTF-8: byte 0xe9 at byte offset 42 (invalid continuation byte)")


def test_undecodable_bytes_in_class_directory_file(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "a.txt").write_text("hello", encoding="utf-8")
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "a.txt").write_bytes(b"\xef\xbb\xbfbon\xffjour")
    assert f"{tmp_path / 'fr' / 'a.txt'}:1: not valid UTF-8: byte 0xff at byte offset 6" in error_for(tmp_path)


def test_only_one_class(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], ROWS[2]])
    message = error_for(path)
    assert f"{path} has 1 class ('alarm') in field 'class'" in message and "at least 2 classes" in message


def test_only_one_class_directory(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "a.txt").write_text("hello", encoding="utf-8")
    assert f"{tmp_path} has 1 class ('en')" in error_for(tmp_path)


def test_an_empty_csv_says_the_file_is_empty(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("", encoding="utf-8")
    assert error_for(path) == f"{path}:1: no header row (the file is empty)"


def test_no_rows_at_all(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text,class\n", encoding="utf-8")
    assert f"{path} has 0 classes (none)" in error_for(path)


def test_empty_text_in_jsonl_row(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], ROWS[1], {"text": "  ", "class": "music"}])
    assert error_for(path) == f"{path}:3: empty text in field 'text'"


def test_empty_text_in_csv_row_counts_the_header_line(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text('text,class\nhello,a\n"multi\nline",b\n,b\n', encoding="utf-8")
    assert error_for(path) == f"{path}:5: empty text in field 'text'"


def test_empty_text_in_hf_row(tmp_path):
    directory = save_dataset(tmp_path / "ds", {"text": ["hello", ""], "class": ["a", "b"]})
    assert error_for(directory) == f"{directory} row 1: empty text in field 'text'"


def test_empty_class_in_jsonl_row(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], {"text": "hello", "class": ""}])
    assert error_for(path) == f"{path}:2: empty class in field 'class'"


def test_bad_json_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"text": "oops", "class": \n', encoding="utf-8")
    message = error_for(path)
    assert message.startswith(f"{path}:2: bad JSON at column")


def test_json_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n["text", "class"]\n', encoding="utf-8")
    assert error_for(path) == f"{path}:2: expected a JSON object, got list"


def test_hf_without_datasets_or_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    directory = write_arrow_dataset(tmp_path / "ds", hf_columns())
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert "pip install datasets" in error_for(directory)


def test_split_on_a_single_dataset(tmp_path):
    directory = write_arrow_dataset(tmp_path / "ds", hf_columns())
    assert "not a DatasetDict; leave out split='test'" in error_for(directory, split="test")


def test_a_nul_in_the_text_is_refused_naming_where(tmp_path):
    """A learner dead-letters a record holding a NUL (producers.wire, nul_byte): produce refuses it first,
    naming the file and line, whatever the format (before, produce sent it and the stream lost it)."""
    jsonl = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], {"text": "play\u0000jazz", "class": "music"}])
    assert error_for(jsonl).startswith(f"{jsonl}:2: a NUL character (U+0000) in field 'text' at 4")
    calm = tmp_path / "calm"
    calm.mkdir()
    (calm / "en.txt").write_text("the dog\nsleeps", encoding="utf-8")
    (calm / "fr.txt").write_bytes(b"le chien\ndo\x00rt\n")
    assert error_for(calm).startswith(f"{calm / 'fr.txt'}:2: a NUL byte at byte offset 11")
    dirs = tmp_path / "dirs"
    for name, data in {"en": b"hello\n", "fr": b"\xef\xbb\xbfbon\x00jour"}.items():
        (dirs / name).mkdir(parents=True)
        (dirs / name / "a.txt").write_bytes(data)
    assert error_for(dirs).startswith(f"{dirs / 'fr' / 'a.txt'}:1: a NUL byte at byte offset 6")
    for field, value in (("class", "al\u0000arm"), ("label", "set\u0000alarm")):  # headers, dead-lettered too
        named = write_jsonl(tmp_path / f"{field}.jsonl", [ROWS[1], {**ROWS[0], field: value}])
        assert error_for(named).startswith(f"{named}:2: a NUL character (U+0000) in field '{field}'")
    long_name = write_jsonl(tmp_path / "long.jsonl", [ROWS[1], {**ROWS[0], "class": "é" * 129}])
    assert error_for(long_name).startswith(f"{long_name}:2: field 'class' holds 258 bytes; a class or label name")
    csv_file = tmp_path / "data.csv"
    csv_file.write_text('text,class\nhi,a\n"x\u0000y",b\n', encoding="utf-8")
    assert "a NUL" in error_for(csv_file)


def test_an_utterance_too_large_for_one_record_is_refused_naming_where(tmp_path):
    """A record over producers.wire.MAX_RECORD_BYTES is one no learner takes (too_large) and Kafka's default
    limit refuses: refused at load, naming file and line, in user data and in a built utterance directory;
    one just under the limit loads."""
    from producers.corpora.utterances import load_utterance_dir
    from producers.wire import MAX_RECORD_BYTES, largest_record_bytes

    fits = "x" * (MAX_RECORD_BYTES - largest_record_bytes("", "music", None))
    jsonl = write_jsonl(tmp_path / "data.jsonl", [ROWS[0], {"text": fits, "class": "music"}])
    assert load_user_data(jsonl).examples["music"][0].text == fits
    jsonl = write_jsonl(tmp_path / "big.jsonl", [ROWS[0], ROWS[1], {"text": fits + "x", "class": "music"}])
    message = error_for(jsonl)
    assert message.startswith(f"{jsonl}:3: an utterance of {len(fits) + 1:,} bytes") and "split or shorten" in message
    built = tmp_path / "built"
    built.mkdir()
    (built / "a.jsonl").write_text(json.dumps({"text": "hello", "label": "l"}) + "\n", encoding="utf-8")
    (built / "b.jsonl").write_text(json.dumps({"text": "x" * 3_000_000, "label": "l"}) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=rf"^{built / 'b.jsonl'}:1: an utterance of 3,000,000 bytes"):
        load_utterance_dir(built)


def test_a_lone_surrogate_is_refused_naming_where(tmp_path):
    """A JSON line's unpaired \\ud800 escape decodes to a string UTF-8 cannot encode: refused at load naming
    file, line and field, in the text, the class or the label (before, produce died on it with a
    UnicodeEncodeError traceback), and in a built utterance directory too."""
    from producers.corpora.utterances import load_utterance_dir

    for field, value, at in (("text", "bad \ud800 surrogate", 4), ("class", "f\udc80r", 1), ("label", "\ud83d", 0)):
        path = tmp_path / f"{field}.jsonl"
        lines = [json.dumps(ROWS[1]), json.dumps({**ROWS[0], field: value})]  # (json.dumps writes \ud800 escapes)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        message = error_for(path)
        code = ord(value[at])
        assert message.startswith(f"{path}:2: a lone surrogate (U+{code:04X}) in field '{field}' at {at}: "
                                  "not encodable as UTF-8"), message
    built = tmp_path / "built"
    built.mkdir()
    (built / "a.jsonl").write_text(json.dumps({"text": "hello", "label": "l"}) + "\n", encoding="utf-8")
    (built / "b.jsonl").write_text(json.dumps({"text": "é \udfff", "label": "l"}) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=rf"^{built / 'b.jsonl'}:1: a lone surrogate \(U\+DFFF\) in field 'text'"):
        load_utterance_dir(built)


def test_csv_and_tsv_take_utterances_up_to_the_record_limit(tmp_path):
    """The csv module refuses fields over 131,072 characters by default: a CSV/TSV utterance of 200,000 was
    'field larger than field limit' while JSONL took it. Now both take up to the record limit, a field over it
    is refused as too large for a record, naming the line, and the csv module's own limit is left as it was."""
    import csv

    from producers.wire import MAX_RECORD_BYTES, largest_record_bytes

    fits = "x" * (MAX_RECORD_BYTES - largest_record_bytes("", "music", None))
    before = csv.field_size_limit()
    for suffix, sep in ((".csv", ","), (".tsv", "\t")):
        path = tmp_path / f"big{suffix}"
        rows = f"text{sep}class\nhi{sep}alarm\n{'y' * 200_000}{sep}alarm\n{fits}{sep}music\n"
        path.write_text(rows, encoding="utf-8")
        data = load_user_data(path)
        assert [len(e.text) for e in data.examples["alarm"]] == [2, 200_000]
        assert data.examples["music"][0].text == fits
        over = tmp_path / f"over{suffix}"
        over.write_text(f"text{sep}class\nhi{sep}alarm\n{fits}x{sep}music\n{'z' * (MAX_RECORD_BYTES + 1)}{sep}music\n",
                        encoding="utf-8")
        assert error_for(over).startswith(f"{over}:3: an utterance of {len(fits) + 1:,} bytes")
        over.write_text(f"text{sep}class\nhi{sep}alarm\n{'z' * (MAX_RECORD_BYTES + 1)}{sep}music\n", encoding="utf-8")
        message = error_for(over)
        assert message.startswith(f"{over}:3: a field of over {MAX_RECORD_BYTES:,} characters") and "shorten" in message
        assert csv.field_size_limit() == before


def test_a_calm_class_file_drops_a_leading_byte_order_mark(tmp_path):
    """JSONL and <class>/*.txt drop a leading UTF-8 BOM; a CALM class file kept it and streamed "\\ufeff" as text
    (and a built utterance directory's class file failed to parse as JSON on its first line). Offsets of a bad
    byte still count the file's bytes."""
    from producers.corpora.utterances import load_utterance_dir

    (tmp_path / "en.txt").write_bytes(b"\xef\xbb\xbfhello\n")
    (tmp_path / "fr.txt").write_text("bonjour\n", encoding="utf-8")
    assert load_user_data(tmp_path).texts == {"en": "hello\n", "fr": "bonjour\n"}
    (tmp_path / "fr.txt").write_bytes(b"\xef\xbb\xbfbon\xffjour")
    assert f"class file {tmp_path / 'fr.txt'} is not valid UTF-8: byte 0xff at byte offset 6" in error_for(tmp_path)
    (tmp_path / "fr.txt").write_bytes(b"\xef\xbb\xbf\n")
    assert "is empty" in error_for(tmp_path)
    built = tmp_path / "built"
    built.mkdir()
    for name in ("a", "b"):
        line = json.dumps({"text": f"hello {name}", "label": "l"}) + "\n"
        (built / f"{name}.jsonl").write_bytes(b"\xef\xbb\xbf" + line.encode("utf-8"))
    assert {name: [u.text for u in us] for name, us in load_utterance_dir(built).items()} == {
        "a": ["hello a"], "b": ["hello b"]}


def test_a_class_named_by_a_file_name_that_is_not_utf8_is_refused(tmp_path):
    """A class file or directory named with bytes that are not UTF-8 gave a class name holding lone surrogates,
    and produce died on it with a UnicodeEncodeError traceback: refused at load, the name shown as bytes."""
    import os

    from producers.corpora.utterances import load_utterance_dir

    bad = os.fsdecode(b"caf\xe9")
    for layout in ("calm", "dirs", "built"):
        root = tmp_path / layout
        root.mkdir()
        for name in ("en", bad):
            if layout == "dirs":
                (root / name).mkdir()
                (root / name / "a.txt").write_text("hello\n", encoding="utf-8")
            elif layout == "calm":
                (root / f"{name}.txt").write_text("hello\n", encoding="utf-8")
            else:
                (root / f"{name}.jsonl").write_text('{"text": "hello", "label": "l"}\n', encoding="utf-8")
        with pytest.raises(CorpusError) as caught:
            load_utterance_dir(root) if layout == "built" else load_user_data(root)
        named = b"caf\xe9" if layout == "dirs" else b"caf\xe9" + (b".jsonl" if layout == "built" else b".txt")
        assert str(caught.value) == f"{root}: the name {named!r} is not UTF-8, and a class is named by it: rename it"
