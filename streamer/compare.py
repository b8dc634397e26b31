"""Comparisons: several strategies on the same stream, seed by seed, then CALM's Table 1.

Per seed the stream is built once (manifest and probe split in `<out>/streams/seed<s>/`) and
produced once into its own topic; each strategy then reads that topic from its start as its
own consumer group, into `<out>/<strategy>-seed<s>/`: one run after the other in this process
(`jobs` 1, or a single run), or `jobs` runs at a time, each in its own spawned process with
`job_threads` torch threads (streamer.jobs; a run's losses are those of the same run alone with that
many threads).
`multitask` learns the same records offline in a shuffled order (streamer.multitask). Each run
gets its report (results.json, loss_curve.png); `<out>` gets table1.md, forgetting.md,
after_switch.png and comparison.json (monitor.compare) and plan.json (strategies, options,
sizes, skips).

A comparison is a frozen CompareConfig (streamer.compare_plan, with its plan): the command line
(`streamer compare`) builds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import sys
import threading
import time
from pathlib import Path

from monitor.files import replace_text
from monitor.losslog import read_loss_log
from streamer.compare_plan import (MULTITASK, CompareConfig, CompareError, Log, Planned, plan, print_line,
                                   run_config)
from streamer.config import LearnConfig, RunSummary, span_start
from streamer.jobs import one_line, run_jobs
from streamer.spin import in_passing
from streamer.threads import available_cpus

__all__ = ["run_compare"]


class RunSkipped(Exception):
    """A run that ended without a report, for a reason of the comparison's own (the i.i.d. reference
    stopped by --minutes): noted in the table, and the other runs go on."""


class _Progress:
    """A run's view: one line, rewritten in place on a terminal, printed once at the end otherwise."""

    def __init__(self, label: str, total: int | None, live: bool = True):
        self.label, self.total, self.batches = label, total, 0
        self._tty = live and sys.stdout.isatty()  # parallel jobs print only their final line
        self._last = 0.0

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, snapshot, force: bool = False) -> None:
        self.batches = snapshot.batches
        self._show(force)

    def __call__(self) -> None:  # multitask's on_step, once per batch
        self.batches += 1
        self._show(False)

    def _show(self, force: bool) -> None:
        now = time.monotonic()
        if self._tty and (force or now - self._last >= 0.5):
            self._last = now
            total = f"/{self.total}" if self.total else ""
            print(f"\r{self.label}: {self.batches}{total} batches", end="", flush=True)

    def done(self, text: str) -> None:
        print(("\r\033[K" if self._tty else "") + f"{self.label}: {text}", flush=True)


async def _produce(records, bootstrap: str, topic: str, security=None, broker_timeout_s: float = 60.0,
                   log: Log | None = None) -> int:
    from producers.stream import produce_stream

    from streamer.settings import kafka_client_options

    # (producers.kafka.produce creates the topic first)
    return await produce_stream(records, bootstrap, topic, truth_topic=False,
                                client_options=kafka_client_options(security), broker_timeout_s=broker_timeout_s,
                                log=log)


def _learn(config: LearnConfig, manifest: dict, progress: _Progress, log: Log) -> RunSummary:
    """One streaming run under its progress line."""
    from streamer.learner import run

    return asyncio.run(run(config, manifest=manifest, view=progress, log=log))


def _count_oracle_models(run_dir: Path) -> None:
    """independent's model grows a copy per class: record the parameters of all of them."""
    path = run_dir / "config.json"
    recorded = json.loads(path.read_text())
    classes = len({record["domain_name"] for record in read_loss_log(run_dir / "losses.jsonl")})
    per_class = recorded["parameters"]
    recorded.update(parameters=per_class * max(1, classes), parameters_at_start=per_class,
                    parameters_per_class=per_class, classes_seen=classes)
    replace_text(path, json.dumps(recorded, indent=2))


