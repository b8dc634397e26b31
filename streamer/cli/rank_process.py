"""What a process torchrun started (a rank) does before anything else.

Its lines: rank 0 speaks as the run; every line another rank writes to stdout or stderr starts with
``rank r: ``, so that N ranks saying the same thing (their CPUs, their torch threads, a signal, a
broker they cannot reach) read as N ranks, and a fault one rank meets names it. Only Python's writes
are labelled: what a C library writes to the file descriptors directly is not.

Its end: torchrun's agent (in `learn --nproc`, the launcher itself) starts the ranks in sessions of
their own and nothing else ends them, so a kill -9 of the agent left them learning, unsupervised,
holding the run directory. Each rank asks the kernel for SIGTERM when its parent dies (Linux
prctl(PR_SET_PDEATHSIG); the agent starts the ranks from its main thread, so the signal means the
agent's death): every rank then stops after the step in flight, rank 0 writes the last checkpoint,
and the same command continues. Asked first thing, a fraction of a second after the rank is started.
An agent that dies before that: under `learn --nproc` the launcher, whose process is the agent, tells
its ranks its pid (STREAMER_AGENT_PID), and a rank whose parent is already another process stops there
with one line (status 143, nothing learned yet); under a plain torchrun, whose agent says no pid, it
goes unnoticed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TextIO

from streamer.broker import signal_on_parent_death

__all__ = ["Labelled", "label_rank_lines", "stop_with_the_agent"]


class Labelled:
    """A text stream that writes to `stream` whole lines, each starting with `label`, in one write a call
    (the text after a call's last line end waits for the next call, or for flush); all else is the
    stream's. The ranks share the launcher's stderr, unbuffered under PYTHONUNBUFFERED (which the
    Dockerfile and the tests set): print's text and its newline were two writes, and two ranks' lines
    ran into one ("...--broker-timeout)rank 1: streamer learn: ...", then an empty line). Threads (a
    warning from the step's worker) and a signal handler's line write to it too: its state changes
    under a lock, before the write, so nothing is written twice or dropped."""

    def __init__(self, stream: TextIO, label: str):
        self._stream, self._label, self._line_start, self._pending = stream, label, True, ""
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        with self._lock:
            pending = self._pending + text
            end = max(pending.rfind("\n"), pending.rfind("\r")) + 1
            self._pending = pending[end:]
            if end:
                self._stream.write(self._labelled(pending[:end]))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, ""
            if pending:
                self._stream.write(self._labelled(pending))
            self._stream.flush()

    def _labelled(self, text: str) -> str:
        pieces = []
        for piece in text.splitlines(keepends=True):
            if self._line_start:
                pieces.append(self._label)
            pieces.append(piece)
            self._line_start = piece.endswith(("\n", "\r"))
        return "".join(pieces)

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def label_rank_lines(rank: int | None) -> None:
    """Under torchrun (`rank`: its RANK; None outside it), this process's stdout and stderr write whole
    lines, those of a rank other than 0 each starting with ``rank r: ``."""
    if rank is not None:
        label = f"rank {rank}: " if rank else ""
        sys.stdout = Labelled(sys.stdout, label)
        sys.stderr = Labelled(sys.stderr, label)


def stop_with_the_agent(agent: int | None) -> None:
    """SIGTERM to this process when its parent, the agent, dies (Linux; elsewhere nothing). `agent`: the
    agent's pid where the launcher said it; a parent other than it by now is the agent gone before the
    kernel was asked, and this rank stops at once (SystemExit 143, as for a SIGTERM)."""
    if signal_on_parent_death(signal.SIGTERM) and agent is not None and os.getppid() != agent:
        print(f"torchrun's agent (pid {agent}) ended before this rank began: stopping; the same command "
              "continues the run", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM)
