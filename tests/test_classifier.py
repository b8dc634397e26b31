"""hf-classifier over labelled utterance streams: a tiny random BERT, the utterance batcher,
every classic strategy, head growth, and the whole path through the real broker."""

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from monitor.accuracy import accuracy_metrics
from monitor.live import LiveMonitor
from monitor.losslog import read_loss_log
from monitor.report import write_report
from producers.corpora.utterances import Utterance, write_utterance_dir
from producers.kafka import produce
from producers.schedule import Schedule
from producers.stream import prepare_stream
from streamer.config import LearnConfig
from streamer.checkpoint import load
from streamer.learner import run as run_learner
from streamer.models import ModelRequest, build_model
from streamer.step import run
from streamer.strategies import STRATEGIES
from streamer.utterance_batching import UtteranceBatcher, majority_truth, pad_ids
from producers.wire import Record, Truth

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INTENTS = {  # class (a "language") -> label -> utterances
    "en": {"LightOn": ["turn on the light", "switch the lamp on", "lights on please"],
           "LightOff": ["turn off the light", "switch the lamp off", "lights off now"],
           "Timer": ["set a timer for five minutes", "start a timer", "timer for ten minutes"]},
    "fr": {"LightOn": ["allume la lumière", "allume la lampe", "lumière allumée"],
           "LightOff": ["éteins la lumière", "éteins la lampe", "lumière éteinte"],
           "Weather": ["quel temps fait il", "la météo de demain", "il va pleuvoir"]},
}
CLASSIC = ("naive", "replay", "agem", "ewc", "l2")
SMALL = {"replay": dict(p_write=1.0, r_interval=4, n_replay=3, memory_size=20),
         "agem": dict(p_write=1.0, n_ref=3, memory_size=20), "ewc": dict(boundary="every:2"),
         "l2": dict(boundary="every:2")}


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    """A tiny random BERT (2 layers, hidden 32) with a WordPiece tokenizer trained here."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    texts = [t for labels in INTENTS.values() for ts in labels.values() for t in ts]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=120, special_tokens=special))
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    directory = tmp_path_factory.mktemp("tiny-bert")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    BertModel(config).save_pretrained(directory)
    return directory


def build(encoder_dir, seed=0, **options):
    torch.manual_seed(seed)
    options = {"path": str(encoder_dir), "max_length": 12, **options}
    return build_model(ModelRequest("hf-classifier", options=tuple(options.items())))


def record(text, label, class_name="en", fragment=0, stream="0"):
    return Record(stream, text, Truth(class_name, fragment, 0, 0.0, label))


def labelled_records(order=("en", "fr"), repeats=2):
    """Class by class; labels appear one after another: LightOn, LightOff, Timer, then Weather."""
    out = []
    for fragment, name in enumerate(order):
        for _ in range(repeats):
            for label, texts in INTENTS[name].items():
                out += [record(text, label, name, fragment, str(i % 2)) for i, text in enumerate(texts)]
    return out


def batches(built, records, rows=3):
    from streamer.multitask import stream_batches

    return stream_batches(records, built, rows, 20, torch.device("cpu"))


def test_options_are_checked(encoder_dir):
    with pytest.raises(ValueError, match="no option colour"):
        build(encoder_dir, colour=1)
    with pytest.raises(ValueError, match="max_length"):
        build(encoder_dir, max_length=1)
    with pytest.raises(ValueError, match="not a model folder"):
        build(encoder_dir, path=str(encoder_dir / "absent"))
    with pytest.raises(ValueError, match="head_lr_scale"):
        build(encoder_dir, head_lr_scale=0)
    built = build(encoder_dir, max_labels=7, freeze_encoder=1)
    assert built.kind == "classifier" and built.model.max_labels == 7
    assert not any(p.requires_grad for p in built.model.encoder.parameters())
    assert built.details["hidden"] == 32 and built.details["pad_id"] == 0


def test_forward_masks_padding_and_features_are_pooled(encoder_dir):
    built = build(encoder_dir)
    model = built.model.eval()
    ids, other = built.encode("turn on the light"), built.encode("start a timer")
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    length = max(len(ids), len(other)) + 1
    short = torch.tensor([pad_ids(ids, 0, length), pad_ids(other, 0, length)])
    long = torch.nn.functional.pad(short, (0, 6))  # more padding must not change anything
    with torch.no_grad():
        logits, state = model(short, None)
        pooled, _ = model.features(long)
        logits_long, _ = model(long, None)
    assert state is None and logits.shape == (2, 512) and pooled.shape == (2, 32)
    torch.testing.assert_close(logits, logits_long)
    assert torch.count_nonzero(logits) == 0  # a zero head: every label starts at logit 0
    with torch.no_grad():
        model.head.bias.fill_(0.5)
        assert torch.equal(model(short, None)[0], torch.full((2, 512), 20 * 0.5))  # logits = head_lr_scale * head
        model.head.bias.zero_()
    with torch.no_grad():
        by_hand = model.encoder(input_ids=torch.tensor([ids])).last_hidden_state.mean(1)  # no padding at all
        torch.testing.assert_close(model.features(short[:1])[0], by_hand)


def test_utterance_batcher_pads_grows_labels_votes_truth_and_commits():
    encode = lambda text: [5] + [6 + len(word) for word in text.split()] + [7]  # noqa: E731
    batcher = UtteranceBatcher(2, encode, pad_id=0, max_length=5, max_labels=3)
    stream = [("a b", "x", "en", 0), ("ccc", "y", "en", 0), ("d e f g h", "x", "fr", 1), ("i", "z", "fr", 1)]
    for offset, (text, label, name, fragment) in enumerate(stream):
        assert batcher.rejects(record(text, label, name, fragment)) is None
        batcher.add(record(text, label, name, fragment, stream=f"key{offset}"), ("t", 0), offset)
    assert batcher.ready()
    first, second = batcher.pop(), batcher.pop()
    assert not batcher.ready()
    assert first.batch.inputs.tolist() == [[5, 7, 7, 7, 0], [5, 9, 7, 0, 0]]
    assert second.batch.inputs.tolist() == [[5, 7, 7, 7, 7], [5, 7, 7, 0, 0]]  # cut to max_length
    assert first.batch.targets.tolist() == [0, 1] and second.batch.targets.tolist() == [0, 2]
    assert (first.batch.labels_known, second.batch.labels_known) == (2, 3)
    assert (first.truth.class_name, second.truth.fragment) == ("en", 1)
    assert first.commit == {("t", 0): 2} and second.commit == {("t", 0): 4}
    assert batcher.rejects(Record("0", "no truth"))[0] == "missing_label"
    assert batcher.rejects(record("w", None))[0] == "missing_label"
    assert batcher.rejects(record("w", "fourth"))[0] == "label_overflow"
    assert batcher.rejects(record("w", "y")) is None  # a known label always fits
    with pytest.raises(ValueError, match="label"):
        batcher.add(record("w", None))


def test_majority_truth_votes_one_utterance_each_ties_to_the_earlier():
    t = lambda name, fragment: Truth(name, fragment, 0, 0.0, "l")  # noqa: E731
    assert majority_truth([t("a", 0), t("b", 1), t("b", 1)]).class_name == "b"
    tie = majority_truth([t("b", 3), t("a", 2)])
    assert (tie.class_name, tie.fragment) == ("a", 2)
    assert majority_truth([None, None]) is None


@pytest.mark.parametrize("name", CLASSIC)
def test_every_classic_strategy_learns_a_classifier_and_never_touches_unseen_labels(encoder_dir, name):
    built = build(encoder_dir)
    strategy = STRATEGIES[name](built.model, lr=1e-3, **SMALL.get(name, {}))
    stream = batches(built, labelled_records())
    assert [b.labels_known for b, _ in stream] == [1, 2, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4]  # Weather comes last
    head = built.model.head
    results = []
    for index, (batch, truth) in enumerate(stream):
        before = head.weight.detach().clone(), head.bias.detach().clone()
        results.append(next(run(strategy, [(batch, truth)])))
        known = batch.labels_known
        # rows of labels not seen yet: no gradient, so Adam (and every penalty) leaves them exactly as they were
        assert torch.equal(head.weight[known:], before[0][known:]) and torch.equal(head.bias[known:], before[1][known:])
        assert torch.count_nonzero(head.weight[known:]) == 0
        assert all(0 <= p < known for p in results[-1].predicted)
        assert list(results[-1].labels) == batch.targets.tolist()
    assert all(np.isfinite(r.loss) and np.isfinite(r.train_loss) for r in results)
    assert torch.count_nonzero(head.weight[:4]) > 0
    if name in ("replay", "agem"):
        assert len(strategy.memory) > 0
    if name == "replay":
        assert strategy.replays > 0


def test_new_labels_leave_the_known_logits_and_loss_unchanged(encoder_dir):
    built = build(encoder_dir)
    strategy = STRATEGIES["naive"](built.model, lr=1e-3)
    stream = batches(built, labelled_records())
    for batch, truth in stream[:4]:
        next(run(strategy, [(batch, truth)]))
    batch = stream[3][0]
    grown = type(batch)(inputs=batch.inputs, targets=batch.targets, labels_known=batch.labels_known + 1)
    with torch.no_grad():
        logits, _ = built.model.eval()(batch.inputs, None)
    old, new = strategy.predict(batch), strategy.predict(grown)
    # the new label's row is still zero: its logit is 0 and only joins the softmax normaliser
    known = logits[:, : batch.labels_known]
    expected = torch.nn.functional.cross_entropy(torch.cat([known, torch.zeros(len(known), 1)], 1), batch.targets)
    torch.testing.assert_close(new.loss, expected)
    torch.testing.assert_close(old.loss, torch.nn.functional.cross_entropy(known, batch.targets))
    assert torch.equal(old.predicted, known.argmax(-1))


def _corpus(directory: Path) -> Path:
    classes = {}
    for name, labels in INTENTS.items():
        items = [Utterance(f"{text} {k}", label) for k in range(4) for label, texts in labels.items() for text in texts]
        classes[name] = items
    write_utterance_dir(directory, classes)
    (directory / "manifest.json").write_text(json.dumps({"level": "utterance"}))
    return directory


def test_through_the_broker_loss_log_probes_report_and_live_accuracy(broker, encoder_dir, tmp_path):
    schedule = Schedule(kind="sequence", given_order=("en", "fr"), streams=3, window=1, mean_tokens=30, seed=0)
    records, manifest = prepare_stream(_corpus(tmp_path / "corpus"), schedule, tmp_path / "m.json", probe_examples=6)
    unlabelled = [Record("0", "no label here", Truth("en", 0, 0, 0.0, None))]
    asyncio.run(produce(unlabelled + records, broker.bootstrap_servers, "utter"))
    config = LearnConfig(bootstrap_servers=broker.bootstrap_servers, topic="utter", group_id="utter-g",
                         run_dir=tmp_path / "run", run_name="utter", streams=3, window=1, seed=0, device="cpu",
                         model_name="hf-classifier", lr=1e-3,
                         model_options=(("path", str(encoder_dir)), ("max_length", 12)),
                         classes=tuple(manifest["classes"]), n_fragments=manifest["n_fragments"],
                         total_batches=manifest["total_batches"], idle_timeout_s=20, probe_every=4)
    monitor = LiveMonitor(run="utter", strategy="naive", classes=config.classes)
    summary = asyncio.run(run_learner(config, manifest=manifest, monitor=monitor))

    assert summary.stop_reason == "end_of_stream"
    assert summary.batches == len(records) // 3 == 20
    assert monitor.dead_letters == {"missing_label": 1}
    log = read_loss_log(summary.run_dir / "losses.jsonl")
    assert all(len(line["predicted"]) == len(line["labels"]) == 3 for line in log)
    assert [line["domain_name"] for line in log] == ["en"] * 10 + ["fr"] * 10
    assert max(label for line in log for label in line["labels"]) == 3  # 4 labels over both classes
    checkpoint = load(summary.run_dir / "checkpoint.pt")
    assert sorted(checkpoint["labels"][:3]) == ["LightOff", "LightOn", "Timer"] and checkpoint["labels"][3] == "Weather"
    rows = [json.loads(line) for line in (summary.run_dir / "probes.jsonl").open()]
    assert [(r["trigger"], r["ended_class"]) for r in rows if r["trigger"] in ("switch", "end")] == [
        ("switch", "en"), ("end", "fr")]
    assert all(r["unit"] == "accuracy" and set(r["scores"]) == {"en", "fr"} for r in rows)
    assert rows[0]["trigger"] == "start" and rows[0]["scores"] == {"en": 0.0, "fr": 0.0}
    saved = np.load(summary.run_dir / "probe_features" / f"batch-{rows[-1]['batch']:08d}.npz")
    assert saved["features"].shape == (12, 32) and sorted(set(saved["classes"])) == ["en", "fr"]

    report = write_report(summary.run_dir)
    stored = json.loads((summary.run_dir / "results.json").read_text())
    assert stored["accuracy"] == monitor.snapshot().accuracy == accuracy_metrics(log)  # live == offline
    assert stored["accuracy"]["utterances"] == 60 and set(stored["accuracy"]["per_class"]) == {"en", "fr"}
    dmi = report["dmi"]
    assert dmi["tasks"] == ["en", "fr"] and len(dmi["matrix"]) == 2 and dmi["samples"] == 12
    assert all(0.0 <= dmi[key] <= 1.0 for key in ("stability", "plasticity", "generalizability"))
    assert report["probe_matrix"]["unit"] == "held-out accuracy"


def test_a_label_vocabulary_holds_at_most_its_capacity_and_a_batcher_needs_two_ids_a_row():
    from streamer.utterance_batching import LabelVocabulary, UtteranceBatcher

    vocabulary = LabelVocabulary(2)
    assert [vocabulary.add(label) for label in ("a", "b", "c", "a")] == [0, 1, None, 0]
    assert vocabulary.full and vocabulary.names() == ("a", "b")
    with pytest.raises(ValueError, match="max_length >= 2"):
        UtteranceBatcher(2, lambda text: [1, 2], pad_id=0, max_length=1)
