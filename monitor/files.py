"""Small files that other programs read while a learner runs (status.json, config.json, results.json):
written beside the old one and renamed over it, so a reader never sees half a file."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["replace_text"]


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a hidden file beside it (one per process), renamed over `path`."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        staging.write_text(text, encoding="utf-8")
    except BaseException:  # a full disk: no empty hidden file left behind
        staging.unlink(missing_ok=True)
        raise
    staging.replace(path)
