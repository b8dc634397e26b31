import random
from pathlib import Path

import pytest

from streamer.broker import EmbeddedBroker

WORDS = {
    "en": "the quick brown fox jumps over the lazy dog while the farmer sleeps in the barn".split(),
    "fr": "le renard brun saute par dessus le chien paresseux pendant que le fermier dort".split(),
    "cs": "příliš žluťoučký kůň úpěl ďábelské ódy zatímco sedlák spí ve stodole".split(),
}


def write_corpus(directory: Path, lines: int = 400, seed: int = 1) -> Path:
    """A small corpus directory (one .txt per class) with multi-byte characters."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name, words in WORDS.items():
        text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(lines))
        (directory / f"{name}.txt").write_text(text, encoding="utf-8")
    return directory


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; on a busy 2-core machine several threads
    contend and can be 50-100x slower. Restores the previous setting."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def broker():
    with EmbeddedBroker() as running:
        yield running


def pytest_terminal_summary(terminalreporter):
    from tests.figures import FIGURES  # the module the tests import, not a copy of this one

    if FIGURES:
        terminalreporter.section("measured (figures, not checks)")
        for line in FIGURES:
            terminalreporter.write_line(line)
