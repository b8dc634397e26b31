"""What a comparison is and which of its strategies can run: the frozen CompareConfig that `streamer compare`
builds, the strategies' names, each run's LearnConfig and the plan (sized to a parameter budget, those that
cannot run on the model skipped or refused). Running it is streamer.compare's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from producers.schedule import Schedule
from streamer.config import LearnConfig, span_start
from streamer.spin import in_passing

__all__ = ["MULTITASK", "IDLE_TIMEOUT_S", "Log", "CompareError", "CompareConfig", "Planned", "print_line",
           "strategy_names", "run_config", "plan"]


MULTITASK = "multitask"
IDLE_TIMEOUT_S = 120.0  # a run stops when its topic has given nothing for this long (a short topic)
Log = Callable[[str], None]


def print_line(message: str) -> None:
    print(message, flush=True)


class CompareError(ValueError):
    """A comparison that cannot run as asked (an unknown strategy, one that cannot run on the model)."""


@dataclass(frozen=True)
class CompareConfig:
    """One comparison: which strategies, which seeds, on which stream, with which learner settings."""

    learn: LearnConfig  # every run's template: model, sizes, rate, limits, detector, probe, k
    schedule: Schedule  # the stream; each seed replaces its seed
    corpus: Path
    out: Path
    strategies: tuple[str, ...] = ("naive", "replay")
    chosen_by_all: bool = False  # "all": a strategy that cannot run on the model is skipped, not an error
    options: Mapping[str, tuple[tuple[str, object], ...]] = field(default_factory=dict)  # per strategy
    seeds: tuple[int, ...] = (0,)
    params: int | None = None  # size each strategy's model to about this many parameters
    span: str | int = "half"  # the tables' span: 'half', 'all' or a fragment index
    probe_examples: int = 50  # producers.stream.prepare_stream's options
    utterances: bool | None = None
    keep_checkpoints: bool = False
    bootstrap_servers: str | None = None  # None: the embedded broker
    flags: Mapping[str, object] = field(default_factory=dict)  # the command line, recorded in plan.json
    jobs: int = 1  # runs at a time; above 1, each in its own process
    job_threads: int = 1  # torch threads of each job process (jobs > 1)
    thread_line: str = ""  # this process's thread policy, said when the runs are its own (sequential)


@dataclass(frozen=True)
class Planned:
    """One strategy as every seed runs it."""

    name: str
    options: tuple[tuple[str, object], ...]  # hyperparameters: the file's [strategy.<name>], then --set
    hidden: int  # --hidden, or the size fitted to --params


def strategy_names(spec: str) -> tuple[list[str], bool]:
    """(names, chosen_by_all): "all" is every registered strategy and multitask, in registry order."""
    from streamer.strategies import STRATEGIES

    known = [*STRATEGIES, MULTITASK]
    if spec.strip() == "all":
        return known, True
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if "all" in names:  # ('unknown all; choose from ... or 'all'')
        raise CompareError(f"--strategies: 'all' stands alone (it is every strategy), not in a list: {spec}")
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise CompareError(f"--strategies: unknown {', '.join(unknown) or '(none given)'}; "
                           f"choose from {', '.join(known)} or 'all'")
    if len(set(names)) != len(names):
        raise CompareError(f"--strategies names a strategy twice: {spec}")
    return names, False


def run_config(config: CompareConfig, name: str, seed: int, hidden: int, manifest: dict, *, fit: bool = False,
                topic: str = "", run_dir: Path = Path("."), log: Log = print_line) -> LearnConfig:
    """A run's LearnConfig; multitask is sized and checked as the naive learner it runs."""
    from streamer.budget import fit_to_budget

    options = tuple(config.options.get(name, ()))
    as_name, as_options = ("naive", ()) if name == MULTITASK else (name, options)
    template = config.learn
    run = dataclasses.replace(
        template, bootstrap_servers=config.bootstrap_servers or "", topic=topic, group_id=f"{topic}-{name}",
        run_dir=run_dir, run_name=run_dir.name, strategy=as_name, strategy_options=as_options, seed=seed,
        model=dataclasses.replace(template.model, hidden=hidden), idle_timeout_s=IDLE_TIMEOUT_S,
    ).with_manifest(manifest)
    run = dataclasses.replace(run, from_fragment=span_start(config.span, run.n_fragments))
    if fit and config.params:
        run, fitted = fit_to_budget(run, config.params, manifest)
        log(fitted.describe(f"{name} (a naive learner)" if name == MULTITASK else name))  # (it said naive twice)
    return dataclasses.replace(run, strategy=name, strategy_options=options)


def _check(config: LearnConfig, manifest: dict) -> None:
    """Build the strategy on the CPU: raises when it cannot run on the model."""
    import torch

    from streamer.learner import build_strategy
    from streamer.models import ModelRequest, build_model

    if config.strategy != MULTITASK:
        build_strategy(config, torch.device("cpu"), manifest)
        return
    from streamer.multitask import ShuffledNaive

    built = build_model(ModelRequest(config.model_name, config.model, config.model_options, manifest,
                                     torch.device("cpu")))
    try:
        ShuffledNaive(built.model, lr=config.resolved_lr, clip=config.clip, **dict(config.strategy_options))
    except TypeError as exc:
        raise ValueError(f"--set for strategy 'multitask': {exc}") from None


def plan(config: CompareConfig, manifest: dict, log: Log = print_line) -> tuple[list[Planned], dict[str, str]]:
    """The strategies that can run (sized to the parameter budget), and those skipped with why."""
    planned, skipped = [], {}
    for name in config.strategies:
        try:
            run = run_config(config, name, config.learn.seed, config.learn.model.hidden, manifest, fit=True, log=log)
            in_passing(_check, run, manifest)  # its torch work leaves no OpenMP team behind (streamer.spin)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, NotImplementedError) as exc:
            if not config.chosen_by_all:
                raise CompareError(f"strategy {name}: {exc}") from None
            skipped[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log(f"skipping {name}: {skipped[name]}")
            continue
        planned.append(Planned(name, run.strategy_options, run.model.hidden))
    if not planned:
        raise CompareError("no strategy can run on this model: "
                           + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return planned, skipped
