"""The per-batch loss log: one JSON object per line, readable by the CALM library's tools.

A line holds at least the CALM keys ``loss`` (nats), ``domain`` (class id),
``domain_name`` and ``sequence`` (fragment index); the project may add more keys.

Rotation: a daemon's log would grow without end, so the writer starts a new file when the
live one would pass ``max_bytes`` (default 100 MB). The full file becomes
``losses.<n>.jsonl``, numbered in the order written (``losses.1.jsonl`` is the oldest), and
``losses.jsonl`` is always the newest. Rotated files are kept up to ``max_total_bytes``
together (default 2 GB); past that the oldest are deleted, each said in one warning line.
Readers (``iter_loss_log``, ``read_loss_log``) go through the rotated files in order, then the
live one, one line at a time; ``iter_loss_log`` holds one line at a time (the report streams it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["CALM_KEYS", "MAX_BYTES", "MAX_TOTAL_BYTES", "LossLogWriter", "loss_log_line", "loss_log_files",
           "iter_loss_log", "last_batch", "read_loss_log", "torn_tail", "trim_loss_log"]

CALM_KEYS = ("loss", "domain", "domain_name", "sequence")
MAX_BYTES = 100_000_000  # per file: losses.jsonl is rotated before it grows past this
MAX_TOTAL_BYTES = 2_000_000_000  # all rotated files together: the oldest are dropped past this

log = logging.getLogger(__name__)


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


def rotated_name(path: Path, number: int) -> Path:
    """losses.jsonl, 3 -> losses.3.jsonl."""
    return path.with_name(f"{path.stem}.{number}{path.suffix}")


def rotated_files(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """(number, file) of the rotated files of the log at `path`, oldest first."""
    path = Path(path)
    pattern = re.compile(rf"{re.escape(path.stem)}\.(\d+){re.escape(path.suffix)}")
    if not path.parent.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in path.parent.iterdir() if (m := pattern.fullmatch(child.name))]
    return sorted(found)


def loss_log_files(path: str | os.PathLike) -> list[Path]:
    """Every file of the log at `path` in the order written: the rotated ones, then the live one."""
    path = Path(path)
    files = [file for _, file in rotated_files(path)]
    return files + [path] if path.exists() or not files else files


class LossLogWriter:
    """Writes one JSON line per batch and flushes it at once, so a crash loses no written line.

    ``append=False`` starts a new log (the file and its rotated files are removed),
    ``append=True`` continues it (a resumed run). Rotates at ``max_bytes`` and keeps
    rotated files up to ``max_total_bytes`` (see the module docstring). Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike, append: bool = False, *, max_bytes: int = MAX_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
        self.path = Path(path)
        self.append = append
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self._file: IO[str] | None = None
        self._size = 0

    def __repr__(self) -> str:
        return (f"LossLogWriter({str(self.path)!r}, append={self.append}, max_bytes={self.max_bytes}, "
                f"max_total_bytes={self.max_total_bytes})")

    def __enter__(self) -> LossLogWriter:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.append:
                for _, file in rotated_files(self.path):
                    file.unlink()
            self._file = open(self.path, "a" if self.append else "w", encoding="utf-8")
            self._size = self._file.tell()

    def write(self, record: dict) -> None:
        """Append ``record`` as one line; it must hold the four CALM keys."""
        missing = [key for key in CALM_KEYS if key not in record]
        if missing:
            raise ValueError(f"loss record lacks {', '.join(missing)}: {record!r}")
        if self._file is None:
            raise ValueError("LossLogWriter is not open (use it in a with block)")
        line = json.dumps(record, default=_to_builtin) + "\n"
        size = len(line.encode("utf-8"))
        if self._size and self._size + size > self.max_bytes:
            self._rotate()
        try:
            self._file.write(line)
            self._file.flush()  # the OS has the line even if this process dies next
        except OSError as exc:  # a full disk: the file is named, and closing does not try the line again
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self._size += size

    def sync(self) -> None:
        """The lines written so far on disk (fsync), not only in the OS's cache."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def _rotate(self) -> None:
        """The live file becomes the newest rotated one; the oldest go while past the total cap."""
        self._file.close()
        rotated = rotated_files(self.path)
        number = rotated[-1][0] + 1 if rotated else 1
        os.replace(self.path, rotated_name(self.path, number))
        rotated.append((number, rotated_name(self.path, number)))
        total = sum(file.stat().st_size for _, file in rotated)
        while len(rotated) > 1 and total > self.max_total_bytes:
            _, oldest = rotated.pop(0)
            size = oldest.stat().st_size
            oldest.unlink()
            total -= size
            log.warning("loss log: dropped the oldest rotated file %s (%.1f MB) to keep rotated logs under "
                        "%.1f MB", oldest.name, size / 1e6, self.max_total_bytes / 1e6)
        self._file = open(self.path, "w", encoding="utf-8")
        self._size = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            self.sync()  # (a run's last checkpoint comes after)
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


def iter_loss_log(path: str | os.PathLike) -> Iterator[dict]:
    """The records of a loss log and its rotated files, in order, one at a time; blank lines skipped,
    and a last line torn by a crash mid-write (no newline, not JSON: `torn_tail`), as a resume drops it.

    Raises ``ValueError("file:line: reason")`` on the first bad line."""
    files = loss_log_files(path)
    for file_path in files:
        with open(file_path, encoding="utf-8") as file:
            for line_number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    if file_path == files[-1] and not line.endswith("\n"):  # the last line, torn
                        return
                    raise ValueError(f"{file_path}:{line_number}: not JSON ({error.msg})") from None
                reason = _check_record(record)
                if reason is not None:
                    raise ValueError(f"{file_path}:{line_number}: {reason}")
                yield record


def torn_tail(path: str | os.PathLike) -> bool:
    """Whether the log's last line was cut short by a crash while it was written (no newline at the end
    of the live file, and not JSON): iter_loss_log leaves it out."""
    files = loss_log_files(path)
    if not files or not files[-1].is_file():
        return False
    with open(files[-1], "rb") as file:
        file.seek(0, os.SEEK_END)
        size = file.tell()
        if not size:
            return False
        file.seek(max(0, size - 65536))
        tail = file.read()
    if tail.endswith(b"\n"):
        return False
    try:
        json.loads(tail.rsplit(b"\n", 1)[-1])
    except ValueError:
        return True
    return False


def read_loss_log(path: str | os.PathLike) -> list[dict]:
    """All records of a loss log (its rotated files included), in order (see iter_loss_log)."""
    return list(iter_loss_log(path))


def _keeps(line: bytes, position: int, keep_batches: int) -> bool:
    """Whether a line stays when the log is cut back to `keep_batches` batches: by its "batch"
    index when it has one (true after the oldest files were dropped), else by its position."""
    try:
        record = json.loads(line)
    except ValueError:
        return False  # a line torn by a crash ends the log
    batch = record.get("batch") if isinstance(record, dict) else None
    index = batch if isinstance(batch, int) and not isinstance(batch, bool) else position
    return index < keep_batches


def _batch_of(line: bytes) -> int | None:
    """The "batch" index of a loss-log line, None when it is not JSON or has none."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    batch = record.get("batch") if isinstance(record, dict) else None
    return batch if isinstance(batch, int) and not isinstance(batch, bool) else None


