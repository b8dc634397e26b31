"""Build a stream from a corpus directory, write its manifest and probe split, replay it into Kafka."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator

from producers.corpora import load_user_data
from producers.corpora.utterances import load_utterance_dir
from producers.kafka import produce
from producers.orders import ScheduleError
from producers.schedule import Schedule, build_stream
from producers.utterance_stream import build_utterance_stream
from producers.wire import Record

__all__ = ["prepare_stream", "produce_stream", "looped", "probe_file_names"]


def prepare_stream(corpus_dir: Path, schedule: Schedule, manifest_path: Path | None = None,
                   *, probe_examples: int = 50, utterances: bool | None = None):
    """Return (records, manifest); with a path, write the manifest (ground truth) and the
    probe split (`<manifest stem>.probe/<class>.txt`, never streamed; probe_file_names) beside it.

    Labelled utterances (a built utterance corpus, JSONL, CSV/TSV, HF datasets) stream one
    utterance per record with its label header, unless `utterances=False` turns them into
    running text; running text streams in byte windows."""
    path = Path(corpus_dir)
    level, kind, data = _load(path)
    if kind == "utterance" and utterances is not False:
        _fits_in_memory(schedule, len(data), records_per_token=1.0)
        records, manifest = build_utterance_stream(data, schedule, probe_examples=probe_examples)
    else:
        corpus = data if kind == "running" else {c: "\n".join(t for t, _ in xs) for c, xs in data.items()}
        bytes_per_token = 1.0
        if level == "word":  # lambda counts words: convert with the corpus's own bytes per word
            data_bytes = sum(len(t.encode("utf-8")) for t in corpus.values())
            bytes_per_token = data_bytes / max(1, sum(len(t.split()) for t in corpus.values()))
            schedule = dataclasses.replace(schedule, mean_tokens=max(1, round(schedule.mean_tokens * bytes_per_token)))
        _fits_in_memory(schedule, len(corpus), records_per_token=1.0 / schedule.window)
        records, manifest = build_stream(corpus, schedule)
        manifest["bytes_per_corpus_token"] = round(bytes_per_token, 4)
    manifest["corpus"] = str(corpus_dir)
    manifest["corpus_level"] = level
    if manifest_path is not None:
        write_manifest(manifest, manifest_path)
    return records, manifest


# a record in memory while its stream is built, before the first is sent: measured 980 bytes a record of a
# 20-byte window (calm-multilingual, 218,498 records in 204 MB)
RECORD_BYTES = 1000


def _fits_in_memory(schedule: Schedule, classes: int, records_per_token: float) -> None:
    """ScheduleError (one line) for a stream whose records could not all be held in half this machine's
    memory: every record is made before the first is sent, and `--fragments 100000000` took 1.2 GB in 25
    s without a word, on its way to exhausting the machine."""
    fragments = {"sequence": classes, "recurring": schedule.repeats * classes}.get(schedule.kind, schedule.n_fragments)
    records = fragments * schedule.mean_tokens * 1.1 * records_per_token  # (fragment lengths' mean: ~1.1 lambda)
    need, have = records * RECORD_BYTES, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have / 2:
        raise ScheduleError(f"a stream of {fragments:,} fragments of about {schedule.mean_tokens:,} tokens would take "
                            f"about {need / 1e9:,.0f} GB of memory to build (each of its ~{records:,.0f} records is "
                            f"made before the first is sent), over half of this machine's {have / 1e9:.0f} GB: give "
                            "fewer --fragments or a smaller --lambda")


def write_manifest(manifest: dict, manifest_path: Path) -> None:
    """The manifest at `manifest_path` (atomically), its probe split's texts beside it."""
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    probes = manifest["probe"]["classes"]
    probe_dir = manifest_path.with_name(manifest_path.name.removesuffix(".json") + ".probe")
    if probes:
        probe_dir.mkdir(exist_ok=True)
        manifest["probe"]["dir"] = str(probe_dir)
    files = probe_file_names(manifest["classes"])
    for name, probe in probes.items():
        text = probe.pop("text")
        (probe_dir / files[name]).write_text(text, encoding="utf-8")
        probe["file"] = files[name]
        probe["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    # atomically: a learner started beside the producer reads the whole manifest or none
    partial = manifest_path.with_name(f".{manifest_path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(partial, manifest_path)


_SAFE_STEM = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_INDEX_STEM = re.compile(r"class-[0-9]+", re.IGNORECASE)  # (CLASS-001.txt is class-001.txt where case is not told)


def probe_file_names(classes: list[str]) -> dict[str, str]:
    """Class -> its probe file's name: `<class>.txt` where the class name is a safe file name, else
    `class-<index>.txt` (its index in `classes`). A class name is the user's data (a JSONL field): used
    as is, "../../evil" wrote outside the probe folder, and "a/b" or a 253-byte name was a traceback. Safe:
    [A-Za-z0-9_.-]{1,100}, no leading ".", not itself of the form class-<digits>, and no other class's
    name but for case (one file on a case-insensitive file system). The manifest maps each class to its
    file (probe.classes[class].file), which is what a learner reads."""
    files, taken = {}, set()
    for index, name in enumerate(classes):
        safe = (_SAFE_STEM.fullmatch(name) is not None and not name.startswith(".")
                and _INDEX_STEM.fullmatch(name) is None and name.lower() not in taken)
        stem = name if safe else f"class-{index:03d}"
        taken.add(stem.lower())
        files[name] = f"{stem}.txt"
    return files


def _corpus_level(path: Path) -> str:
    """The token level of a built corpus (its manifest says), else bytes."""
    try:
        return json.loads((path / "manifest.json").read_text()).get("level", "byte")
    except (OSError, ValueError):
        return "byte"


def _load(path: Path):
    """(level, kind, data): kind "running" -> {class: text}; "utterance" -> {class: [(text, label)]}."""
    level = _corpus_level(path)
    if level == "utterance":  # a built utterance corpus: one <class>.jsonl per class
        return level, "utterance", {c: [(u.text, u.label) for u in us] for c, us in load_utterance_dir(path).items()}
    built = (path / "manifest.json").is_file()  # a corpus built into the cache is a CALM directory
    data = load_user_data(path, format="calm" if built else "auto")
    if data.kind == "running":
        return level, "running", data.texts
    return "utterance", "utterance", {c: [(e.text, e.label) for e in es] for c, es in data.examples.items()}


def looped(records: list[Record], manifest: dict) -> Iterator[Record]:
    """Replay the stream forever: each pass continues positions and fragment indices."""
    fragments = 1 + max(r.truth.fragment for r in records if r.truth)
    span = {}  # bytes per stream in one pass
    for record in records:
        span[record.stream] = span.get(record.stream, 0) + len(record.text.encode("utf-8"))
    lap = 0
    while True:
        for record in records:
            truth = record.truth
            if truth is not None:
                truth = dataclasses.replace(truth, fragment=truth.fragment + lap * fragments,
                                            position=truth.position + lap * span[record.stream])
            yield dataclasses.replace(record, truth=truth)
        lap += 1


async def produce_stream(records: Iterable[Record], bootstrap_servers: str, topic: str, *,
                         rate: float | None = None, token_rate: float | None = None, partitions: int = 1,
                         truth_topic: bool = True,
                         progress: Callable[[int, int], None] | None = None,
                         client_options=None, broker_timeout_s: float = 60.0,
                         log: Callable[[str], None] | None = None) -> int:
    return await produce(records, bootstrap_servers, topic, rate=rate, token_rate=token_rate,
                         partitions=partitions, truth_topic=f"{topic}.truth" if truth_topic else None,
                         progress=progress, client_options=client_options, broker_timeout_s=broker_timeout_s, log=log)
