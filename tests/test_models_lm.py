"""The language models by name beside lstm-char: lstm-word (a word vocabulary) and hf-causal (any HF causal LM).

hf-causal runs on a tiny random Llama with a byte-level BPE tokenizer trained on SENTENCES
(conftest's `tiny_llama_dir`); nothing is downloaded. The shipped SmolLM2 is in test_pretrained_slow.py.
"""

import dataclasses
import json
import math
import random

import pytest
import torch

from producers.corpora.multidomain import build_vocabulary
from producers.schedule import Schedule, build_stream
from streamer.batching import Batcher
from streamer.models import LSTMLanguageModel, ModelRequest, build_model
from streamer.models.registry import byte_encode
from streamer.models.word import UNKNOWN, Vocabulary, WholeWordBatcher, vocabulary_rule
from streamer.probe import ProbeSet, load_probe_set
from streamer.step import prequential_step
from streamer.strategies import Naive
from producers.wire import Record
from tests.conftest import SENTENCES, write_corpus
from tests.helpers import TINY

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def feed(batcher, records):
    out = []
    for record in records:
        batcher.add(record)
        while batcher.ready():
            out.append(batcher.pop())
    return out


# --- lstm-word: the vocabulary --------------------------------------------------------------------


def test_vocabulary_maps_unknown_words_to_unk_and_splits_on_whitespace():
    vocabulary = Vocabulary(("cat", "the"))
    assert vocabulary.words == ("cat", "the", UNKNOWN) and vocabulary.unknown_id == 2
    assert vocabulary.encode("the  cat\nsat\tthe") == [1, 0, 2, 1]
    assert vocabulary.encode("   ") == []
    with pytest.raises(ValueError, match="twice"):
        Vocabulary(("a", "a"))


def test_vocabulary_rule_is_the_producers_rule():
    texts = {"pets": "the cat the dog cat bird <unk>", "sea": "the fish fish ant\nshark Ant"}
    for per_class in (1, 2, 3, 10):
        assert vocabulary_rule(texts.values(), per_class) == build_vocabulary(texts, per_class)


def test_lstm_word_takes_the_vocabulary_the_corpus_declares(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "vocab").mkdir(parents=True)
    (corpus / "a.txt").write_text("x y z\n" * 5)
    (corpus / "vocab" / "vocab.txt").write_text("alpha\nbeta\n<unk>\n")
    (corpus / "manifest.json").write_text(json.dumps({"level": "word", "vocabulary": {"file": "vocab/vocab.txt"}}))
    built = build_model(ModelRequest("lstm-word", lstm=TINY, manifest={"corpus": str(corpus), "classes": ["a"]}))
    assert built.name == "lstm-word" and built.kind == "lm"
    assert built.model.config.vocab == 3 and built.model.decode.out_features == 3
    assert built.encode("beta alpha gamma") == [1, 0, 2]
    assert built.details["vocab_size"] == 3 and built.details["vocab_source"].endswith("vocab.txt")


def test_lstm_word_applies_calms_rule_to_the_class_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", lines=50)
    manifest = {"corpus": str(corpus), "classes": ["cs", "en", "fr"]}
    built = build_model(ModelRequest("lstm-word", lstm=TINY, options=(("per_class", 3),), manifest=manifest))
    texts = [(corpus / f"{name}.txt").read_text() for name in manifest["classes"]]
    expected = vocabulary_rule(texts, 3)
    assert len(expected) == 10  # 3 per class, disjoint languages, then <unk>
    assert built.model.config.vocab == len(expected)
    top_english = expected.index("the")
    assert built.encode("the zebra") == [top_english, len(expected) - 1]


