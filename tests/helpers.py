"""Shared builders for tests: an in-memory stream through the real batcher."""

import dataclasses
import time
from pathlib import Path

import torch

from producers.schedule import CalmSchedule, build_stream
from streamer.batching import Batcher
from streamer.models import LSTMConfig, LSTMLanguageModel
from streamer.strategies import Naive

TINY = LSTMConfig(embedding=8, hidden=24, layers=2, dropout=0.0)


def batches_from_records(records, streams, window):
    batcher = Batcher(streams, window)
    out = []
    for record in records:
        batcher.add(record)
        while batcher.ready():
            ready = batcher.pop()
            out.append((ready.batch, ready.truth))
    return out


def small_stream(corpus, *, fragments=6, mean_tokens=600, streams=3, window=10, seed=0):
    schedule = CalmSchedule(n_fragments=fragments, mean_tokens=mean_tokens, streams=streams,
                            window=window, record_tokens=window, seed=seed)
    return build_stream(corpus, schedule)


def naive(seed=0, config=TINY, lr=2e-3, **kw):
    torch.manual_seed(seed)
    return Naive(LSTMLanguageModel(config), lr=lr, **kw)


def permute_classes(records, mapping):
    """Swap the class header of every record by `mapping` (evaluation data only)."""
    return [dataclasses.replace(r, truth=dataclasses.replace(r.truth, class_name=mapping[r.truth.class_name]))
            for r in records]


def stat_fields(path) -> list[str] | None:
    """The fields of a /proc stat file after the command's name (state first, then the parent's pid, ...);
    None once the process or thread is gone."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def until_stopped(pid: int, within_s: float = 5.0) -> None:
    """Until every thread of `pid` is stopped (state T in /proc) after a SIGSTOP: the stop is asynchronous,
    and on a loaded machine a thread may run on for a while (a frozen broker answered a commit after its
    SIGSTOP in 5 of 10 tries beside 3 busy loops on 2 CPUs). Without /proc, waits `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = [fields[0] for stat in Path(f"/proc/{pid}/task").glob("*/stat") if (fields := stat_fields(stat))]
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.005)
