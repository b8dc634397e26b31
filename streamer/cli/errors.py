"""The one error the command line raises for a problem the user can fix, and how it tells an error
that a signal caused."""

from __future__ import annotations

import errno
import re

__all__ = ["UserError", "caused_by", "out_of_memory", "storage_error"]

# what a disk or its permissions refuse, or a path given through a file (`--out run/config.json/sub`): the
# user's to fix (space, a writable place, another path), never the code's
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                            errno.EIO, errno.ENOTDIR})


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def caused_by(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` in `exc`'s chain (itself, then its __cause__ or __context__, and so on): a
    signal can surface as another error raised while it was handled (a Ctrl-C landing while a C
    extension initialises gives "ImportError: initialization failed"; a SIGTERM landing in torchrun's
    metrics wrapper an UnboundLocalError from the wrapper's own `finally`). None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def storage_error(exc: BaseException) -> str | None:
    """One line for a file the disk refused (full, read-only, no permission, failing): the file and the
    system's words; None for any other error (a bug keeps its traceback)."""
    if not isinstance(exc, OSError) or exc.errno not in STORAGE_ERRNOS:
        return None
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc} (errno {errno.errorcode.get(exc.errno, exc.errno)})"


def out_of_memory(exc: BaseException) -> str | None:
    """One line for an allocation the machine refused (torch's CPU allocator, a GPU's memory, Python's own),
    naming what was asked; None for any other error. A replay memory of `--set memory_size=2000000000` was
    70 lines of traceback, mid-run, per rank."""
    if isinstance(exc, MemoryError):
        return "out of memory (Python could not allocate); a smaller model, memory or --streams needs less"
    text = str(exc)
    if type(exc).__name__ != "OutOfMemoryError" and "can't allocate memory" not in text:
        return None
    cpu = re.search(r"tried to allocate (\d+) bytes", text)  # torch's CPU allocator; a GPU's says "2.00 GiB"
    gpu = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]iB)", text)
    what = (f"torch asked for {int(cpu.group(1)) / 1e9:,.1f} GB at once" if cpu else
            f"torch asked for {gpu.group(1)} on the GPU" if gpu else text.splitlines()[0][:160])
    return (f"out of memory: {what}; a smaller --set memory_size (replay, agem, mbpa, kd-*), --hidden, --streams "
            "or model needs less (with --fresh: a run goes on with its own settings)")
