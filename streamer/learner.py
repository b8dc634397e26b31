"""The learner: Kafka on the asyncio loop, the prequential step in a worker thread.

    fetch -> decode -> batch  ==bounded queue==>  worker thread: predict, record, learn
                                                   -> monitor, loss log, commit offsets
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from monitor.live import LiveMonitor
from monitor.losslog import LossLogWriter
from streamer.config import LearnConfig, RunSummary
from streamer.consumer import KafkaSource
from streamer.models import LSTMConfig, ModelRequest, build_model
from streamer.step import prequential_step
from streamer.strategies import STRATEGIES

__all__ = ["build_strategy", "resolve_device", "learn"]


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


def _write_config(config: LearnConfig, device: torch.device, params: int, built) -> None:
    config.run_dir.mkdir(parents=True, exist_ok=True)
    data = asdict(config)
    data.update(run_dir=str(config.run_dir), device=str(device), parameters=params,
                model_kind=built.kind, model_details=built.details, started=time.time(),
                oracle=bool(getattr(STRATEGIES[config.strategy], "oracle", False)))  # told the class
    (config.run_dir / "config.json").write_text(json.dumps(data, indent=2, default=str))


async def learn(config: LearnConfig, monitor: LiveMonitor, on_step=None, probe_set=None,
                manifest: dict | None = None, prepared=None) -> RunSummary:
    """Consume, score, learn and commit until a stop condition; `on_step()` after each batch.

    With a `probe_set` (streamer.probe), the held-out probe split of every class is scored
    between steps at every true switch and every `probe_every` batches, into probes.jsonl.
    `prepared` is build_strategy's (strategy, built) for this config, when the caller has it
    (a pretrained model then loads once)."""
    device = resolve_device(config.device)
    strategy, built = prepared or build_strategy(config, device, manifest)
    _write_config(config, device, sum(p.numel() for p in strategy.model.parameters()), built)
    source = KafkaSource(config.bootstrap_servers, config.topic, config.group_id)
    batcher = built.make_batcher(config.streams, config.window, device)
    queue: asyncio.Queue = asyncio.Queue(maxsize=config.queue_size)
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    state = {"batches": 0, "tokens": 0, "last_record": time.monotonic(), "stop": None, "commit": {},
             "checkpointed": time.monotonic(), "probes": 0, "probe_seconds": 0.0, "truth": None,
             "labels_known": None, "records": 0}
    # The manifest counts b x w byte windows; with another tokenizer the stream ends when its records do.
    counts_bytes = built.kind == "lm" and isinstance(built.encode("a"), (bytes, bytearray))
    limit = config.max_batches or (config.total_batches if counts_bytes else None)
    if not counts_bytes:
        monitor.total_batches = config.max_batches
    if built.kind == "classifier" and manifest and manifest.get("level") == "utterance":
        limit = config.max_batches or manifest["total_records"] // config.streams  # one utterance per row
        monitor.total_batches = limit
    if built.kind == "classifier" and probe_set is not None:  # held-out utterances: accuracy, DMI representations
        from streamer.classifier_probe import load_classifier_probe

        probe_set = load_classifier_probe(manifest, batcher, config.run_dir,
                                          lambda: (state["batches"], state["labels_known"]))

    async def fetch_loop() -> None:
        last_lag = 0.0
        while True:
            async for fetched in source.fetch():
                state["last_record"] = time.monotonic()
                state["records"] += 1
                if fetched.record is None:
                    batcher.offsets.seen(fetched.tp, fetched.offset)
                    batcher.offsets.finish(fetched.tp, fetched.offset)
                    monitor.dead_letter(fetched.dead_reason)
                    continue
                rejected = _rejected(batcher, fetched.record, config.streams)
                if rejected:
                    batcher.offsets.seen(fetched.tp, fetched.offset)
                    batcher.offsets.finish(fetched.tp, fetched.offset)
                    await source.send_dead_letter(fetched, *rejected)
                    monitor.dead_letter(rejected[0])
                    continue
                batcher.add(fetched.record, fetched.tp, fetched.offset)
                while batcher.ready():
                    await queue.put(batcher.pop())  # blocks when the worker is behind
                    monitor.set_queue_depth(queue.qsize())
            if time.monotonic() - last_lag > 1.0:
                last_lag = time.monotonic()
                monitor.set_lag(await source.lag())

    async def step_loop(log: LossLogWriter) -> None:
        """Steps run one at a time, in order, in the worker thread. While step t+1
        computes, the loop logs, exports and commits step t (at most two in flight)."""
        in_flight: deque = deque()
        submitted = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-step") as worker:
            while state["stop"] is None:
                if time.monotonic() - state["checkpointed"] >= config.checkpoint_every_s:
                    while in_flight:  # the saved state and offsets must be those after one same step
                        await finish(log, *in_flight.popleft())
                    await loop.run_in_executor(worker, checkpoint)
                    continue
                if in_flight and (len(in_flight) == 2 or queue.empty() or (limit and submitted >= limit)):
                    await finish(log, *in_flight.popleft())
                    continue
                if limit and submitted >= limit:
                    break
                try:
                    ready = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    _check_idle_and_time()
                    continue
                monitor.set_queue_depth(queue.qsize())
                trigger = _probe_trigger(ready.truth, submitted)
                if trigger:  # the model as it is after batch submitted-1, before learning this one
                    while in_flight:
                        await finish(log, *in_flight.popleft())
                    await probe(worker, trigger, submitted)
                state["truth"] = ready.truth or state["truth"]
                future = loop.run_in_executor(
                    worker, prequential_step, strategy, ready.batch, ready.truth, submitted)
                in_flight.append((future, ready))
                submitted += 1
            while in_flight:  # a stop condition never abandons a step already taken
                await finish(log, *in_flight.popleft())

    def _probe_trigger(truth, index: int) -> str | None:
        if probe_set is None:
            return None
        if index == 0:  # the untrained model: the reference for forward and zero-shot transfer
            return "start"
        previous = state["truth"]
        if config.probe_at_switches and truth and previous and truth.fragment != previous.fragment:
            return "switch"
        if config.probe_every and index % config.probe_every == 0:
            return "periodic"
        return None

    async def probe(worker, trigger: str, index: int) -> None:
        scores, seconds = await loop.run_in_executor(worker, probe_set.score, strategy.model)
        previous = state["truth"]
        row = {"batch": index, "trigger": trigger,
               "ended_class": previous.class_name if trigger in ("switch", "end") and previous else None,
               "scores": scores, "seconds": round(seconds, 4), "time": round(time.time(), 3)}
        if built.kind == "classifier":
            row["unit"] = "accuracy"
        with (config.run_dir / "probes.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        state["probes"] += 1
        state["probe_seconds"] += seconds
        monitor.probed(row)

    def checkpoint() -> None:
        labels = batcher.vocabulary.names() if built.kind == "classifier" else None  # the label of each head row
        _save_checkpoint(config, strategy, state["commit"], state["batches"], labels)
        state["checkpointed"] = time.monotonic()
        monitor.checkpointed(time.time())

    async def finish(log: LossLogWriter, future, ready) -> None:
        result = await future
        log.write(monitor.observe(result))
        await source.commit(ready.commit)
        state["commit"] = ready.commit
        state["batches"] += 1
        state["labels_known"] = ready.batch.labels_known
        state["tokens"] += result.tokens
        if on_step:
            on_step()
        if limit and state["batches"] >= limit:
            state["stop"] = "max_batches" if config.max_batches else "end_of_stream"
        _check_idle_and_time()

    def _check_idle_and_time() -> None:
        now = time.monotonic()
        if config.minutes and now - started >= config.minutes * 60:
            state["stop"] = state["stop"] or "time_limit"
        if config.idle_timeout_s and queue.empty() and now - state["last_record"] >= config.idle_timeout_s:
            state["stop"] = state["stop"] or "idle"
        if (config.total_records and state["records"] >= config.total_records and queue.empty()
                and not batcher.ready()):  # every record read and batched: what remains is less than a batch
            state["stop"] = state["stop"] or "end_of_stream"

    await source.start()
    tasks = []
    try:
        with LossLogWriter(config.run_dir / "losses.jsonl") as log:
            tasks = [asyncio.create_task(fetch_loop()), asyncio.create_task(step_loop(log))]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise a failure of either side
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await source.stop()
    if built.kind == "classifier" and probe_set is not None and state["batches"]:
        await probe(None, "end", state["batches"])  # the model after the whole stream: the last task's stage
    checkpoint()
    return RunSummary(state["batches"], state["tokens"], time.monotonic() - started,
                      state["stop"] or "stopped", monitor.dead_letters, config.run_dir,
                      state["probes"], state["probe_seconds"])


def _rejected(batcher, record, streams: int) -> tuple[str, str] | None:
    """(reason, detail) when a record cannot reach the model; classifiers also reject unlabelled records."""
    if not batcher.accepts(record.stream):
        return "extra_stream", f"more than {streams} stream ids"
    rejects = getattr(batcher, "rejects", None)
    return rejects(record) if rejects else None


def _save_checkpoint(config: LearnConfig, strategy, commit: dict, batches: int, labels=None) -> None:
    """A plain dict: model, optimizer and strategy state, config, next offset per partition
    (classifiers: and the label names in head-row order).

    Written to a temporary file and renamed, so a crash never leaves half a checkpoint."""
    partial = config.run_dir / "checkpoint.pt.partial"
    torch.save({
        "strategy": strategy.state_dict(), "config": asdict(config), "batches": batches,
        "offsets": {f"{topic}:{partition}": offset for (topic, partition), offset in commit.items()},
        **({"labels": list(labels)} if labels is not None else {}),
    }, partial)
    partial.replace(config.run_dir / "checkpoint.pt")