def last_batch(path: str | os.PathLike, tail_bytes: int = 65536) -> int | None:
    """The batch index of the last line of the log file at `path` that says one, read from its end (a daemon's
    log grows to gigabytes): a line torn by a crash, or the tail's cut first line, is passed over; None where no
    line of the last `tail_bytes` says."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - tail_bytes))
            lines = handle.read().splitlines()
    except OSError:
        return None
    return next((batch for line in reversed(lines) if (batch := _batch_of(line)) is not None), None)


def _lines_before(path: Path, keep_batches: int) -> int | None:
    """The number of lines of the file at `path` when all of them lie before batch `keep_batches`: its first and
    last lines have batch indices, the last below `keep_batches` and ending with a newline (the writer's lines
    are in batch order); None otherwise (the file must be read line by line). A resume cut a daemon's log of
    up to MAX_TOTAL_BYTES by parsing every line of every file: 15 s for 280 MB, on the event loop, at each start."""
    with open(path, "rb") as file:
        first = file.readline()
        file.seek(0, os.SEEK_END)
        size = file.tell()
        file.seek(max(0, size - 65536))
        last = file.read().rsplit(b"\n", 2)
    if len(last) < 2 or last[-1] or (below := _batch_of(last[-2])) is None or below >= keep_batches:
        return None
    if _batch_of(first) is None:  # (a log by position: CALM's format without batch indices)
        return None
    with open(path, "rb") as file:
        return sum(1 for line in file if line.strip())


def trim_loss_log(path: str | os.PathLike, keep_batches: int) -> int:
    """Cut the log (across its rotated files) back to its first `keep_batches` batches; returns
    the lines kept. The file holding the cut becomes the live one; later files are removed.
    A torn last line (a crash mid-write) is dropped too."""
    path = Path(path)
    files = loss_log_files(path)
    kept = 0
    for index, file_path in enumerate(files):
        if not file_path.exists():
            continue
        whole = _lines_before(file_path, keep_batches)
        if whole is not None:  # every line stays: counted, not parsed
            kept += whole
            continue
        cut = None
        with open(file_path, "rb") as file:
            offset = 0
            for line in file:
                if line.strip():
                    if not line.endswith(b"\n") or not _keeps(line, kept, keep_batches):
                        cut = offset
                        break
                    kept += 1
                offset += len(line)
        if cut is None:
            continue
        with open(file_path, "r+b") as file:
            file.truncate(cut)
        for later in files[index + 1:]:
            later.unlink(missing_ok=True)
        if file_path != path:
            os.replace(file_path, path)
        return kept
    return kept
