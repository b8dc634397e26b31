"""Running the registry clients (apt-get, dpkg-deb, pip, npm) for corpus builds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .calm_dir import CorpusError

__all__ = ["run_command"]

STDERR_TAIL_CHARS = 400


def run_command(command: list[str], *, timeout: float, cwd: Path | None = None, shown: str | None = None) -> str:
    """Run a command and return its stdout; any failure becomes a one-line CorpusError
    with the command and the tail of its stderr."""
    shown = shown or " ".join(command)
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, encoding="utf-8", errors="replace",
            timeout=timeout, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        raise CorpusError(f"`{command[0]}` was not found; it is needed to run `{shown}`") from None
    except subprocess.TimeoutExpired:
        raise CorpusError(f"`{shown}` did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines())[-STDERR_TAIL_CHARS:] or "no error output"
        raise CorpusError(f"`{shown}` failed with exit status {done.returncode}: {tail}")
    return done.stdout
