"""A run directory across restarts: the checkpoint to resume from, the logs cut back to it, the old run set
aside on purpose (--fresh) or because a new run would write over it (an old run without its checkpoint),
and one learner at a time in a directory (a lock the kernel drops when the
process dies, even by SIGKILL).

    state = resume_state(run_dir, config)   # None: no checkpoint; ValueError naming the keys that differ
    trim_logs(run_dir, CheckpointView(state).step)  # losses.jsonl (rotated files too) and probes.jsonl
"""

from __future__ import annotations

import fcntl
import inspect
import itertools
import json
import os
import shutil
import time
from pathlib import Path

from monitor.console import STATUS_FILE, read_status
from monitor.losslog import last_batch, loss_log_files, trim_loss_log
from streamer import checkpoint

__all__ = ["IDENTITY_KEYS", "KEPT_KEYS", "RunDirBusy", "RunDirLock", "resume_state", "differing_keys", "kept_settings",
           "trim_logs", "check_set_aside", "put_back", "set_aside", "old_run_without_checkpoint"]

# A checkpoint continues only the run that wrote it: the same stream, model and strategy.
IDENTITY_KEYS = ("topic", "strategy", "strategy_options", "model_name", "model", "model_options", "lr", "clip",
                 "streams", "window")
# What a producer's manifest says of the stream, where the run and the restart both have one: another
# production on the topic (its manifest written over the old one) is another stream's truth
STREAM_KEYS = ("total_batches", "total_records", "n_fragments", "classes")
# What a resumed run keeps of its checkpoint's config whatever the flags now say: the span its live CALM
# tracker counts from, the seed of the random generators that go on, the drift detector whose state goes on
KEPT_KEYS = ("from_fragment", "seed", "detector")


class RunDirBusy(RuntimeError):
    """Another running learner holds the run directory."""


