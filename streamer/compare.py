"""`streamer compare`: several strategies on the same stream, seed by seed, then CALM's Table 1.

Per seed the stream is built once (manifest and probe split in `<out>/streams/seed<s>/`) and
produced once into its own topic; each strategy then reads that topic from its start as its
own consumer group, one run after the other (never side by side: they would share the
cores), into `<out>/<strategy>-seed<s>/`. `multitask` learns the same records offline in a
shuffled order (streamer.multitask). Each run gets its report (results.json,
loss_curve.png); `<out>` gets table1.md, forgetting.md, after_switch.png and
comparison.json (monitor.compare) and plan.json (strategies, options, sizes, skips).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from monitor.losslog import read_loss_log
from monitor.report import write_report
from streamer.cli import UserError

__all__ = ["MULTITASK", "Planned", "strategy_names", "strategy_options", "run_compare"]

MULTITASK = "multitask"
IDLE_TIMEOUT_S = 120.0  # a run stops when its topic has given nothing for this long (a short topic)


@dataclass(frozen=True)
class Planned:
    """One strategy as every seed runs it."""

    name: str
    options: tuple[tuple[str, object], ...]  # hyperparameters: the file's [strategy.<name>], then --set
    hidden: int  # --hidden, or the size fitted to --params
    encode: object = None  # the model's tokenizer, for the probe split


def strategy_names(spec: str) -> tuple[list[str], bool]:
    """(names, chosen_by_all): "all" is every registered strategy and multitask, in registry order."""
    from streamer.strategies import STRATEGIES

    known = [*STRATEGIES, MULTITASK]
    if spec.strip() == "all":
        return known, True
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(f"--strategies: unknown {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(known)} or 'all'")
    if len(set(names)) != len(names):
        raise UserError(f"--strategies names a strategy twice: {spec}")
    return names, False


def strategy_options(names: list[str], tables: dict, cli_options) -> dict[str, tuple]:
    """Per strategy: its config-file table, then each --set KEY=VALUE it takes (later wins).

    A --set key that none of the strategies takes is an error."""
    from streamer.config_file import strategy_hyperparameters

    allowed = {name: strategy_hyperparameters(name) for name in names}
    for key, _ in cli_options:
        if not any(key in keys for keys in allowed.values()):
            raise UserError(f"--set {key}: none of {', '.join(names)} takes it")
    return {name: (*tables.get(name, {}).items(), *((k, v) for k, v in cli_options if k in allowed[name]))
            for name in names}


def _run_args(args, name: str, options, seed: int, hidden: int, params=None) -> argparse.Namespace:
    run = argparse.Namespace(**vars(args))
    run.strategy, run.strategy_options, run.seed, run.hidden, run.params = name, list(options), seed, hidden, params
    run.idle_timeout = IDLE_TIMEOUT_S
    return run


def _config(args, name: str, options, seed: int, hidden: int, manifest: dict, *, params=None,
            bootstrap: str = "", topic: str = "", run_dir: Path = Path(".")):
    """The run's LearnConfig; multitask is sized and checked as the naive learner it runs."""
    from streamer.commands import _learn_config

    as_name, as_options = ("naive", ()) if name == MULTITASK else (name, options)
    config = _learn_config(_run_args(args, as_name, as_options, seed, hidden, params), bootstrap=bootstrap,
                           topic=topic, group=f"{topic}-{name}", run_dir=run_dir, manifest=manifest)
    return dataclasses.replace(config, strategy=name, strategy_options=tuple(options))


def _check(config, manifest: dict):
    """Build the strategy on the CPU (raises when it cannot run on the model); its BuiltModel."""
    import torch

    from streamer.learner import build_strategy
    from streamer.models import ModelRequest, build_model

    if config.strategy != MULTITASK:
        return build_strategy(config, torch.device("cpu"), manifest)[1]
    from streamer.multitask import ShuffledNaive

    built = build_model(ModelRequest(config.model_name, config.model, config.model_options, manifest,
                                     torch.device("cpu")))
    try:
        ShuffledNaive(built.model, lr=config.resolved_lr, clip=config.clip, **dict(config.strategy_options))
    except TypeError as exc:
        raise ValueError(f"--set for strategy 'multitask': {exc}") from None
    return built


