"""Shared fixtures: the embedded broker, small corpora and streams, small models, and what
`./dev setup` provisions (Prometheus, built corpora, pretrained weights).

No fixture installs or downloads anything. A prerequisite of the default suite that is missing
fails its tests with one line naming `./dev setup`; the slow tests' weights skip naming
`./dev setup --slow`.
"""

import logging
import os
import random
import shutil
from pathlib import Path

import pytest

from streamer.broker import EmbeddedBroker
from streamer.settings import cache_root

WORDS = {
    "en": "the quick brown fox jumps over the lazy dog while the farmer sleeps in the barn".split(),
    "fr": "le renard brun saute par dessus le chien paresseux pendant que le fermier dort".split(),
    "cs": "příliš žluťoučký kůň úpěl ďábelské ódy zatímco sedlák spí ve stodole".split(),
}

# Three classes of running text, in memory: the stream of `tiny_stream`.
TINY_TEXTS = {"en": "hello world, how are you " * 300, "fr": "bonjour le monde, ça va " * 300,
              "cs": "ahoj světe, jak se máš " * 300}

# The sentences the tiny Llama's tokenizer is trained on.
SENTENCES = ["hello world, how are you today", "bonjour le monde, ça va bien", "ahoj světe, jak se dnes máš"]

SETUP = "./dev setup"
SLOW_SETUP = "./dev setup --slow"
MISSING = "is missing: run"  # the phrase the terminal summary collects


def write_corpus(directory: Path, lines: int = 400, seed: int = 1) -> Path:
    """A small corpus directory (one .txt per class) with multi-byte characters."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name, words in WORDS.items():
        text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(lines))
        (directory / f"{name}.txt").write_text(text, encoding="utf-8")
    return directory


def missing(what: str, command: str = SETUP) -> None:
    """Fail the current test with one line: `what` is missing and `command` provides it."""
    pytest.fail(f"{what} {MISSING} `{command}` (tests do not install or download)", pytrace=False)


@pytest.fixture(autouse=True)
def process_state_restored():
    """`streamer.cli.main()` run in a test's process sets what a command sets for its whole process: model
    hubs offline, OpenMP's spin policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT), the aiokafka logger's level. A
    learner a later test of the same worker starts would take those variables for the user's: undone."""
    environment, level = dict(os.environ), logging.getLogger("aiokafka").level
    yield
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    logging.getLogger("aiokafka").setLevel(level)


# --- the broker, small data and small models ---------------------------------------------------


@pytest.fixture(scope="session")
def broker():
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="module")
def tiny_stream():
    """(records, batches) of a seeded 6-fragment stream over TINY_TEXTS (3 streams, window 10)."""
    from tests.helpers import batches_from_records, small_stream

    records, _ = small_stream(TINY_TEXTS, fragments=6, mean_tokens=600, streams=3, window=10)
    return records, batches_from_records(records, 3, 10)


@pytest.fixture
def tiny_model():
    """A fresh byte-level LSTM of the TINY config (tests/helpers.py), seeded with 0."""
    import torch

    from streamer.models import LSTMLanguageModel
    from tests.helpers import TINY

    torch.manual_seed(0)
    return LSTMLanguageModel(TINY)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 32) and a 320-token byte-level BPE tokenizer, saved with
    save_pretrained, for `--model hf-causal --model-opt path=...`. Built here; nothing is downloaded."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    fast.save_pretrained(path)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; on a busy 2-core machine several threads
    contend and can be 50-100x slower. Restores the previous setting."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- what ./dev setup provisions -----------------------------------------------------------------


@pytest.fixture(scope="session")
def prometheus_binaries() -> tuple[str, str]:
    """Paths of Debian's `prometheus` and `promtool` (installed by ./dev setup)."""
    from tests.prometheus_util import require_prometheus

    return require_prometheus()


@pytest.fixture(scope="session")
def docker_compose() -> str:
    """Path of Debian's `docker-compose` (installed by ./dev setup; validates compose files without Docker)."""
    path = shutil.which("docker-compose")
    if path is None:
        missing("docker-compose (Debian's docker-compose package)")
    return path


@pytest.fixture(scope="session")
def built_corpus():
    """built_corpus(name) -> the directory of corpus `name` built by ./dev setup in the streamer cache.

    calm-multidomain needs npm to build; without npm its tests skip instead of failing."""
    from producers.corpora import CorpusMissing, corpus_path

    def get(name: str) -> Path:
        root = cache_root()
        try:
            return corpus_path(name, root)
        except CorpusMissing:
            pass  # said below, outside the except block: one line, no chained traceback
        if name == "calm-multidomain" and shutil.which("npm") is None:
            pytest.skip("calm-multidomain is not built and there is no npm to build it (`./dev setup` builds it where npm is)")
        missing(f"corpus {name!r} in {root}")
    return get


@pytest.fixture(scope="session")
def pretrained_weights():
    """pretrained_weights(name) -> the built weights directory, or skip naming `./dev setup --slow`."""
    from streamer.models.weights import WeightsMissing, weights_path

    def get(name: str) -> Path:
        try:
            return weights_path(name)
        except WeightsMissing:
            pass
        pytest.skip(f"weights {name!r} are not built: run `{SLOW_SETUP}` (or `streamer weights build {name}`)")
    return get


def pytest_terminal_summary(terminalreporter):
    from tests.figures import FIGURES  # the module the tests import, not a copy of this one

    if FIGURES:
        terminalreporter.section("measured (figures, not checks)")
        for line in FIGURES:
            terminalreporter.write_line(line)
    # One line per missing prerequisite, however many tests it failed.
    reports = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    lines = sorted({str(report.longrepr).strip() for report in reports if MISSING in str(report.longrepr)})
    if lines:
        terminalreporter.section("missing prerequisites")
        for line in lines:
            terminalreporter.write_line(line)