def test_lstm_word_reads_a_vocabulary_file_and_appends_unk(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("one\ntwo\n\nthree\n")
    built = build_model(ModelRequest("lstm-word", lstm=TINY, options=(("vocab", str(path)),)))
    assert built.model.config.vocab == 4
    assert built.encode("three one four") == [2, 0, 3]


def test_a_byte_order_mark_is_not_part_of_the_first_word(tmp_path):
    """A vocabulary file saved with a BOM (Windows editors) mapped "one" to <unk>: its first word was
    "\\ufeffone". So did CALM's rule over class files that start with one (the producer drops the BOM)."""
    path = tmp_path / "words.txt"
    path.write_bytes("\ufeffone\ntwo\n".encode("utf-8"))
    built = build_model(ModelRequest("lstm-word", lstm=TINY, options=(("vocab", str(path)),)))
    assert built.encode("one two") == [0, 1]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes("\ufeffalpha beta\n".encode("utf-8"))
    built = build_model(ModelRequest("lstm-word", lstm=TINY, manifest={"corpus": str(corpus), "classes": ["a"]}))
    assert built.encode("alpha beta") == [0, 1] and built.model.config.vocab == 3


def test_lstm_word_names_a_vocabulary_file_that_is_not_utf8(tmp_path):
    """A Latin-2 vocabulary file was "'utf-8' codec can't decode byte 0xc5 ...", naming no file: now one line
    naming the file, its line and the byte."""
    path = tmp_path / "words.txt"
    path.write_bytes("one\ntwo\nkůň\n".encode("iso-8859-2"))
    with pytest.raises(ValueError) as info:
        build_model(ModelRequest("lstm-word", lstm=TINY, options=(("vocab", str(path)),)))
    assert str(info.value) == (f"lstm-word: the vocabulary file {path}:3 is not valid UTF-8: byte 0xf9 at byte offset "
                               "9 (invalid start byte)")


@pytest.mark.parametrize("request_kw, message", [
    ({}, r"lstm-word needs a vocabulary: pass --manifest .* or --model-opt vocab=PATH"),
    ({"manifest": {"classes": ["a"]}}, "names no corpus"),
    ({"options": (("vocab", "/nonexistent/words.txt"),)}, "cannot read the vocabulary file"),
    ({"options": (("size", 3),)}, "no option size"),
])
def test_lstm_word_says_in_one_line_what_is_missing(request_kw, message):
    with pytest.raises(ValueError, match=message) as info:
        build_model(ModelRequest("lstm-word", lstm=TINY, **request_kw))
    assert "\n" not in str(info.value)


def test_lstm_word_cannot_build_a_vocabulary_from_a_file_corpus(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b", "label": "x"}\n')
    with pytest.raises(ValueError, match="no <class>.txt file per class.*vocab=PATH"):
        build_model(ModelRequest("lstm-word", lstm=TINY, manifest={"corpus": str(data), "classes": ["x"]}))


# --- words kept whole across records -------------------------------------------------------------


def test_whole_word_batcher_gives_the_tokens_of_the_uncut_text(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", lines=60)
    texts = {p.stem: p.read_text() for p in corpus.glob("*.txt")}
    schedule = Schedule(n_fragments=4, mean_tokens=600, streams=2, window=8, record_tokens=20, seed=3)
    records, _ = build_stream(texts, schedule)
    vocabulary = Vocabulary(tuple(vocabulary_rule(texts.values(), 50)))
    assert any(r.text[-1:].isalpha() for r in records)  # records do cut words
    ready = feed(WholeWordBatcher(2, 8, encode=vocabulary.encode), records)
    expected = [vocabulary.encode("".join(r.text for r in records if r.stream == str(row))) for row in range(2)]
    assert len(ready) == min((len(tokens) - 1) // 8 for tokens in expected)  # every word reaches the batcher
    for row in range(2):
        got = [t for r in ready for t in r.batch.inputs[row].tolist()]
        assert got == expected[row][: len(got)]
    whole = [t for r in ready for t in r.batch.inputs.reshape(-1).tolist()]
    cut = feed(Batcher(2, 8, encode=vocabulary.encode), records)  # the plain batcher splits words into unknowns
    split = [t for r in cut for t in r.batch.inputs.reshape(-1).tolist()]
    # unknowns left: only where the producer joins two fragments mid-word
    assert whole.count(vocabulary.unknown_id) * 10 < split.count(vocabulary.unknown_id)
    assert all(r.truth is not None for r in ready)


def test_whole_word_batcher_flushes_text_without_spaces():
    vocabulary = Vocabulary(("abc",))
    batcher = WholeWordBatcher(1, 2, encode=lambda text: list(text.encode("utf-8")))
    batcher.max_pending = 5
    batcher.add(Record("0", "abcdefgh"))  # no whitespace and longer than max_pending: no waiting
    assert batcher.ready() and batcher.pop().batch.inputs.tolist() == [[97, 98]]
    held = WholeWordBatcher(1, 1, encode=vocabulary.encode)
    held.add(Record("0", "abc ab"))
    held.add(Record("0", "c abc"))  # "ab" + "c" is one word
    assert held.ready() and held.pop().batch.inputs.tolist() == [[0]]
    assert held._buffers[0].data == [0]  # the second "abc" waits for the next window; the third is held back


def test_a_word_held_back_is_in_the_checkpoint_and_a_restart_gives_the_uninterrupted_batches(tmp_path):
    """The unfinished word of each stream's last record was lost on a restart: every later window of
    that stream was shifted, and the resumed lstm-word run's losses were not the uninterrupted run's."""
    from streamer import checkpoint

    corpus = write_corpus(tmp_path / "corpus", lines=60)
    texts = {p.stem: p.read_text() for p in corpus.glob("*.txt")}
    records, _ = build_stream(texts, Schedule(n_fragments=4, mean_tokens=600, streams=2, window=8,
                                              record_tokens=20, seed=3))
    vocabulary = Vocabulary(tuple(vocabulary_rule(texts.values(), 50)))
    whole = feed(WholeWordBatcher(2, 8, encode=vocabulary.encode), records)
    half = len(records) // 2
    before = WholeWordBatcher(2, 8, encode=vocabulary.encode)
    first = feed(before, records[:half])
    assert before._pending  # a word is held back at the restart
    checkpoint.save(tmp_path / "checkpoint.pt", {"batcher": before.state_dict()})
    after = WholeWordBatcher(2, 8, encode=vocabulary.encode)
    after.load_state_dict(checkpoint.load(tmp_path / "checkpoint.pt")["batcher"])
    resumed = first + feed(after, records[half:])
    assert [r.batch.inputs.tolist() for r in resumed] == [r.batch.inputs.tolist() for r in whole]
    assert len(whole) > len(first) + 3


def test_lstm_word_learns_through_its_batcher(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", lines=60)
    texts = {p.stem: p.read_text() for p in corpus.glob("*.txt")}
    records, _ = build_stream(texts, Schedule(n_fragments=3, mean_tokens=400, streams=2, window=6, seed=1))
    built = build_model(ModelRequest("lstm-word", lstm=TINY, manifest={"corpus": str(corpus), "classes": sorted(texts)}))
    ready = feed(built.make_batcher(2, 6, torch.device("cpu")), records)
    assert isinstance(built.make_batcher(2, 6, torch.device("cpu")), WholeWordBatcher)
    strategy = Naive(built.model, lr=2e-3)
    results = [prequential_step(strategy, r.batch, r.truth, i) for i, r in enumerate(ready[:10])]
    assert all(math.isfinite(r.loss) for r in results)
    assert results[0].loss == pytest.approx(math.log(built.model.config.vocab), abs=0.5)  # untrained: near uniform


# --- hf-causal ------------------------------------------------------------------------------------


def test_hf_causal_wraps_a_local_model_behind_the_lstm_interface(tiny_llama_dir):
    built = build_model(ModelRequest("hf-causal", options=(("path", str(tiny_llama_dir)),)))
    model = built.model
    assert built.name == "hf-causal" and built.kind == "lm"
    assert model.config.layers == 2 and model.config.hidden == 32 and model.config.model_type == "llama"
    assert built.details["dtype"] == "float32" and built.details["source"] == f"path:{tiny_llama_dir}"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert built.encode(SENTENCES[0]) == tokenizer(SENTENCES[0], add_special_tokens=False).input_ids
    inputs = torch.tensor([built.encode(SENTENCES[0])[:6], built.encode(SENTENCES[1])[:6]])
    assert model.initial_state(2, "cpu") is None
    logits, state = model(inputs, None)
    assert logits.shape == (2, 6, model.config.vocab) and logits.dtype == torch.float32 and state is None
    hidden, state = model.features(inputs, None)
    assert hidden.shape == (2, 6, 32) and state is None
    assert len(model.decoder_layers()) == 2


def test_hf_causal_tokenizer_drives_the_batcher_and_a_step_gives_a_finite_loss(tiny_llama_dir):
    built = build_model(ModelRequest("hf-causal", options=(("path", str(tiny_llama_dir)),)))
    text = " ".join(SENTENCES) + " "
    records = [Record(str(s), text[i:i + 7]) for i in range(0, len(text), 7) for s in (0, 1)]
    ready = feed(built.make_batcher(2, 8, torch.device("cpu")), records)
    assert ready
    expected = built.encode(text)
    assert ready[0].batch.inputs[0].tolist() == expected[:8]  # words cut by records are tokenized whole
    assert ready[0].batch.targets[1].tolist() == expected[1:9]
    torch.manual_seed(0)
    strategy = Naive(built.model, lr=1e-3)
    results = [prequential_step(strategy, r.batch, r.truth, i) for i, r in enumerate(ready)]
    assert all(math.isfinite(r.loss) and math.isfinite(r.train_loss) for r in results)
    assert results[0].loss == pytest.approx(math.log(built.model.config.vocab), abs=0.5)


def test_hf_causal_dtype_option(tiny_llama_dir):
    built = build_model(ModelRequest("hf-causal", options=(("path", str(tiny_llama_dir)), ("dtype", "bfloat16"))))
    assert next(built.model.parameters()).dtype == torch.bfloat16
    logits, _ = built.model(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("options, message", [
    ((("path", "/nonexistent"), ("gguf", "/x.gguf")), "one of --model-opt path=, gguf=, name="),
    ((("path", "/nonexistent"),), "not a model directory"),
    ((("gguf", "/nonexistent/model.gguf"),), "no GGUF file"),
    ((("dtype", "int8"),), "dtype 'int8' is not one of"),
    ((("layers", 2),), "no option layers"),
])
def test_hf_causal_option_errors_are_one_line(options, message):
    with pytest.raises(ValueError, match=message) as info:
        build_model(ModelRequest("hf-causal", options=options))
    assert "\n" not in str(info.value)


def test_hf_causal_hub_name_is_refused_without_a_request(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty Hugging Face cache
    with pytest.raises(ValueError, match=r"name=someone/no-such-model is neither built weights .* never fetched"):
        build_model(ModelRequest("hf-causal", options=(("name", "someone/no-such-model"),)))


def test_hf_causal_default_weights_not_built_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="streamer weights build smollm2-135m"):
        build_model(ModelRequest("hf-causal"))


# --- probes in the model's tokens -----------------------------------------------------------------


def test_probe_set_with_the_byte_encoding_is_todays_probe_set():
    torch.manual_seed(0)
    model = LSTMLanguageModel(TINY)
    texts = {"en": SENTENCES[0] * 30, "cs": SENTENCES[2] * 30}
    default = ProbeSet(texts, rows=2, window=5, max_bytes=300)
    explicit = ProbeSet(texts, rows=2, window=5, max_bytes=300, encode=byte_encode)
    assert default._grids.keys() == explicit._grids.keys()
    assert all(torch.equal(default._grids[k], explicit._grids[k]) for k in default._grids)
    assert default.score(model)[0] == explicit.score(model)[0]


def test_probe_set_encodes_with_the_models_tokenizer(tmp_path, tiny_llama_dir):
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    words = "hello world how are you today".split()
    rng = random.Random(0)
    (probe_dir / "en.txt").write_text(" ".join(rng.choice(words) for _ in range(200)))
    manifest = {"probe": {"dir": str(probe_dir), "classes": {"en": {"file": "en.txt"}}}}
    vocabulary = Vocabulary(tuple(words))
    probe = load_probe_set(manifest, rows=2, window=5, max_bytes=100, encode=vocabulary.encode)
    grid = probe._grids["en"]
    assert grid.shape == (2, 46) and int(grid.max()) < len(vocabulary)  # 100 tokens: 2 rows of 9 windows + 1
    model = LSTMLanguageModel(dataclasses.replace(TINY, vocab=len(vocabulary)))
    scores, _ = probe.score(model)
    assert math.isfinite(scores["en"])
    built = build_model(ModelRequest("hf-causal", options=(("path", str(tiny_llama_dir)),)))
    probe = load_probe_set(manifest, rows=2, window=5, encode=built.encode)
    scores, _ = probe.score(built.model)  # a stateless model: every window on its own
    assert math.isfinite(scores["en"]) and built.model.training


# --- through Kafka: the learner takes the vocabulary from the producer's manifest ---------------------


def test_learner_trains_lstm_word_with_the_manifests_vocabulary_and_word_probes(broker, tmp_path):
    import asyncio

    from monitor.live import LiveMonitor
    from producers.stream import prepare_stream, produce_stream
    from streamer.config import LearnConfig
    from streamer.learner import build_strategy, run

    corpus = write_corpus(tmp_path / "corpus", lines=80)
    schedule = Schedule(n_fragments=4, mean_tokens=600, streams=2, window=6, seed=4, probe_tokens=800)
    records, manifest = prepare_stream(corpus, schedule, tmp_path / "topic.manifest.json")
    asyncio.run(produce_stream(records, broker.bootstrap_servers, "words"))
    config = LearnConfig(bootstrap_servers=broker.bootstrap_servers, topic="words", group_id="words",
                         run_dir=tmp_path / "run", streams=2, window=6, model=TINY, model_name="lstm-word",
                         device="cpu", max_batches=20, idle_timeout_s=20, probe_every=10)
    prepared = build_strategy(config, torch.device("cpu"), manifest)
    built = prepared[1]
    monitor = LiveMonitor(run="w", strategy="naive", classes=tuple(manifest["classes"]))
    summary = asyncio.run(run(config, manifest=manifest, prepared=prepared, monitor=monitor))
    assert summary.batches == 20 and summary.tokens == 20 * 2 * 6
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    rule = vocabulary_rule([(corpus / f"{name}.txt").read_text() for name in manifest["classes"]])
    assert written["model_details"]["vocab_size"] == built.model.config.vocab == len(rule)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "losses.jsonl").open()]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    probes = [json.loads(line) for line in (tmp_path / "run" / "probes.jsonl").open()]
    assert probes and all(set(p["scores"]) == set(manifest["classes"]) for p in probes)
    assert all(math.isfinite(v) for p in probes for v in p["scores"].values())


def test_a_word_level_run_ends_with_the_streams_records_not_its_byte_window_count(broker, tmp_path):
    import asyncio

    from monitor.live import LiveMonitor
    from producers.stream import prepare_stream, produce_stream
    from streamer.config import LearnConfig
    from streamer.learner import run

    corpus = write_corpus(tmp_path / "corpus", lines=80)
    schedule = Schedule(n_fragments=3, mean_tokens=300, streams=2, window=6, seed=5, probe_tokens=400)
    records, manifest = prepare_stream(corpus, schedule, tmp_path / "topic.manifest.json")
    asyncio.run(produce_stream(records, broker.bootstrap_servers, "words-end"))
    config = LearnConfig(bootstrap_servers=broker.bootstrap_servers, topic="words-end", group_id="words-end",
                         run_dir=tmp_path / "run", streams=2, window=6, model=TINY, model_name="lstm-word",
                         device="cpu", total_batches=manifest["total_batches"],
                         total_records=manifest["total_records"], probe=False)
    monitor = LiveMonitor(run="w", strategy="naive", classes=tuple(manifest["classes"]))
    summary = asyncio.run(asyncio.wait_for(run(config, manifest=manifest, monitor=monitor), timeout=120))
    assert summary.stop_reason == "end_of_stream"  # no idle timeout was needed
    assert 0 < summary.batches < manifest["total_batches"]  # fewer word windows than byte windows


def test_hf_causal_directory_without_a_tokenizer_is_a_one_line_error(tmp_path, tiny_llama_dir):
    import shutil

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=f"hf-causal: cannot load {tmp_path}: ") as info:
        build_model(ModelRequest("hf-causal", options=(("path", str(tmp_path)),)))
    assert "\n" not in str(info.value)
