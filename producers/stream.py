"""Build a CALM stream from a corpus directory, write its manifest, replay it into Kafka."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from producers.corpora import load_corpus_dir
from producers.kafka import produce
from producers.schedule import CalmSchedule, build_stream

__all__ = ["prepare_stream", "produce_stream"]


def prepare_stream(corpus_dir: Path, schedule: CalmSchedule, manifest_path: Path | None = None):
    """Return (records, manifest); write the manifest (ground truth) when a path is given."""
    corpus = load_corpus_dir(Path(corpus_dir))
    records, manifest = build_stream(corpus, schedule)
    manifest["corpus"] = str(corpus_dir)
    if manifest_path is not None:
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest_path.write_text(json.dumps(manifest, indent=1))
    return records, manifest


async def produce_stream(records, bootstrap_servers: str, topic: str, *, rate: float | None = None,
                         partitions: int = 1, progress: Callable[[int, int], None] | None = None) -> int:
    return await produce(records, bootstrap_servers, topic, rate=rate, partitions=partitions, progress=progress)
