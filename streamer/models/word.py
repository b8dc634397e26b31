"""lstm-word: the 2-layer LSTM language model over a word vocabulary (CALM's word-level streams).

Words are whitespace tokens (`str.split()`, case and punctuation kept), as the
producer counts them for lambda; a word outside the vocabulary maps to `<unk>`.
The vocabulary must be fixed before the first batch. The builder takes it from,
in order:

1. `--model-opt vocab=PATH`: a file with one word per line (`<unk>` is appended
   when the file lacks it);
2. the corpus named in the producer's manifest (`manifest["corpus"]`): the
   vocabulary file its own manifest declares (calm-multidomain ships
   `vocab/vocab.txt`), else CALM's rule applied to its `<class>.txt` files: the
   `per_class` most frequent words of each class, merged, sorted, `<unk>` last.

Records arrive as ~20-byte slices of running text, cut mid-word. `WholeWordBatcher`
holds back each stream's unfinished last word until the next record (or the next
whitespace) completes it, so a word split across two records is still one token.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from streamer.batching import Batcher
from streamer.models.lstm import LSTMLanguageModel
from streamer.models.registry import BuiltModel, ModelRequest
from producers.wire import Record

__all__ = ["UNKNOWN", "Vocabulary", "vocabulary_rule", "load_vocabulary", "corpus_vocabulary",
           "WholeWordBatcher", "WholeWordModel", "build_lstm_word"]

UNKNOWN = "<unk>"
PER_CLASS = 10_000  # CALM's MultiDomain vocabulary: the 10k most frequent words of each domain
_OPTIONS = ("vocab", "per_class")


@dataclass(frozen=True)
class Vocabulary:
    """Words in id order; `<unk>` is always present. `encode(text)` -> word ids."""

    words: tuple[str, ...]
    source: str = ""  # where it came from, for config.json

    def __post_init__(self):
        if UNKNOWN not in self.words:
            object.__setattr__(self, "words", (*self.words, UNKNOWN))
        if len(set(self.words)) != len(self.words):
            raise ValueError(f"vocabulary from {self.source or 'words'} lists a word twice")
        object.__setattr__(self, "_ids", {word: i for i, word in enumerate(self.words)})

    def __len__(self) -> int:
        return len(self.words)

    @property
    def unknown_id(self) -> int:
        return self._ids[UNKNOWN]

    def encode(self, text: str) -> list[int]:
        ids, unknown = self._ids, self._ids[UNKNOWN]
        return [ids.get(word, unknown) for word in text.split()]

    def sha256(self) -> str:
        return hashlib.sha256("\n".join(self.words).encode("utf-8")).hexdigest()


def vocabulary_rule(texts, per_class: int = PER_CLASS) -> list[str]:
    """CALM's rule: the `per_class` most frequent words of each text (ties alphabetical),
    merged, deduplicated and sorted, `<unk>` last (as producers.corpora.multidomain builds it)."""
    words: set[str] = set()
    for text in texts:
        ranked = sorted(Counter(text.split()).items(), key=lambda item: (-item[1], item[0]))
        words.update(word for word, _ in ranked[:per_class])
    words.discard(UNKNOWN)
    return sorted(words) + [UNKNOWN]


def load_vocabulary(path: Path) -> Vocabulary:
    """One word per line; blank lines are skipped. A file that is not UTF-8 is one line naming it, its line and
    the byte (before, the codec's message named neither the file nor where)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"lstm-word: cannot read the vocabulary file {path}: {exc.strerror or exc}") from None
    try:
        lines = data.decode("utf-8").removeprefix("\ufeff").splitlines()  # a BOM is not part of the first word
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"lstm-word: the vocabulary file {path}:{line} is not valid UTF-8: "
                         f"byte 0x{data[exc.start]:02x} at byte offset {exc.start} ({exc.reason})") from None
    words = tuple(line.strip() for line in lines if line.strip())
    if not words:
        raise ValueError(f"lstm-word: the vocabulary file {path} is empty")
    return Vocabulary(words, source=str(path))


