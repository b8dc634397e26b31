"""Under torchrun, rank 0 speaks as the run; every line another rank writes to stdout or stderr starts
with ``rank r: ``, so that N ranks saying the same thing (their CPUs, their torch threads, a signal, a
broker they cannot reach) read as N ranks, and a fault one rank meets names it. Only Python's writes
are labelled: what a C library writes to the file descriptors directly is not."""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Labelled", "label_rank_lines"]


class Labelled:
    """A text stream that writes `label` at the start of each line to `stream`; all else is the stream's."""

    def __init__(self, stream: TextIO, label: str):
        self._stream, self._label, self._line_start = stream, label, True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            if self._line_start:
                pieces.append(self._label)
            pieces.append(piece)
            self._line_start = piece.endswith(("\n", "\r"))
        self._stream.write("".join(pieces))
        return len(text)

    def __getattr__(self, name: str):  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def label_rank_lines(rank: int | None) -> None:
    """Label this process's stdout and stderr with ``rank r: `` when it is a rank other than 0 (`rank`:
    torchrun's RANK, None outside torchrun)."""
    if rank:
        sys.stdout = Labelled(sys.stdout, f"rank {rank}: ")
        sys.stderr = Labelled(sys.stderr, f"rank {rank}: ")