def plan(args, names: list[str], by_all: bool, manifest: dict) -> tuple[list[Planned], dict[str, str]]:
    """The strategies that can run (sized to --params), and those skipped with why."""
    options = strategy_options(names, getattr(args, "strategy_tables", {}) or {}, args.strategy_options)
    planned, skipped = [], {}
    for name in names:
        try:
            config = _config(args, name, options[name], args.seed, args.hidden, manifest, params=args.params)
            built = _check(config, manifest)
        except (UserError, ValueError, TypeError, KeyError, AttributeError, RuntimeError, NotImplementedError) as exc:
            if not by_all:
                raise UserError(f"strategy {name}: {exc}") from None
            skipped[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"skipping {name}: {skipped[name]}", flush=True)
            continue
        planned.append(Planned(name, options[name], config.model.hidden, built.encode))
    if not planned:
        raise UserError("no strategy can run on this model: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return planned, skipped


class _Progress:
    """One line per run: rewritten in place on a terminal, printed once at the end otherwise."""

    def __init__(self, label: str, total: int | None):
        self.label, self.total, self.batches = label, total, 0
        self._tty = sys.stdout.isatty()
        self._last = 0.0

    def __call__(self) -> None:
        self.batches += 1
        now = time.monotonic()
        if self._tty and now - self._last >= 0.5:
            self._last = now
            total = f"/{self.total}" if self.total else ""
            print(f"\r{self.label}: {self.batches}{total} batches", end="", flush=True)

    def done(self, text: str) -> None:
        print(("\r\033[K" if self._tty else "") + f"{self.label}: {text}", flush=True)


async def _produce(records, bootstrap: str, topic: str) -> int:
    from producers.kafka import ensure_topic
    from producers.stream import produce_stream

    await ensure_topic(bootstrap, topic)
    return await produce_stream(records, bootstrap, topic, truth_topic=False)


def _learn(config, manifest: dict, args, encode, progress: _Progress):
    from monitor.live import LiveMonitor
    from streamer.learner import learn

    probe_set = None
    if not args.no_probe:
        from streamer.probe import load_probe_set

        probe_set = load_probe_set(manifest, rows=config.streams, window=config.window, encode=encode)
    monitor = LiveMonitor(run=config.run_name, strategy=config.strategy, classes=config.classes, k=args.k,
                          from_fragment=config.from_fragment, total_batches=config.max_batches or config.total_batches,
                          detector=args.detector)
    return asyncio.run(learn(config, monitor, progress, probe_set, manifest))


def _count_oracle_models(run_dir: Path) -> None:
    """independent's model grows a copy per class: record the parameters of all of them."""
    path = run_dir / "config.json"
    config = json.loads(path.read_text())
    classes = len({record["domain_name"] for record in read_loss_log(run_dir / "losses.jsonl")})
    per_class = config["parameters"]
    config.update(parameters=per_class * max(1, classes), parameters_at_start=per_class,
                  parameters_per_class=per_class, classes_seen=classes)
    path.write_text(json.dumps(config, indent=2))


def _metric(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _run_one(args, item: Planned, seed: int, stream: tuple[dict, list], out: Path, bootstrap: str | None,
             topic: str) -> Path:
    from streamer.commands import run_with_report_on_interrupt
    from streamer.multitask import run_multitask
    from streamer.strategies import STRATEGIES

    manifest, records = stream

    run_dir = out / f"{item.name}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    config = _config(args, item.name, item.options, seed, item.hidden, manifest, bootstrap=bootstrap or "",
                     topic=topic, run_dir=run_dir)
    progress = _Progress(f"{item.name} seed {seed}", config.max_batches or config.total_batches)
    if item.name == MULTITASK:
        summary = run_multitask(config, manifest, records=records, detector=args.detector, on_step=progress)
    else:
        summary = run_with_report_on_interrupt(run_dir, lambda: _learn(config, manifest, args, item.encode, progress))
        if getattr(STRATEGIES[item.name], "oracle", False):
            _count_oracle_models(run_dir)
    if not args.keep_checkpoints:
        (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    report = write_report(run_dir, k=args.k, from_fragment=args.from_fragment)
    metrics = report["metrics"]
    progress.done(f"{summary.batches} batches in {summary.seconds:.1f}s ({summary.stop_reason}); "
                  f"ppl {_metric(metrics['ppl'])} ppl@sw {_metric(metrics['ppl@sw'])} rec {_metric(metrics['rec'])}")
    return run_dir


def _streams(args, corpus: Path, seeds, out: Path) -> dict[int, tuple[dict, list]]:
    """Per seed, (manifest, records) of its stream; the manifest is written under <out>/streams/seed<s>/."""
    from producers.stream import prepare_stream
    from streamer.commands import _schedule, _stream_options

    streams = {}
    for seed in seeds:
        seed_args = argparse.Namespace(**{**vars(args), "seed": seed})
        manifest_path = out / "streams" / f"seed{seed}" / "manifest.json"
        records, manifest = prepare_stream(corpus, _schedule(seed_args), manifest_path, **_stream_options(args))
        print(f"seed {seed}: {manifest['n_fragments']} fragments of {', '.join(manifest['classes'])}, "
              f"{manifest['total_batches']} batches of {args.streams}x{args.window}", flush=True)
        streams[seed] = (manifest, records)
    return streams


def _tables(run_dirs: list[Path], out: Path, args, skipped: dict[str, str]) -> None:
    from monitor.compare import load_runs, write_comparison

    comparison = write_comparison(load_runs(run_dirs, k=args.k, from_fragment=args.from_fragment), out)
    if skipped:
        with (out / "table1.md").open("a", encoding="utf-8") as handle:
            handle.writelines(f"- skipped {name}: {reason}\n" for name, reason in skipped.items())
    print()
    print((out / "table1.md").read_text())
    print((out / "forgetting.md").read_text())
    for name, reason in comparison.get("skipped", {}).items():
        print(f"figure {name} not drawn: {reason}")
    print(f"written to {out}: table1.md, forgetting.md, after_switch.png, comparison.json, plan.json "
          f"and one directory per run")


def run_compare(args) -> int:
    from streamer.broker import EmbeddedBroker
    from streamer.commands import KNOWN_ERRORS as KNOWN
    from streamer.demo import _ensure_corpus

    started = time.monotonic()
    names, by_all = strategy_names(args.strategies)
    seeds = list(args.seeds or (args.seed,))
    out = args.out or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    corpus = _ensure_corpus(args)
    streams = _streams(args, corpus, seeds, out)
    planned, skipped = plan(args, names, by_all, streams[seeds[0]][0])
    (out / "plan.json").write_text(json.dumps({
        "strategies": [{"name": p.name, "options": dict(p.options), "hidden": p.hidden} for p in planned],
        "skipped": skipped, "seeds": seeds, "params": args.params,
        "flags": {k: v for k, v in vars(args).items() if k != "strategy_tables"}}, indent=2, default=str))
    stamp = int(time.time())
    run_dirs: list[Path] = []

    def run_all(bootstrap: str | None) -> None:
        for seed in seeds:
            topic = f"compare-{stamp}-seed{seed}"
            if bootstrap and any(item.name != MULTITASK for item in planned):
                sent = asyncio.run(_produce(streams[seed][1], bootstrap, topic))
                print(f"seed {seed}: {sent} records in topic {topic}", flush=True)
            for item in planned:
                try:
                    run_dirs.append(_run_one(args, item, seed, streams[seed], out, bootstrap, topic))
                except Exception as exc:  # noqa: BLE001  (with `all`, one strategy's failure ends only its runs)
                    if not by_all or isinstance(exc, KNOWN):
                        raise
                    reason = " ".join(f"{type(exc).__name__}: {exc}".replace("\\n", " ").split())
                    skipped[f"{item.name} (seed {seed})"] = f"failed: {reason[:200]}"
                    print(f"{item.name} seed {seed}: {skipped[f'{item.name} (seed {seed})']}", flush=True)

    try:
        if args.bootstrap_servers or all(item.name == MULTITASK for item in planned):
            run_all(args.bootstrap_servers)
        else:
            with EmbeddedBroker() as broker:
                print(f"embedded broker on {broker.bootstrap_servers}", flush=True)
                run_all(broker.bootstrap_servers)
    except BaseException:  # interrupted or failed: still the tables of the runs that finished
        if run_dirs:
            _tables(run_dirs, out, args, skipped)
        raise
    _tables(run_dirs, out, args, skipped)
    print(f"{len(run_dirs)} runs in {time.monotonic() - started:.0f}s")
    return 0