def corpus_vocabulary(manifest: dict, per_class: int = PER_CLASS) -> Vocabulary:
    """The vocabulary of the corpus the producer streamed (its manifest's `corpus`)."""
    corpus = manifest.get("corpus")
    if not corpus:
        raise ValueError("lstm-word needs a vocabulary: the manifest names no corpus; "
                         "pass --model-opt vocab=PATH")
    directory = Path(corpus)
    declared = _declared_vocabulary(directory)
    if declared is not None:
        return load_vocabulary(declared)
    classes = manifest.get("classes") or sorted(p.stem for p in directory.glob("*.txt"))
    files = [directory / f"{name}.txt" for name in classes]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"lstm-word cannot build a vocabulary from {corpus} (no <class>.txt file per class); "
                         "pass --model-opt vocab=PATH")
    stamps = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return Vocabulary(_rule_over_files(stamps, per_class),
                      source=f"{corpus} (the {per_class} most frequent words of each class)")


@functools.lru_cache(maxsize=4)
def _rule_over_files(stamps: tuple[tuple[str, int, int], ...], per_class: int) -> tuple[str, ...]:
    """vocabulary_rule over the files, once per (path, size, mtime) set: --params builds the model many times."""
    texts = [Path(path).read_text(encoding="utf-8-sig", errors="replace") for path, _, _ in stamps]  # (as streamed)
    return tuple(vocabulary_rule(texts, per_class))


def _declared_vocabulary(directory: Path) -> Path | None:
    """The vocabulary file a built corpus's manifest.json declares, when there is one."""
    try:
        entry = json.loads((directory / "manifest.json").read_text(encoding="utf-8")).get("vocabulary") or {}
    except (OSError, ValueError, AttributeError):
        return None
    path = directory / entry["file"] if isinstance(entry, dict) and entry.get("file") else None
    return path if path is not None and path.is_file() else None


class WholeWordBatcher(Batcher):
    """A Batcher that never tokenizes a word cut across two records.

    Each stream holds back the text from its last whitespace character on (an
    unfinished word with the space before it, as byte-level BPE tokenizers attach a
    leading space to the word) and prepends it to the stream's next record. A stream
    with no whitespace for `max_pending` characters (e.g. Chinese) is flushed as is.
    Held-back text counts towards the next record's span, and is part of the checkpoint's
    carry-over (a restart between the two records lost it, at most one word per stream, and
    every later window of that stream was shifted: the resumed losses were not the
    uninterrupted run's)."""

    max_pending = 256  # characters

    def __init__(self, streams: int, window: int, device="cpu", encode=None):
        super().__init__(streams, window, device, encode=encode)
        self._pending: dict[str, str] = {}  # stream -> unfinished tail of its last record

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pending_words": dict(self._pending)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._pending = dict(state.get("pending_words", {}))  # (none in a checkpoint written before)

    def add(self, record: Record, tp=None, offset: int | None = None) -> None:
        text = self._pending.pop(record.stream, "") + record.text
        cut = _last_whitespace(text)
        if len(text) - cut > self.max_pending:
            cut = len(text)
        if cut < len(text):
            self._pending[record.stream] = text[cut:]
        super().add(dataclasses.replace(record, text=text[:cut]), tp, offset)


def _last_whitespace(text: str) -> int:
    """Index of the last whitespace character (0 when there is none)."""
    for i in range(len(text) - 1, -1, -1):
        if text[i].isspace():
            return i
    return 0


@dataclass(frozen=True)
class WholeWordModel(BuiltModel):
    """A BuiltModel whose batcher keeps words whole across records."""

    def make_batcher(self, streams: int, window: int, device):
        return WholeWordBatcher(streams, window, device, encode=self.encode)


def build_lstm_word(request: ModelRequest) -> BuiltModel:
    options = dict(request.options)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"model lstm-word has no option {', '.join(unknown)} (options: {', '.join(_OPTIONS)})")
    per_class = options.get("per_class", PER_CLASS)
    if not isinstance(per_class, int) or per_class < 1:
        raise ValueError(f"lstm-word: per_class must be a positive integer, got {per_class!r}")
    if "vocab" in options:
        vocabulary = load_vocabulary(Path(str(options["vocab"])).expanduser())
    elif request.manifest:
        vocabulary = corpus_vocabulary(request.manifest, per_class)
    else:
        raise ValueError("lstm-word needs a vocabulary: pass --manifest (the producer's manifest names the corpus) "
                         "or --model-opt vocab=PATH (one word per line)")
    config = dataclasses.replace(request.lstm, vocab=len(vocabulary))
    model = LSTMLanguageModel(config).to(request.device)
    details = {"tokens": "words (whitespace tokens, unknown -> <unk>)", "vocab_size": len(vocabulary),
               "vocab_source": vocabulary.source, "vocab_sha256": vocabulary.sha256()}
    return WholeWordModel(model=model, encode=vocabulary.encode, name="lstm-word", details=details)
