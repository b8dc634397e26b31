"""One checkpoint module: `save(path, state)` and `load(path) -> dict`, nothing else writes or reads one;
the layout of the dict, which no other module names.

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
                    reads every partition from here (streamer.kafka.assignment.SeekOnAssign), not from Kafka's
    step            batches learned
    order           the MULTI reference (streamer.multitask, no loop, tracker or offsets of a topic): the
                    shuffled order it learned the stream's batches in
    tracker         the metric tracker's state (monitor.live.LiveMonitor.state_dict), when it has one
    labels          classifiers: the label names in head-row order
    world_size      distributed runs (streamer.distributed): the number of ranks that wrote it
    ranks           distributed runs: per rank, in rank order, {"loop", "strategy", "rng"} (its rows'
                    carry-over and offsets, its strategy state: the hidden state of its rows and whatever
                    a strategy keeps per rank, its generators); the top level holds rank 0's, and
                    "offsets" every rank's. Only rank 0 writes it, gathered from every rank at the same step.

A run copies its state at a snapshot point (`copied`: every tensor cloned, on the event loop) and
writes the copy from a background thread while the next steps run (streamer.checkpointer.Checkpointer).

The layout is built (run_checkpoint, reference_checkpoint) and read (CheckpointView, RankPart) here.

Written to a temporary file in the same directory, flushed, fsynced and renamed over the old one, so a
crash leaves either the previous checkpoint or the new one. Read with torch.load(weights_only=True):
tensors and plain values only, never a pickled object.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import random
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

__all__ = ["FORMAT_VERSION", "CheckpointError", "save", "load", "copied", "rng_state", "set_rng_state",
           "plain", "to_bytes", "from_bytes", "save_gathered", "on_device", "run_checkpoint", "reference_checkpoint",
           "RankPart", "CheckpointView"]

# 2: a partition's offsets in the batcher's carry-over are a dict (streamer.offsets.OffsetTracker); a
# streamer of format 1 read them as a list without an error, and read on from nonsense: it refuses them now
FORMAT_VERSION = 2  # (a checkpoint of format 1 loads)


class CheckpointError(ValueError):
    """A file that is not a checkpoint this module can read."""


def save(path: str | os.PathLike, state: dict) -> Path:
    """Write `state` atomically to `path` (temporary file, fsync, rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        _written(partial, {"format_version": FORMAT_VERSION, **state}, name=path)
    except BaseException:  # a full disk: the previous checkpoint stays, and no half of this one
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:  # the rename itself survives a power cut
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


class _Writes:
    """The file torch.save writes through, keeping the first error of a write: torch's archive writer
    reports a write the disk refused (full, a quota, a size limit) only as "unexpected pos"."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.handle.flush()


def _written(partial: Path, state: dict, name: Path) -> None:
    """`state` saved to `partial`, flushed and fsynced; a write the disk refused is the OSError beneath,
    naming `name` (the checkpoint the user knows), not torch's RuntimeError."""
    writes = _Writes(open(partial, "wb"))
    try:
        torch.save(state, writes)
        writes.handle.flush()
        os.fsync(writes.handle.fileno())
        writes.handle.close()
    except (RuntimeError, OSError) as exc:
        error = writes.error or (exc if isinstance(exc, OSError) else None)
        with contextlib.suppress(OSError):  # (its buffer's flush fails again)
            writes.handle.close()
        if error is None:
            raise
        raise OSError(error.errno, error.strerror, str(name)) from None


def copied(state, _memo: dict | None = None):
    """`state` with every tensor cloned (on its own device) and every dict, list and tuple rebuilt, so
    that later steps cannot change what is written; plain immutable values are shared. Two views of
    the same memory (the model's weights in "model" and in "strategy") stay one tensor, written once."""
    memo = {} if _memo is None else _memo
    if isinstance(state, torch.Tensor):
        key = (state.untyped_storage().data_ptr(), state.storage_offset(), tuple(state.shape), state.stride(),
               state.dtype, state.device)
        if key not in memo:
            memo[key] = state.detach().clone()
        return memo[key]
    if isinstance(state, dict):
        return {key: copied(value, memo) for key, value in state.items()}
    if isinstance(state, list):
        return [copied(value, memo) for value in state]
    if isinstance(state, tuple):
        return tuple(copied(value, memo) for value in state)
    if isinstance(state, (str, int, float, bool, bytes)) or state is None:
        return state
    return copy.deepcopy(state)  # anything else (a numpy array): an independent copy


def load(path: str | os.PathLike, map_location=None) -> dict:
    """The checkpoint's dict; tensors and plain values only (torch.load(weights_only=True))."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        if not zipfile.is_zipfile(path):  # (torch.save's archive, as every checkpoint is)
            raise CheckpointError(f"{path} is not a streamer checkpoint ({os.path.getsize(path):,} bytes, not a "
                                  "torch.save archive: cut short, or another file)")
        _verified(path)
    try:  # pickle writes b"" (an empty carry-over buffer) as a call of `bytes`: harmless, so allowed
        with torch.serialization.safe_globals([bytes]):
            state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:  # not there, a directory, unreadable: the caller's to say
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises pickle's UnpicklingError for a Python object
        if type(exc).__name__ == "UnpicklingError":  # (in an archive: a pickled object weights_only refuses)
            raise CheckpointError(f"{path} holds Python objects, not only tensors and plain values; "
                                  "refusing to load it") from None
        said = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        raise CheckpointError(f"{path} cannot be loaded ({type(exc).__name__}"
                              + (f": {said})" if said else ")")) from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a streamer checkpoint (no format_version)")
    if state["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {state['format_version']}; "
                              f"this streamer reads up to {FORMAT_VERSION}")
    return state


def _verified(path: str | os.PathLike) -> None:
    """Every part of the archive checked against the CRC-32 the writer stored with it: torch.load checks
    none, so a flipped byte in the weights loaded as NaN, and every later update was skipped (one read of
    the file, at a resume: 10 ms for 11 MB)."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        damaged = f"? ({type(exc).__name__})"
    if damaged is not None:
        raise CheckpointError(f"{path} is damaged: its part {damaged} fails its CRC-32 check (a disk or copy "
                              "error); put back a good copy")


def on_device(state, device: torch.device):
    """`state` (nested dicts, lists and tuples, as a strategy's state_dict) with its tensors on `device`,
    but for uint8 ones, the generators' states, which torch sets only from the CPU, and for modules'
    state dicts (OrderedDict, as nn.Module.state_dict gives them), which load_state_dict copies into
    the parameters where they are (moved first, a GPU would hold the weights twice). A checkpoint
    loads on the CPU (readable on any machine); a strategy's carried states, memories and penalties
    live where its model does, so a run on a GPU moves them back there before loading them."""
    if isinstance(state, torch.Tensor):
        return state if state.dtype == torch.uint8 else state.to(device)
    if isinstance(state, OrderedDict):
        return state
    if isinstance(state, dict):
        return type(state)((key, on_device(value, device)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(on_device(value, device) for value in state)
    return state


def to_bytes(state) -> bytes:
    """`state` (tensors and plain values) serialised as a checkpoint file holds it: what ranks send each other."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    """to_bytes's value back (torch.load(weights_only=True): tensors and plain values only)."""
    with torch.serialization.safe_globals([bytes]):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def save_gathered(path: str | os.PathLike, state: dict, ranks, gathered=None) -> bool:
    """Every rank calls it at the same step with its own `state` (run_checkpoint's, copied): rank 0
    gathers each rank's loop, strategy and RNG state and writes the checkpoint; True on every rank once
    it is on disk (the offsets may then be committed), False when rank 0 failed (it then raises). Rank 0
    hands the parts (RankPart views, in rank order) to `gathered`, when given, before it writes them.
    Blocking collectives: call it in the loop's worker thread."""
    own = _part_to_gather(state)
    parts = ranks.gather_bytes(b"" if ranks.leader else to_bytes(own))
    failure = None
    if ranks.leader:
        every = [own] + [from_bytes(part) for part in parts[1:]]
        if gathered is not None:
            gathered([RankPart(part) for part in every])
        whole = _gathered_checkpoint(state, every, ranks.world)
        try:
            save(path, whole)
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised here
            failure = exc
    written = ranks.all_true(failure is None)
    if failure is not None:
        raise failure
    return written


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


# The layout of the module docstring's table: built and read here only, so that no other module names a key
# of it (a checkpoint written before and one written after a change of this code have the same keys, in the
# same order).

def run_checkpoint(config, *, model: dict, strategy: dict, rng: dict, loop: dict, step: int, tracker,
                   labels=None) -> dict:
    """A learning run's checkpoint (its tensors the run's own: `copied` before the run goes on): `config`
    its LearnConfig, `loop` streamer.loop's state_dict (the next offset per partition is the checkpoint's
    "offsets"), `tracker` the monitor's state, `labels` classifiers' label names in head-row order."""
    state = {"config": plain(config), "model": model, "strategy": strategy, "rng": rng, "loop": loop,
             "offsets": _offsets_by_name(loop["offsets"]), "step": step, "tracker": tracker}
    if labels is not None:
        state["labels"] = list(labels)
    return state


def reference_checkpoint(config, *, model: dict, strategy: dict, rng: dict, step: int, order: list[int]) -> dict:
    """The MULTI reference's checkpoint (streamer.multitask): learned offline from the stream's batches in
    the shuffled `order`, so no loop, tracker or offsets of a topic read (its "offsets" are {})."""
    return {"config": plain(config), "model": model, "strategy": strategy, "rng": rng, "step": step, "order": order,
            "offsets": {}}


def _part_to_gather(state: dict) -> dict:
    """What a rank sends rank 0 of its run_checkpoint `state`: its loop, strategy and RNG states."""
    return {"loop": state["loop"], "strategy": state["strategy"], "rng": state["rng"]}


def _gathered_checkpoint(state: dict, parts: list[dict], world: int) -> dict:
    """Rank 0's run_checkpoint `state` with every rank's `parts` (_part_to_gather's, in rank order): the
    offsets of every rank's partitions, the number of ranks, and the parts themselves."""
    offsets = {}
    for part in parts:
        offsets.update(_offsets_by_name(RankPart(part).loop_offsets))
    return {**state, "offsets": offsets, "world_size": world, "ranks": parts}


def _offsets_by_name(offsets: dict) -> dict:
    """{(topic, partition): offset} as a checkpoint's "offsets" hold it: {"topic:partition": offset}."""
    return {f"{topic}:{partition}": offset for (topic, partition), offset in offsets.items()}


@dataclasses.dataclass(frozen=True)
class RankPart:
    """What one rank resumes from, of a checkpoint (load's dict, or run_checkpoint's): its strategy, loop
    and RNG states. A one-process run's is the checkpoint's top level; a distributed run's top level holds
    rank 0's, and "ranks" every rank's. Each is read when asked (a part without it fails there)."""

    state: dict

    @property
    def strategy(self) -> dict:
        return self.state["strategy"]

    @property
    def loop(self) -> dict:
        return self.state["loop"]

    @property
    def loop_offsets(self) -> dict:
        """{(topic, partition): next offset} of the partitions this part's loop read."""
        return self.state["loop"]["offsets"]

    @property
    def rng(self) -> dict:
        return self.state["rng"]


@dataclasses.dataclass(frozen=True)
class CheckpointView:
    """A checkpoint's dict (load's, or run_checkpoint's) read by the names of its parts; each read when
    asked, so a checkpoint without one fails (or, for the optional ones, defaults) where it is read."""

    state: dict

    @property
    def config(self) -> dict:
        """The run's LearnConfig as plain values ({} when it has none)."""
        return self.state.get("config") or {}

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def offsets(self) -> dict:
        """{"topic:partition": next offset to read}."""
        return self.state["offsets"]

    @property
    def tracker(self):
        """The metric tracker's state, or None."""
        return self.state.get("tracker")

    @property
    def world_size(self) -> int:
        """The number of ranks that wrote it: 1 for a one-process run."""
        return self.state.get("world_size", 1)

    def part(self, rank: int | None = None) -> RankPart:
        """Rank `rank`'s part of a distributed run's checkpoint; None: a one-process run's (the top level)."""
        return RankPart(self.state if rank is None else self.state["ranks"][rank])
