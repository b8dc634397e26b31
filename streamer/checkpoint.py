"""One checkpoint module: `save(path, state)` and `load(path) -> dict`, nothing else writes or reads one.

A checkpoint is a plain dict (nanoGPT's checkpoint dict; bytewax's snapshot):

    format_version  FORMAT_VERSION
    config          the run's LearnConfig as plain values (paths as strings)
    model           the model's state_dict (the same tensors the strategy state holds)
    strategy        strategy.state_dict(): model, optimizer(s), memories, gates, detectors, hidden state
    rng             torch (CPU, and CUDA when used), numpy and random states, as tensors and plain values
    loop            streamer.loop's state after batch `step`: batcher carry-over, batches waiting to be
                    learned, records read and dead-lettered, the last truth
    offsets         {"topic:partition": next offset to read}; committed to Kafka only after the checkpoint
                    holding them is written, so Kafka's committed offsets never run ahead of it; a restart
                    reads every partition from here (streamer.consumer.SeekOnAssign), not from Kafka's
    step            batches learned
    tracker         the metric tracker's state (monitor.live.LiveMonitor.state_dict), when it has one
    labels          classifiers: the label names in head-row order

Written to a temporary file in the same directory, flushed, fsynced and renamed over the old one, so a
crash leaves either the previous checkpoint or the new one. Read with torch.load(weights_only=True):
tensors and plain values only, never a pickled object.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

__all__ = ["FORMAT_VERSION", "CheckpointError", "save", "load", "rng_state", "set_rng_state", "plain"]

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A file that is not a checkpoint this module can read."""


def save(path: str | os.PathLike, state: dict) -> Path:
    """Write `state` atomically to `path` (temporary file, fsync, rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        torch.save({"format_version": FORMAT_VERSION, **state}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:  # the rename itself survives a power cut
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def load(path: str | os.PathLike, map_location=None) -> dict:
    """The checkpoint's dict; tensors and plain values only (torch.load(weights_only=True))."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises pickle's UnpicklingError for a Python object
        if type(exc).__name__ == "UnpicklingError":
            raise CheckpointError(f"{path} holds Python objects, not only tensors and plain values; "
                                  "refusing to load it") from None
        raise
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a streamer checkpoint (no format_version)")
    if state["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {state['format_version']}; "
                              f"this streamer reads up to {FORMAT_VERSION}")
    return state


def rng_state() -> dict:
    """Every random generator a run draws from, as tensors and plain values."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "random": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))


def plain(value):
    """A config value as dicts, lists, strings and numbers (dataclasses and paths included)."""
    if hasattr(value, "__dataclass_fields__"):
        return {name: plain(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # a Path, a device
