"""The C allocator's policy of a learning process: set once, at its start, beside the thread policy.

A step allocates and frees the same tensors every batch (activations, gradients: megabytes). By
default glibc's malloc serves large blocks with fresh mmaps (above a threshold that it raises as it
goes) and hands the free top of a heap back to the kernel (trim). In the arena of a thread of its
own, where the learner's step runs (streamer.loop's worker thread), that made every step fault its
memory in anew: for lstm-char 2x256 about 1,650 page faults a batch and 18% more CPU in the step
than the same step in the main thread (the Kafka path at 7,122 tokens/s on one core against 8,986
fed from memory; 8,774 with this policy; `benchmarks/throughput.py --cpus 1`).

`keep_freed_memory()` fixes both thresholds: blocks under 32 MB (glibc's largest mmap threshold)
come from the heap, and freed memory stays with the process unless more than 1 GB of it lies free at
a heap's top. The process's resident memory then stays at its high-water mark instead of rising
and falling every step; it does not grow beyond it.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit (half its per-thread heap size)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc malloc's mmap and trim thresholds (above); True when both were set. Elsewhere (another
    OS, a C library without mallopt) nothing changes and it returns False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
