"""The per-batch loss log: one JSON object per line, readable by the CALM library's tools.

A line holds at least the CALM keys ``loss`` (nats), ``domain`` (class id),
``domain_name`` and ``sequence`` (fragment index); the project may add more keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

__all__ = ["CALM_KEYS", "LossLogWriter", "loss_log_line", "read_loss_log"]

CALM_KEYS = ("loss", "domain", "domain_name", "sequence")


def loss_log_line(result, *, domain: int, class_name: str, fragment: int, detected: bool) -> dict:
    """The loss-log line of one step result (monitor.results.StepResult): CALM keys plus extras."""
    line = {
        "loss": result.loss, "domain": domain, "domain_name": class_name, "sequence": fragment,
        "batch": result.index, "tokens": result.tokens, "train_loss": result.train_loss,
        "predict_s": round(result.predict_s, 6), "learn_s": round(result.learn_s, 6),
        "time": round(result.finished_at, 3), "detected_switch": detected,
    }
    for key in ("gates", "predicted", "labels"):  # mixtures and classifiers only
        value = getattr(result, key, None)
        if value is not None:
            line[key] = [round(v, 6) for v in value] if key == "gates" else list(value)
    return line


def _to_builtin(value: Any) -> Any:
    """json ``default``: turn numpy scalars (anything with ``.item()``) into Python numbers."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class LossLogWriter:
    """Writes one JSON line per batch and flushes it at once, so a crash loses no written line.

    ``append=False`` truncates an existing file, ``append=True`` continues it
    (a resumed run). Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike, append: bool = False) -> None:
        self.path = Path(path)
        self.append = append
        self._file: IO[str] | None = None

    def __repr__(self) -> str:
        return f"LossLogWriter({str(self.path)!r}, append={self.append})"

    def __enter__(self) -> LossLogWriter:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if self.append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append ``record`` as one line; it must hold the four CALM keys."""
        missing = [key for key in CALM_KEYS if key not in record]
        if missing:
            raise ValueError(f"loss record lacks {', '.join(missing)}: {record!r}")
        if self._file is None:
            raise ValueError("LossLogWriter is not open (use it in a with block)")
        self._file.write(json.dumps(record, default=_to_builtin) + "\n")
        self._file.flush()  # the OS has the line even if this process dies next

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_record(record: Any) -> str | None:
    """Why ``record`` is not a valid loss record, or None."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [key for key in CALM_KEYS if key not in record]
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    loss = record["loss"]
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        return f"loss is not a number: {loss!r}"
    if not _is_int(record["domain"]):
        return f"domain is not an int: {record['domain']!r}"
    if not _is_int(record["sequence"]):
        return f"sequence is not an int: {record['sequence']!r}"
    if not isinstance(record["domain_name"], str):
        return f"domain_name is not a string: {record['domain_name']!r}"
    return None


def read_loss_log(path: str | os.PathLike) -> list[dict]:
    """All records of a loss log, in order; blank lines are skipped.

    Raises ``ValueError("path:line: reason")`` on the first bad line.
    """
    records = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not JSON ({error.msg})") from None
            reason = _check_record(record)
            if reason is not None:
                raise ValueError(f"{path}:{line_number}: {reason}")
            records.append(record)
    return records
