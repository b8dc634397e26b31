"""A learning run: the prequential loop (streamer.loop) and the small objects that consume its results.

    results of PrequentialLoop --> LiveMonitor (metrics tracker, Prometheus through its facade)
                               --> LossLogWriter (losses.jsonl)
                               --> Checkpointer (checkpoint.pt every checkpoint_every_s, on a revoke and at
                                                 the end, written in the background; then commits the
                                                 offsets it covers to Kafka)
                               --> ProbeScheduler (probes.jsonl)
    The next steps run ahead of these consumers (streamer.run_ahead's snapshot_wanted) unless a checkpoint or
    a probe is due after one in flight: they take in result k while the worker learns batch k + 1 (short
    steps: a quarter second of them behind it, at most 32, their results taken in a burst).
    loop state (dead letters, lag, queue depth, waiting, broker lost; checkpointer, probes) --> LiveMonitor
        --> its console snapshot --> LiveView and <run_dir>/status.json, polled a few times a second

`run(config, ...)` composes them for the command line; it prints only through `log`. The consumers'
order and the idle checkpoint are streamer.result_consumers'; the signals' handling streamer.run_signals'.

Ranks of a distributed learner (streamer.distributed, under torchrun): each rank reads its own
partitions into its rows and steps with the others; rank 0 alone writes the run directory (config,
loss log in global batch order, status, checkpoint with every rank's state and offsets) and serves
the metrics; the others write nothing there. Probes are not scored in a distributed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from monitor.console import STATUS_FILE, LoopReading, read_status, write_status
from monitor.exporter import create_metrics, serve
from monitor.files import replace_text
from monitor.live import LiveMonitor
from monitor.view import LiveView
from producers.kafka import ensure_topic
from producers.wire import REASONS
from streamer import checkpoint, distributed
from streamer.checkpointer import Checkpointer
from streamer.config import LearnConfig, RunSummary
from streamer.kafka.consumer import KafkaSource
from streamer.loop import PrequentialLoop
from streamer.models import ModelRequest, build_model
from streamer.probe import ProbeScheduler, load_probe_set
from streamer.result_consumers import consume_results, sync_monitor
from streamer.run_signals import StopOnSignals
from streamer.settings import kafka_client_options
from streamer.spin import governor, in_passing
from streamer.strategies import STRATEGIES

__all__ = ["build_strategy", "resolve_device", "run", "told_the_class", "write_run_config", "restore"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def build_strategy(config: LearnConfig, device: torch.device, manifest: dict | None = None):
    """The model by name, wrapped in the strategy; returns (strategy, BuiltModel)."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    built = build_model(ModelRequest(config.model_name, config.model, config.model_options, manifest, device))
    options = dict(config.strategy_options)
    cls = STRATEGIES[config.strategy]
    if "seed" in inspect.signature(cls).parameters:  # the run's seed drives the strategy's own draws
        options.setdefault("seed", config.seed)
    try:
        return cls(built.model, lr=config.resolved_lr, clip=config.clip, **options), built
    except TypeError as exc:  # an option the strategy does not have
        raise ValueError(f"--set for strategy {config.strategy!r}: {exc}") from None


def told_the_class(config: LearnConfig) -> bool:
    """Whether the run's strategy is an oracle, told the class (`independent`): config.json, the report, the
    comparison tables and the live view say so, from this."""
    return bool(getattr(STRATEGIES[config.strategy], "oracle", False))


