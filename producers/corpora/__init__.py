"""Corpora: build, cache and load the text that each class of a stream is drawn from."""

from .cache import (
    CORPORA,
    CorpusMissing,
    CorpusSpec,
    build_corpus,
    corpus_info,
    corpus_path,
    list_corpora,
)
from .calm_dir import CorpusError, load_corpus_dir
from .user import UserData, UserExample, load_user_data

__all__ = [
    "CORPORA",
    "CorpusError",
    "CorpusMissing",
    "CorpusSpec",
    "build_corpus",
    "corpus_info",
    "corpus_path",
    "list_corpora",
    "load_corpus_dir",
    "load_user_data",
    "UserData",
    "UserExample",
]