class RunDirLock:
    """An exclusive flock on `<run_dir>/.lock` for the life of a learner (with-block); `holder` and
    `other` name who holds it and what to give instead, in the line a second one gets."""

    def __init__(self, run_dir: Path, holder: str = "a running learner", other: str = "another --run-dir"):
        self.path = Path(run_dir) / ".lock"
        self.holder, self.other = holder, other
        self._handle = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "?"
            handle.close()
            raise RunDirBusy(f"{self.path.parent} is in use by {self.holder} (pid {owner}); "
                             f"stop it first or give {self.other}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._handle = handle
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.close()  # closing drops the lock
            self._handle = None


def differing_keys(saved: dict, config) -> list[str]:
    """The identity keys whose values differ between a checkpoint's config and `config` (a strategy's
    options with its defaults filled in: `--set p_write=0.1`, the default, was refused as another run)."""
    current = checkpoint.plain(config)

    def differs(key: str) -> bool:
        if key == "strategy_options" and saved.get("strategy") == current.get("strategy"):
            strategy = current.get("strategy")
            seed = saved.get("seed")  # (the run's: a resumed run keeps its own, kept_settings)
            return _in_full(strategy, saved[key] or (), seed) != _in_full(strategy, current.get(key) or (), seed)
        return saved[key] != current.get(key)
    return [key for key in IDENTITY_KEYS if key in saved and differs(key)]


def kept_settings(saved: dict, config) -> dict:
    """{key: the checkpoint's value} of each of KEPT_KEYS whose value in `config` (the flags) differs from
    the checkpoint's `saved` config: the resumed run goes on with those."""
    return {key: saved[key] for key in KEPT_KEYS if saved.get(key) is not None and saved[key] != getattr(config, key)}


def _in_full(strategy: str, options, seed: int | None) -> dict:
    """A strategy's options as KEY=VALUE pairs, with its constructor's defaults for those not given; a
    `seed` not given is the run's (streamer.learner.build_strategy gives it), not the constructor's."""
    from streamer.strategies.catalog import strategy_class

    try:
        parameters = inspect.signature(strategy_class(strategy)).parameters
    except ValueError:  # (not a registered strategy: its options as given)
        parameters = {}
    defaults = {key: p.default for key, p in parameters.items() if p.default is not inspect.Parameter.empty}
    if "seed" in parameters and seed is not None:
        defaults["seed"] = seed
    return {**defaults, **{key: value for key, value in options}}


def resume_state(run_dir: Path, config) -> dict | None:
    """The checkpoint of `run_dir` when there is one and it continues `config`; None when there is none.
    ValueError (one line) when it belongs to another model, strategy or stream."""
    path = Path(run_dir) / "checkpoint.pt"
    if not path.exists():
        return None
    try:
        state = checkpoint.load(path, map_location="cpu")
    except (checkpoint.CheckpointError, OSError, RuntimeError) as exc:
        raise ValueError(f"cannot resume from {path}: {exc}; use --fresh to start over") from None
    saved, current = checkpoint.CheckpointView(state).config, checkpoint.plain(config)
    differ = differing_keys(saved, config)
    if differ:
        shown = ", ".join(f"{key} {saved[key]!r} -> {current.get(key)!r}" for key in differ)
        raise ValueError(f"{path} is a run of another configuration ({shown}); "
                         f"use --fresh to start over or another --run-dir")
    other = [key for key in STREAM_KEYS if saved.get(key) not in (None, []) and current.get(key) not in (None, [])
             and saved[key] != current[key]]  # (None, no classes: no manifest, a topic's records as they come)
    if other:
        shown = ", ".join(f"{key} {saved[key]!r} -> {current[key]!r}" for key in other)
        raise ValueError(f"{path} learned another stream than the manifest describes ({shown}); give the run's "
                         f"manifest (a copy: {Path(run_dir) / 'manifest.json'}), or --fresh to start over")
    return state


def trim_logs(run_dir: Path, step: int) -> tuple[int, int]:
    """Cut losses.jsonl back to its first `step` batches and probes.jsonl to the rows scored before
    batch `step` (a probe at `step` is scored again after the restart); returns the lines kept."""
    run_dir = Path(run_dir)
    losses = trim_loss_log(run_dir / "losses.jsonl", step) if (run_dir / "losses.jsonl").exists() else 0
    probes_path, probes = run_dir / "probes.jsonl", 0
    if probes_path.exists():
        kept = []
        for line in probes_path.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                row = json.loads(line)
            except ValueError:
                break  # a row torn by a crash ends the log
            if not line.endswith("\n") or row.get("batch", 0) >= step:
                break
            kept.append(line)
        probes_path.write_text("".join(kept), encoding="utf-8")
        probes = len(kept)
    return losses, probes


# what a learner writes at its start: config.json, and status.json (or, later, its log and checkpoint); a
# directory without both is not a run's (a model's folder, a project's, has a config.json of its own)
RUN_FILES = ("status.json", "losses.jsonl", "checkpoint.pt")


def check_set_aside(run_dir: Path, why: str = "--fresh") -> None:
    """ValueError (one line, after `why`) when --fresh (or a new run, `why`) must not move `run_dir`'s files:
    it holds files but not a run's (`--run-dir .` in a project folder would have moved all of it)."""
    run_dir = Path(run_dir).resolve()
    others = [p.name for p in run_dir.iterdir() if p.name != ".lock"] if run_dir.is_dir() else []
    if others and not ("config.json" in others and any(name in RUN_FILES for name in others)):
        shown = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
        raise ValueError(f"{why}: {run_dir} holds {len(others)} file(s) ({shown}) but not a run's (config.json "
                         f"with {', '.join(RUN_FILES[:-1])} or {RUN_FILES[-1]}); not moving them: give an empty or "
                         "new --run-dir")


def put_back(run_dir: Path, aside: Path) -> None:
    """Undo set_aside: what a fresh start wrote in `run_dir` goes (its .lock stays), the old run's files
    come back from `aside`, which is removed."""
    run_dir = Path(run_dir).resolve()
    for entry in run_dir.iterdir():
        if entry.name == ".lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in Path(aside).iterdir():
        entry.rename(run_dir / entry.name)
    Path(aside).rmdir()


def _new_sibling(run_dir: Path, name: str) -> Path:
    """A new, empty directory beside `run_dir` called `name`, or `name-2`, `name-3`, ... when that is taken (two
    set-asides within one second: the second failed on the first's name, in a traceback)."""
    for number in itertools.count(1):
        aside = run_dir.with_name(name if number == 1 else f"{name}-{number}")
        try:
            aside.mkdir(parents=True)
            return aside
        except FileExistsError:
            continue


def set_aside(run_dir: Path) -> Path | None:
    """--fresh: move an existing run directory's files to a sibling `<name>.replaced-<time>`; returns it."""
    run_dir = Path(run_dir).resolve()  # (`--run-dir .` has no name of its own)
    if not run_dir.is_dir() or not any(p.name != ".lock" for p in run_dir.iterdir()):
        return None
    check_set_aside(run_dir)
    aside = _new_sibling(run_dir, f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    for entry in run_dir.iterdir():
        if entry.name != ".lock":
            entry.rename(aside / entry.name)
    return aside


# what a new run writes over (LossLogWriter starts its log afresh, the report replaces its files): an old run's
HISTORY_FILES = ("losses.jsonl", "probes.jsonl", "results.json", "loss_curve.png")


def old_run_without_checkpoint(run_dir: Path, config) -> tuple[str | None, bool]:
    """What a new run in `run_dir`, which holds no checkpoint.pt, would write over: (its words, "a loss log of
    40 batches", or None when it holds nothing of a run's history; whether those files are this run's own,
    whose learner stopped before its first checkpoint (kill -9, out of memory, an error): its status.json says
    no checkpoint was written, and its config.json is `config`'s. Its restart (systemd's) learns those batches
    again, seeded, from the topic's beginning: the same lines. Anything else (a run that checkpointed, whose
    checkpoint was removed or lost; another configuration's; no status.json) is an old run to set aside."""
    run_dir = Path(run_dir)
    logs = [path for path in loss_log_files(run_dir / "losses.jsonl") if path.exists() and path.stat().st_size]
    others = [name for name in HISTORY_FILES[1:] if (run_dir / name).exists() and (run_dir / name).stat().st_size]
    if not logs and not others:
        return None, False
    last = last_batch(logs[-1]) if logs else None
    batches = None if last is None else last + 1
    words = (f"a loss log of {batches} batch{'es' if batches != 1 else ''}" if batches is not None
             else "a loss log" if logs else ", ".join(others))
    status = read_status(run_dir / STATUS_FILE)
    if status is None or status.checkpoint_age_s is not None:  # (a checkpoint was written, then removed or lost)
        return words, False
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return words, False
    return words, isinstance(saved, dict) and not differing_keys(saved, config)
