"""The corpus cache: the registry of buildable corpora and their built directories.

Every function takes the cache root explicitly (the command line decides where it is).
A built corpus is `<root>/<name>/`: one `<class>.txt` per class and a
`manifest.json` written last. A build runs in a hidden staging directory beside
the target and is renamed into place, so a corpus directory is either complete
or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .calm_dir import CLASS_SUFFIX, CorpusError, load_corpus_dir
from .libreoffice import build_calm_multilingual
from .multidomain import DESCRIPTION as _MULTIDOMAIN_DESCRIPTION
from .multidomain import NAME as _MULTIDOMAIN
from .multidomain import build_calm_multidomain
from .intents import build_intents_multilingual
from .multiwoz import build_multiwoz_domains
from .utterances import describe_utterance_dir

__all__ = [
    "CorpusMissing",
    "CorpusSpec",
    "CORPORA",
    "MANIFEST",
    "list_corpora",
    "corpus_path",
    "build_corpus",
    "corpus_info",
]

MANIFEST = "manifest.json"

Log = Callable[[str], None]
# builder(out_dir, log) writes <class>.txt files into out_dir and returns provenance for the manifest.
Builder = Callable[[Path, Log], dict[str, Any]]


class CorpusMissing(CorpusError):
    """A registered corpus that has not been built in this cache yet."""


@dataclass(frozen=True)
class CorpusSpec:
    """A corpus the cache knows how to build."""

    name: str
    description: str
    level: str  # "char" or "word": the token level the stream uses
    builder: Builder

    @property
    def build_command(self) -> str:
        return f"streamer data build {self.name}"


CORPORA: dict[str, CorpusSpec] = {
    "calm-multilingual": CorpusSpec(
        name="calm-multilingual",
        description="LibreOffice help text in en, fr, de, es, cs (Debian packages, MPL-2.0), "
        "lines filtered by detected language",
        level="char",
        builder=build_calm_multilingual,
    ),
    _MULTIDOMAIN: CorpusSpec(
        name=_MULTIDOMAIN,
        description=_MULTIDOMAIN_DESCRIPTION,
        level="word",
        builder=build_calm_multidomain,
    ),
    "intents-multilingual": CorpusSpec(
        name="intents-multilingual",
        description="smart-home utterances in en, fr, de, es, cs labelled by intent, expanded from "
        "PyPI home-assistant-intents with hassil (Apache-2.0)",
        level="utterance",
        builder=build_intents_multilingual,
    ),
    "multiwoz-domains": CorpusSpec(
        name="multiwoz-domains",
        description="real MultiWOZ user turns by domain, labelled by dialogue act, from the source "
        "archive of PyPI convlab 3.0.1",
        level="utterance",
        builder=build_multiwoz_domains,
    ),
}


def list_corpora(root: Path) -> list[dict[str, Any]]:
    """Every registered corpus: name, description, level, built (bool) and path (str)."""
    return [
        {
            "name": spec.name,
            "description": spec.description,
            "level": spec.level,
            "built": _is_built(Path(root) / spec.name),
            "path": str(Path(root) / spec.name),
        }
        for spec in sorted(CORPORA.values(), key=lambda spec: spec.name)
    ]


def corpus_path(name: str, root: Path) -> Path:
    """The built directory of corpus `name`; CorpusMissing if it is not built yet."""
    spec = _spec(name)
    path = Path(root) / spec.name
    if not _is_built(path):
        raise CorpusMissing(f"corpus '{name}' is not built in {root}; build it with: {spec.build_command}")
    return path


def corpus_info(name: str, root: Path) -> dict[str, Any]:
    """The manifest of a built corpus."""
    manifest = corpus_path(name, root) / MANIFEST
    try:
        return json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CorpusError(
            f"manifest {manifest} cannot be read ({error}); delete {manifest.parent} and build it "
            f"again with: {_spec(name).build_command}"
        ) from None


def build_corpus(name: str, root: Path, *, force: bool = False, log: Log = print) -> Path:
    """Build corpus `name` into `<root>/<name>/` unless it is already built; return that path."""
    return _build(_spec(name), Path(root), force=force, log=log)


def _build(spec: CorpusSpec, root: Path, *, force: bool, log: Log) -> Path:
    """Build `spec` in a staging directory under root and rename it into place."""
    target = root / spec.name
    if _is_built(target) and not force:
        log(f"corpus '{spec.name}' is already built in {target}")
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CorpusError(f"cannot create the corpus cache directory {root}: {error}") from None
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", suffix=".partial", dir=root))
    try:
        log(f"building corpus '{spec.name}' in {staging}")
        provenance = spec.builder(staging, log)
        manifest = _manifest(spec, staging, provenance, seconds=time.monotonic() - started)
        text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
        (staging / MANIFEST).write_text(text, encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp makes it private
        if _is_built(target) and not force:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
            log(f"corpus '{spec.name}' was built meanwhile by another process")
            return target
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"built corpus '{spec.name}' in {target} ({manifest['build_seconds']:.1f} s)")
    return target


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename staging to target, replacing whatever target held (rebuild or leftover)."""
    retired = None
    if target.exists() or target.is_symlink():
        retired = target.with_name(f".{target.name}.{uuid.uuid4().hex}.old")
        os.rename(target, retired)
    try:
        os.rename(staging, target)
    except OSError:
        if retired is not None:
            os.rename(retired, target)
        raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _manifest(
    spec: CorpusSpec, directory: Path, provenance: dict[str, Any], *, seconds: float
) -> dict[str, Any]:
    """Describe a freshly built directory; also checks it loads as a CALM or utterance corpus."""
    if spec.level == "utterance":
        return _fixed_fields(spec, seconds) | {
            key: value for key, value in provenance.items() if key != "classes"
        } | {"classes": describe_utterance_dir(directory)}
    texts = load_corpus_dir(directory)
    classes = {}
    for name, text in texts.items():
        data = (directory / f"{name}{CLASS_SUFFIX}").read_bytes()
        classes[name] = {
            "file": f"{name}{CLASS_SUFFIX}",
            "characters": len(text),
            "lines": text.count("\n") + (0 if text.endswith("\n") else 1),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    fixed = _fixed_fields(spec, seconds)
    extra = {key: value for key, value in provenance.items() if key not in fixed and key != "classes"}
    return {**fixed, **extra, "classes": classes}


def _fixed_fields(spec: CorpusSpec, seconds: float) -> dict[str, Any]:
    return {
        "name": spec.name,
        "description": spec.description,
        "level": spec.level,
        "build_command": spec.build_command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 1),
    }


def _spec(name: str) -> CorpusSpec:
    try:
        return CORPORA[name]
    except KeyError:
        known = ", ".join(sorted(CORPORA)) or "none"
        raise CorpusError(f"unknown corpus '{name}'; known corpora: {known}") from None


def _is_built(path: Path) -> bool:
    return (path / MANIFEST).is_file()