def _metric(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _is_oracle(name: str) -> bool:
    from streamer.strategies.catalog import STRATEGY_CATALOG

    return STRATEGY_CATALOG[name].oracle


def _run_one(config: CompareConfig, item: Planned, seed: int, stream: tuple[dict, list], topic: str,
             log: Log, live: bool = True) -> Path:
    from monitor.report import write_report  # river and scipy: here, not where the CLI names CompareError
    from streamer.multitask import run_multitask

    manifest, records = stream
    run_dir = config.out / f"{item.name}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    run = dataclasses.replace(run_config(config, item.name, seed, item.hidden, manifest, topic=topic,
                                          run_dir=run_dir), strategy_options=item.options)
    progress = _Progress(f"{item.name} seed {seed}", run.max_batches or run.total_batches, live)
    if item.name == MULTITASK:
        stop, learned = threading.Event(), 0  # a Ctrl-C here stops the run at its next step
        ends = time.monotonic() + run.minutes * 60 if run.minutes else None

        def step() -> None:  # after each batch learned
            nonlocal learned
            learned += 1
            if stop.is_set():
                raise KeyboardInterrupt
            if ends is not None and time.monotonic() >= ends:
                of_all = f" of its {progress.total:,}" if progress.total else ""
                raise RunSkipped(f"--minutes {run.minutes:g} ended it after {learned:,}{of_all} batches, "
                                 "shuffled: the i.i.d. reference reports only a whole stream")
            progress()

        try:  # in a passing thread: no OpenMP team stays in this one
            summary = in_passing(lambda: run_multitask(run, manifest, records=records, detector=run.detector,
                                                       on_step=step), on_interrupt=stop.set)
        except KeyboardInterrupt:  # its losses are complete only at the end: no report, but a line
            print(f"streamer: interrupted; {item.name} seed {seed} had learned {learned:,} batches of the "
                  f"stream, shuffled: the i.i.d. reference writes its report only once it has learned them all",
                  file=sys.stderr)
            raise
    else:
        try:
            summary = _learn(run, manifest, progress, log)
        except KeyboardInterrupt:  # still the report of what was learned
            if (run_dir / "losses.jsonl").exists() and (run_dir / "losses.jsonl").stat().st_size:
                write_report(run_dir, k=run.k, from_fragment=config.span)
                print(f"streamer: stopped before its end; report of the batches learned so far in {run_dir}",
                      file=sys.stderr)  # (interrupted, or, under compare --jobs, another job failed)
            raise
        if _is_oracle(item.name):
            _count_oracle_models(run_dir)
    try:
        report = write_report(run_dir, k=run.k, from_fragment=config.span)
    except KeyboardInterrupt:  # learned whole: the checkpoint stays, and the report can be written later
        print(f"streamer: interrupted while writing the report of {run_dir}, learned whole: "
              f"`streamer report {run_dir}` writes it", file=sys.stderr)
        raise
    if not config.keep_checkpoints:  # (only once the report is written)
        (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    metrics = report["metrics"]
    progress.done(f"{summary.batches} batches in {summary.seconds:.1f}s ({summary.stop_reason}); "
                  f"ppl {_metric(metrics['ppl'])} ppl@sw {_metric(metrics['ppl@sw'])} rec {_metric(metrics['rec'])}")
    return run_dir


def _streams(config: CompareConfig, log: Log) -> dict[int, tuple[dict, list]]:
    """Per seed, (manifest, records) of its stream; the manifest is written under <out>/streams/seed<s>/."""
    from producers.stream import prepare_stream

    streams = {}
    for seed in config.seeds:
        manifest_path = config.out / "streams" / f"seed{seed}" / "manifest.json"
        records, manifest = prepare_stream(config.corpus, dataclasses.replace(config.schedule, seed=seed),
                                           manifest_path, probe_examples=config.probe_examples,
                                           utterances=config.utterances)
        model = config.learn.model_name
        own = "" if model == "lstm-char" else f"; {model} cuts its own from its tokens"
        log(f"seed {seed}: {manifest['n_fragments']} fragments of {', '.join(manifest['classes'])}, "
            f"{manifest['total_batches']} batches of {config.learn.streams}x{config.learn.window} bytes{own}")
        streams[seed] = (manifest, records)
    return streams


def _tables(config: CompareConfig, run_dirs: list[Path], skipped: dict[str, str], log: Log,
            incomplete: str | None = None) -> None:
    """Table 1, the forgetting table and the figures of the runs that finished; `skipped` (run: why) and
    `incomplete` (why the comparison ended before its plan) are said in table1.md and comparison.json."""
    from monitor.compare import load_runs, write_comparison

    out = config.out
    comparison = write_comparison(load_runs(run_dirs, k=config.learn.k, from_fragment=config.span), out,
                                  left_out=skipped, incomplete=incomplete)
    log("")
    log((out / "table1.md").read_text())
    log((out / "forgetting.md").read_text())
    for name, reason in comparison.get("skipped", {}).items():
        log(f"figure {name} not drawn: {reason}")
    log(f"written to {out}: {', '.join(comparison['files'])}, plan.json and one directory per run")


def _unfinished(planned: list[Planned], seeds, run_dirs: list[Path], skipped: dict[str, str], why: str) -> None:
    """The planned runs neither finished nor noted, noted in `skipped` as not run to their end, `why`."""
    finished = {path.name for path in run_dirs}
    for seed in seeds:
        for item in planned:
            key = f"{item.name} (seed {seed})"
            if f"{item.name}-seed{seed}" not in finished and key not in skipped:
                skipped[key] = f"not run to its end: {why}"


def _fatal_errors() -> tuple[type[BaseException], ...]:
    """Errors that end a comparison even under "all" (the stream, the broker or the data, not a strategy)."""
    from producers.corpora import CorpusError
    from producers.kafka import ProduceError
    from producers.schedule import ScheduleError
    from streamer.broker import BrokerError
    from streamer.source import SourceError

    return CompareError, CorpusError, ScheduleError, SourceError, ProduceError, BrokerError


def _failed(name: str, seed: int, reason: str, skipped: dict[str, str], log: Log) -> None:
    """With `all`, a failed run is noted (its strategy's row shows the seeds that ran) and the others go on."""
    skipped[f"{name} (seed {seed})"] = f"failed: {reason}"
    log(f"{name} seed {seed}: failed: {reason}")


def _skipped(name: str, seed: int, reason: str, skipped: dict[str, str], log: Log) -> None:
    """A run that ended without a report (RunSkipped): noted, and the others go on."""
    skipped[f"{name} (seed {seed})"] = reason
    log(f"{name} seed {seed}: no report: {reason}")


def _job(config: CompareConfig, item: Planned, seed: int, stream: tuple[dict, list], topic: str):
    """One run in its own process (streamer.jobs): (run directory, None, None) or (None, error line,
    "fatal" | "failed" | "skipped")."""
    try:
        return str(_run_one(config, item, seed, stream, topic, print_line, live=False)), None, None
    except RunSkipped as exc:
        return None, str(exc), "skipped"
    except Exception as exc:  # noqa: BLE001  (the parent decides: one line, never a traceback)
        return None, one_line(exc, 200), "fatal" if isinstance(exc, _fatal_errors()) else "failed"


def _run_parallel(config: CompareConfig, runs: list[tuple[Planned, int]], streams: dict, topic_prefix: str,
                  run_dirs: list[Path], skipped: dict[str, str], log: Log) -> None:
    """The runs, config.jobs at a time in spawned processes; run_dirs gets the finished ones in plan order.

    A failed run stops them all (one line) unless the strategies came from `all` and the failure is
    the strategy's own; Ctrl-C stops them all."""
    jobs, cpus = min(config.jobs, len(runs)), available_cpus()
    crowded = (f"; {jobs * config.job_threads} torch threads on {cpus} CPU{'s' if cpus > 1 else ''}: they take turns, "
               f"and each run is slower" if jobs * config.job_threads > cpus else "")
    log(f"{len(runs)} runs, {jobs} at a time (--jobs N to change), each in its own process with "
        f"{config.job_threads} torch thread{'s' if config.job_threads > 1 else ''}{crowded}")
    tasks = [(config, item, seed, streams[seed] if item.name == MULTITASK else (streams[seed][0], []),
              f"{topic_prefix}{seed}") for item, seed in runs]
    finished: dict[int, Path] = {}

    def outcome(index: int, result) -> None:
        item, seed = runs[index]
        path, error, kind = result.value if result.error is None else (None, result.error, "failed")  # it died
        if error is None:
            finished[index] = Path(path)
        elif kind == "skipped":
            _skipped(item.name, seed, error, skipped, log)
        elif kind == "fatal" or not config.chosen_by_all:
            raise CompareError(f"{item.name} seed {seed}: {error}")
        else:
            _failed(item.name, seed, error, skipped, log)

    try:
        run_jobs(_job, tasks, jobs, config.job_threads, outcome)
    finally:
        run_dirs.extend(finished[index] for index in sorted(finished))


def run_compare(config: CompareConfig, log: Log = print_line) -> list[Path]:
    """Every planned strategy on every seed's stream, then the tables; the run directories. The
    output directory is held (its .lock) for the comparison's life."""

    from streamer.resume import RunDirBusy, RunDirLock

    started = time.monotonic()
    try:  # two comparisons writing one --out wrote one loss log at once (a traceback: 'not JSON')
        with RunDirLock(config.out, holder="a running comparison", other="another --out"):
            held = sorted(p.name for p in config.out.iterdir()
                          if p.name in ("plan.json", "comparison.json", "table1.md")
                          or (p / "losses.jsonl").exists() or (p / "checkpoint.pt").exists())
            if held:  # an earlier comparison's runs and figures stayed beside the new tables
                raise CompareError(f"--out {config.out} holds an earlier comparison ({', '.join(held[:4])}"
                                   + (", ...)" if len(held) > 4 else ")") + ": the new tables would sit among "
                                   "its runs; give a new --out (the default, runs/compare-<time>, always is) or move "
                                   "it away")
            return _compare(config, started, log)
    except RunDirBusy as exc:
        raise CompareError(str(exc)) from None


def _compare(config: CompareConfig, started: float, log: Log) -> list[Path]:
    from streamer.broker import EmbeddedBroker

    streams = _streams(config, log)
    for manifest, _ in streams.values():  # before any run: a span past the stream's end scores nothing
        try:
            span_start(config.span, manifest["n_fragments"])
        except ValueError as exc:
            raise CompareError(str(exc)) from None
    planned, skipped = plan(config, streams[config.seeds[0]][0], log)
    (config.out / "plan.json").write_text(json.dumps({
        "strategies": [{"name": p.name, "options": dict(p.options), "hidden": p.hidden} for p in planned],
        "skipped": skipped, "seeds": list(config.seeds), "params": config.params,
        "flags": dict(config.flags)}, indent=2, default=str))
    stamp = f"{int(time.time())}-{secrets.token_hex(3)}"  # two comparisons started in one second: two topics
    run_dirs: list[Path] = []
    fatal = _fatal_errors()

    def run_all(bootstrap: str | None) -> None:
        nonlocal config
        config = dataclasses.replace(config, bootstrap_servers=bootstrap)
        runs = [(item, seed) for seed in config.seeds for item in planned]
        if (config.jobs == 1 or len(runs) == 1) and config.thread_line:  # the runs are this process's
            log(config.thread_line)
        for seed in config.seeds:
            topic = f"compare-{stamp}-seed{seed}"
            if bootstrap and any(item.name != MULTITASK for item in planned):
                sent = asyncio.run(_produce(streams[seed][1], bootstrap, topic, config.learn.kafka_security,
                                            config.learn.broker_timeout_s, log))
                log(f"seed {seed}: {sent} records in topic {topic}")
            if config.jobs > 1 and len(runs) > 1:
                continue  # every topic first, then the runs side by side
            for item in planned:
                try:
                    run_dirs.append(_run_one(config, item, seed, streams[seed], topic, log))
                except RunSkipped as exc:
                    _skipped(item.name, seed, str(exc), skipped, log)
                except Exception as exc:  # noqa: BLE001  (with `all`, one strategy's failure ends only its runs)
                    if isinstance(exc, fatal):
                        raise
                    if not config.chosen_by_all:  # one line naming the run, as from a job (_run_parallel)
                        raise CompareError(f"{item.name} seed {seed}: {one_line(exc, 200)}") from None
                    _failed(item.name, seed, one_line(exc, 200), skipped, log)
        if config.jobs > 1 and len(runs) > 1:
            _run_parallel(config, runs, streams, f"compare-{stamp}-seed", run_dirs, skipped, log)

    try:
        if config.bootstrap_servers or all(item.name == MULTITASK for item in planned):
            run_all(config.bootstrap_servers)
        else:
            with EmbeddedBroker() as broker:
                log(f"embedded broker on {broker.bootstrap_servers}")
                run_all(broker.bootstrap_servers)
    except BaseException as exc:  # interrupted or failed: still the tables of the runs that finished, said so
        if run_dirs:
            said = str(exc) if isinstance(exc, fatal) else one_line(exc, 200)  # (what the command's line says)
            why = ("the comparison was interrupted" if isinstance(exc, KeyboardInterrupt)
                   else f"the comparison ended at an error ({said})")
            _unfinished(planned, config.seeds, run_dirs, skipped, why)
            _tables(config, run_dirs, skipped, log, incomplete=why)
        raise
    _tables(config, run_dirs, skipped, log)
    log(f"{len(run_dirs)} runs in {time.monotonic() - started:.0f}s")
    return run_dirs