def write_run_config(config: LearnConfig, device: torch.device, params: int, built, resumed: bool = False) -> None:
    """config.json: the run's config, device, parameter count, model details and whether the strategy is an
    oracle; `started` is this learner's start, `run_started` the run's (a resumed run keeps its first);
    `ranks`, the processes learning it (a strategy's state kept per rank gives other numbers for another
    N), and under ranks `probe` false: they score no probe split."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    run_started = started
    if resumed:
        with contextlib.suppress(OSError, ValueError, AttributeError, KeyError, TypeError):
            before = json.loads((config.run_dir / "config.json").read_text())
            run_started = float(before.get("run_started") or before["started"])
    data = asdict(config)
    data.update(run_dir=str(config.run_dir), device=str(device), parameters=params,
                model_kind=built.kind, model_details=built.details, started=started, run_started=run_started,
                oracle=told_the_class(config),
                torch_threads=torch.get_num_threads(),  # this process's (a rank's own): float sums can follow it
                ranks=distributed.ranks_count())
    if data["ranks"] > 1:
        data["probe"] = False
    # whole or not at all (monitor.files): `streamer report` and `status` read it while a learner (re)starts
    replace_text(config.run_dir / "config.json", json.dumps(data, indent=2, default=str))


async def run(config: LearnConfig, *, manifest: dict | None = None, prepared=None, producer=None,
              console: Console | None = None, log=print, monitor: LiveMonitor | None = None,
              view=None, resume: dict | None = None, from_beginning: bool = False,
              stop_signals: tuple = ()) -> RunSummary:
    """Consume, score and learn until a stop condition; returns the run's summary.

    `prepared`: build_strategy's (strategy, built) for this config, when the caller has it (a
    pretrained model then loads once). `producer`: a coroutine factory run beside the learner (its
    topic is created first). `monitor`: a LiveMonitor of the caller's (tests read its tracker);
    otherwise one is built, with Prometheus metrics served on config.metrics_port when set.
    `view`: anything with LiveView's update(snapshot, force=False) and context manager (compare
    shows one progress line); otherwise a LiveView on `console` (plain lines when not config.live_view).
    `resume`: a checkpoint's dict (streamer.resume.resume_state) to continue from: strategy, RNG, the
    loop's carry-over and step, the tracker; partitions are read from its offsets, and the run's logs
    are cut back to its step and appended to; partitions without an offset of the run's own start at
    the earliest record. `from_beginning` (--fresh): start without `resume` even where the group has
    committed offsets (refused otherwise: they are another model's, KafkaSource).
    `stop_signals`: signals that stop the run cleanly (the step in flight, a checkpoint, a commit);
    a second SIGINT exits at once with status 130."""
    started = time.monotonic()
    ranks = distributed.current()  # None: one process
    leader = ranks is None or ranks.leader  # writes the run directory
    device = resolve_device(config.device)
    strategy, built = prepared or in_passing(build_strategy, config, device, manifest)  # as restore, below
    if leader:
        params = sum(p.numel() for p in strategy.model.parameters())
        write_run_config(config, device, params, built, resumed=resume is not None)
        log(f"model {config.model_name}, strategy {config.strategy}: {params:,} parameters on {device}"
            + (f" (--device auto: {'a CUDA device' if device.type == 'cuda' else 'no CUDA device'} here)"
               if config.device == "auto" else ""))
    batcher = built.make_batcher(config.streams // (ranks.world if ranks else 1), config.window, device)
    if ranks is not None:
        batcher.first_stream = ranks.first_stream(config.streams)
    total_batches, shown_total = _batch_limits(config, built, manifest)
    monitor = _monitor(config, monitor, shown_total, leader)
    if view is None:
        view = LiveView(console=console if config.live_view else Console(force_terminal=False), enabled=leader)
    source = await _kafka_source(config, ranks, log, topic_first=producer is not None)
    source.seek_on_assign(batcher.offsets.next_positions, new_run=resume is None and not from_beginning)
    loop = PrequentialLoop(strategy, batcher, source,
                           max_batches=config.max_batches, total_batches=None if config.max_batches else total_batches,
                           total_records=config.total_records, idle_timeout_s=config.idle_timeout_s,
                           max_seconds=config.minutes * 60 if config.minutes else None, queue_size=config.queue_size,
                           broker_timeout_s=config.broker_timeout_s, log=log, ranks=ranks,
                           keep_windows=config.keep_windows)
    server, tasks, failure, probes = None, [], None, None
    try:
        probes = None if ranks else _probe_scheduler(config, built, manifest, batcher, loop)
        if ranks is not None and leader and manifest and config.probe:
            log("probes: not scored in a distributed run (--nproc); `streamer report` has the stream's own metrics")
        labels = batcher.vocabulary.names if built.kind == "classifier" else None  # the label of each head row
        checkpointer = Checkpointer(config.run_dir / "checkpoint.pt", config.checkpoint_every_s,
                                    config=config, loop=loop, monitor=monitor, labels=labels)
        source.on_revoke = checkpointer.on_revoke  # a rebalance: checkpoint and commit first
        # a checkpoint or a probe due keeps the next step from running ahead of the consumer
        loop.run_ahead.snapshot_wanted = lambda index, upcoming, previous: (
            checkpointer.time_due() or (probes is not None and probes.wants(index, upcoming, previous)))
        if resume is not None:
            _resume(config, resume, loop, monitor, checkpointer, ranks, log)
        if config.metrics_port is not None and monitor.metrics is not None:  # served once restored: a scrape
            # between saw a resumed run's counters at 0, then at its totals (increase() counted them again)
            server = _serve_metrics(config, monitor, loop, log)
        before = (loop.step, loop.tokens, loop.skipped)  # the checkpoint's: the summary counts this start's own
        with view, StopOnSignals(stop_signals, loop, log):
            run_dir = config.run_dir if leader else None  # the other ranks write no log and no status
            tasks = [asyncio.create_task(consume_results(loop, monitor, checkpointer, probes, run_dir, view, log=log,
                                                         final_probe=built.kind == "classifier",
                                                         resumed=resume is not None))]
            if producer is not None:
                tasks.append(asyncio.create_task(producer()))
            await _until_learned(tasks, loop)
            sync_monitor(loop, monitor, checkpointer, probes, finished=True)
            final = monitor.console_snapshot()
            view.update(final, force=True)
            if leader:
                write_status(config.run_dir / STATUS_FILE, final)
    except BaseException as error:  # an interrupt too: a Ctrl-C or SIGTERM before the learner's own handlers
        failure = error
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if failure is not None and leader:  # else status.json's last word stays "joining" or "consuming"
            with contextlib.suppress(Exception):  # the run's own error is the one reported
                _failed_status(loop, monitor, probes, config.run_dir, failure)
        if server is not None:
            server.shutdown(final_scrape=loop.stop_reason != "signal")  # a signal asks for a prompt exit
    split = monitor.time_split()
    return RunSummary(loop.step - before[0], loop.tokens - before[1], time.monotonic() - started,
                      loop.stop_reason or "stopped",
                      monitor.dead_letters, config.run_dir, probes.evaluations if probes else 0,
                      probes.seconds if probes else 0.0, compute_seconds=split.compute_s,
                      joining_seconds=split.joining_s, idle_seconds=split.idle_s,
                      broker_lost_seconds=split.broker_lost_s, topic_missing_seconds=split.topic_missing_s,
                      batches_before=before[0], skipped=loop.skipped - before[2],
                      stop_line=_refusal_of(loop), topic_gone=loop.broker_watch.topic_gone)


def _refusal_of(loop: PrequentialLoop) -> str:
    """The source's line of the loop's stop, when this process's source caused it; "" otherwise (ranks:
    another rank's refusal of another cause won the stop, and this line would name the wrong one)."""
    source = loop.source
    if getattr(source, "refusal_reason", "log_changed") != loop.stop_reason:
        return ""
    return getattr(source, "refusal", None) or ""


def _monitor(config: LearnConfig, monitor: LiveMonitor | None, shown_total: int | None, leader: bool) -> LiveMonitor:
    """The caller's LiveMonitor told the run's total, or the run's own (Prometheus metrics where they are served:
    one process, or rank 0)."""
    if monitor is not None:
        monitor.total_batches = shown_total
        return monitor
    return LiveMonitor(run=config.run_name, strategy=config.strategy, classes=config.classes, k=config.k,
                       from_fragment=config.from_fragment, total_batches=shown_total,
                       metrics=create_metrics() if config.metrics_port is not None and leader else None,
                       detector=config.detector, dead_letter_reasons=REASONS, oracle=told_the_class(config))


async def _kafka_source(config: LearnConfig, ranks, log, topic_first: bool) -> KafkaSource:
    """The run's KafkaSource, its client options resolved here (ValueError: a password that is not there);
    `topic_first` (a producer beside the learner): the topic is created before the consumer subscribes."""
    client_options = kafka_client_options(config.kafka_security)
    if topic_first:
        await ensure_topic(config.bootstrap_servers, config.topic, client_options=client_options,
                           broker_timeout_s=config.broker_timeout_s, log=log)
    return KafkaSource(config.bootstrap_servers, config.topic, config.group_id,
                       max_record_bytes=config.max_record_bytes, log=log, security=config.kafka_security,
                       client_options=client_options, broker_timeout_s=config.broker_timeout_s,
                       partitions=None if ranks is None else ranks.partitions(config.streams),
                       rank_0_of=ranks.world if ranks is not None and ranks.leader else None)


def _resume(config: LearnConfig, resume: dict, loop: PrequentialLoop, monitor: LiveMonitor, checkpointer, ranks,
            log) -> None:
    """Continue the checkpoint `resume` (restore, in a passing thread: the parameters' copies leave no OpenMP
    team behind); the counters continue only where the last learner stopped at it."""
    counters = _counters_continue(config.run_dir, resume)
    if monitor.metrics is not None and not counters:
        log(f"metrics: the counters start at 0 (the run's last learner did not stop at its checkpoint's "
            f"batch {checkpoint.CheckpointView(resume).step}: Prometheus may have scraped more); the gauges continue")
    in_passing(restore, resume, loop, monitor, ranks, counters)
    if (ranks is None or ranks.leader) and checkpointer.path.exists():  # the console shows its age until the next
        monitor.checkpointed(checkpointer.path.stat().st_mtime)


def _serve_metrics(config: LearnConfig, monitor: LiveMonitor, loop: PrequentialLoop, log):
    """The run's /metrics, served (and its address noted in config.json) until the run ends; the server."""
    _spins_gauge(monitor.metrics, (config.run_name, config.strategy))
    server, _ = serve(monitor.metrics, config.metrics_port, config.metrics_host,
                      ready=lambda: loop.consuming, labels=(config.run_name, config.strategy),
                      security=config.metrics_security)
    log(f"metrics: {config.metrics_security.scheme}://{config.metrics_host}:{server.server_address[1]}/metrics")
    _note_in_run_config(config.run_dir, metrics_address=f"{config.metrics_host}:{server.server_address[1]}")
    return server


def _failed_status(loop: PrequentialLoop, monitor: LiveMonitor, probes, run_dir: Path, error: Exception) -> None:
    """status.json says the run has stopped and why, when an error or an interrupt (before the learner's
    own signal handlers) ends it: `streamer status` shows the error, or "interrupted", rather than the
    last activity (a learner that never reached its broker said "joining")."""
    counts = loop.across_ranks()
    interrupted = isinstance(error, (KeyboardInterrupt, SystemExit, asyncio.CancelledError))
    monitor.read(LoopReading(step=loop.step, records=counts.records, lag=counts.lag, read_again=counts.read_again,
                             finished=True, probe_seconds=probes.seconds if probes else 0.0,
                             stop_reason="interrupted" if interrupted else f"failed: {_said(error)}"))
    write_status(run_dir / STATUS_FILE, monitor.console_snapshot())


def _said(error: Exception, limit: int = 300) -> str:
    """The error on one line: its own words for streamer's errors (gloo's less the C++ source location it
    puts first), `Type: words` for Python's own (a bare KeyError('x') said only 'x')."""
    words = distributed.without_source_location(" ".join(str(error).split()))
    if type(error).__module__ == "builtins" or not words:
        words = f"{type(error).__name__}: {words}" if words else type(error).__name__
    return words[:limit]


def _note_in_run_config(run_dir: Path, **values) -> None:
    """Add `values` to the run's config.json (replaced atomically): `streamer status` reads them."""
    path = Path(run_dir) / "config.json"
    data = json.loads(path.read_text())
    data.update(values)
    replace_text(path, json.dumps(data, indent=2, default=str))


def _spins_gauge(metrics, labels: tuple[str, str]) -> None:
    """streamer_openmp_short_spins follows this process's spin governor (streamer.spin), read at each
    scrape (Gauge.set_function); nothing where the spins are not governed (the series is then absent)."""
    watching = governor()
    if watching is not None:
        metrics.openmp_short_spins.labels(*labels).set_function(lambda: 1 if watching.shared else 0)


def _counters_continue(run_dir: Path, state: dict) -> bool:
    """Whether the Prometheus counters go on from the checkpoint's totals: only when the run's last
    learner stopped at that checkpoint (its status.json's last word: stopped, at its batch), so that no
    scrape saw more. After a crash (kill -9, out of memory) the checkpoint's totals are older than the
    last scrape, and counters that came back lower than they were, not at 0, counted twice in every
    increase() over the restart: they start at 0 then (see PrometheusSink.load_state_dict)."""
    status = read_status(run_dir / STATUS_FILE)
    return (status is not None and status.activity == "stopped"
            and status.batches == checkpoint.CheckpointView(state).step)


def restore(state: dict, loop: PrequentialLoop, monitor: LiveMonitor, ranks=None, counters: bool = True) -> None:
    """Continue a checkpoint's run: the strategy (model, optimizer, memories, detectors), the loop's
    step and carry-over (its offsets are where the partitions are read from), the tracker, and last
    the random generators (nothing draws from them between here and the first step). The strategy's
    tensors go to the batches' device (a checkpoint loads on the CPU). Ranks: each takes its own
    part of the checkpoint (written by as many ranks)."""
    saved = checkpoint.CheckpointView(state)
    own = saved.part(None if ranks is None else ranks.rank)
    try:
        loop.strategy.load_state_dict(checkpoint.on_device(own.strategy, loop.batcher.device))
    except (ValueError, RuntimeError, KeyError) as exc:  # another layout or shape: one line, not a traceback
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = "" if "--fresh" in reason else "; --fresh starts the run over"
        raise checkpoint.CheckpointError(f"cannot resume from the checkpoint: {reason}{hint}") from None
    loop.load_state_dict(own.loop)
    if saved.tracker is not None:
        monitor.load_state_dict(saved.tracker, counters=counters)
    checkpoint.set_rng_state(own.rng)


async def _until_learned(tasks: list, loop: PrequentialLoop) -> None:
    """Wait for the learner (tasks[0]) and the producer beside it; a failure of either ends both. A run
    stopped by a signal does not wait for its producer."""
    pending = set(tasks)
    while tasks[0] in pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # re-raise a failure
    if loop.stop_reason == "signal":
        for task in pending:
            task.cancel()
    await asyncio.gather(*pending, return_exceptions=loop.stop_reason == "signal")


def _batch_limits(config: LearnConfig, built, manifest: dict | None) -> tuple[int | None, int | None]:
    """(batches that end the stream, the total the view shows). The manifest counts b x w byte windows;
    with another tokenizer the stream ends when its records do; utterance streams have one per row."""
    counts_bytes = built.kind == "lm" and isinstance(built.encode("a"), (bytes, bytearray))
    total = config.total_batches if counts_bytes else None
    shown = (config.max_batches or config.total_batches) if counts_bytes else config.max_batches
    if built.kind == "classifier" and manifest and manifest.get("level") == "utterance" and not manifest.get("loop"):
        total = manifest["total_records"] // config.streams
        shown = config.max_batches or total
    return total, shown


def _probe_scheduler(config: LearnConfig, built, manifest, batcher, loop) -> ProbeScheduler | None:
    """The held-out probe split of every class, scored between steps (None without one or with --no-probe)."""
    if not (manifest and config.probe):
        return None
    if built.kind == "classifier":  # held-out utterances: accuracy, DMI representations
        from streamer.classifier_probe import load_classifier_probe

        probe_set = load_classifier_probe(manifest, batcher, config.run_dir, lambda: (loop.step, loop.labels_known))
        unit = "accuracy"
    else:
        probe_set = load_probe_set(manifest, rows=config.streams, window=config.window, encode=built.encode)
        unit = None
    if probe_set is None:
        return None
    return ProbeScheduler(probe_set, config.run_dir / "probes.jsonl", every=config.probe_every,
                          at_switches=config.probe_at_switches, unit=unit)
