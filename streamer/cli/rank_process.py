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
from typing import TextIO

from streamer.broker import signal_on_parent_death

__all__ = ["Labelled", "label_rank_lines", "stop_with_the_agent"]


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


def stop_with_the_agent(agent: int | None) -> None:
    """SIGTERM to this process when its parent, the agent, dies (Linux; elsewhere nothing). `agent`: the
    agent's pid where the launcher said it; a parent other than it by now is the agent gone before the
    kernel was asked, and this rank stops at once (SystemExit 143, as for a SIGTERM)."""
    if signal_on_parent_death(signal.SIGTERM) and agent is not None and os.getppid() != agent:
        print(f"torchrun's agent (pid {agent}) ended before this rank began: stopping; the same command "
              "continues the run", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM)
