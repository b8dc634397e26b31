"""Frozen configuration values of a learning run: built once by the command line, read below it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from monitor.web_security import MetricsSecurity
from producers.security import KafkaSecurity
from streamer.models.catalog import LSTMConfig, default_lr

__all__ = ["LearnConfig", "RunSummary", "span_start", "default_group"]


def default_group(topic: str, strategy: str) -> str:
    """The consumer group of `streamer learn` without --group: learners of different strategies on one
    topic never share offsets."""
    return f"streamer-{topic}-{strategy}"


@dataclass(frozen=True)
class LearnConfig:
    bootstrap_servers: str
    topic: str
    run_dir: Path
    group_id: str = "streamer-learner"  # `learn` derives its default from the topic and strategy (default_group)
    run_name: str = "run"
    strategy: str = "naive"
    strategy_options: tuple[tuple[str, object], ...] = ()  # the strategy's own hyperparameters
    streams: int = 10
    window: int = 20
    model: LSTMConfig = field(default_factory=LSTMConfig)  # sizes of the LSTM models
    model_name: str = "lstm-char"  # --model (streamer.models.MODELS)
    model_options: tuple[tuple[str, object], ...] = ()  # the model's own options (--model-opt)
    lr: float | None = None  # Adam's step; None: the model's own default (streamer.models.catalog)
    clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    queue_size: int = 64  # batches cut ahead of the worker (streamer.loop: two bursts of short steps)
    keep_windows: int = 1024  # the most windows a stream keeps while a batch waits for another (streamer.loop)
    max_batches: int | None = None  # stop after this many batches
    minutes: float | None = None  # stop after this much wall time
    idle_timeout_s: float | None = None  # stop when nothing arrives for this long
    total_batches: int | None = None  # known from the producer's manifest (b x w byte windows)
    total_records: int | None = None  # the manifest's record count: the end of the stream for any tokenizer
    classes: tuple[str, ...] = ()  # class ids follow this order when known
    n_fragments: int | None = None
    k: int = 10
    from_fragment: int = 0
    checkpoint_every_s: float = 60.0  # also written at every clean stop (end of stream, limit, signal)
    probe_every: int = 500  # score the probe split every this many batches (0: only at switches)
    probe_at_switches: bool = True  # and at every true switch (headers, evaluation only)
    probe: bool = True  # score the manifest's held-out probe split at all (--no-probe: False)
    detector: str = "page-hinkley"  # river drift detector on the recorded loss (monitor.drift)
    metrics_port: int | None = None  # serve Prometheus metrics on this port (0: a free one; None: none)
    metrics_host: str = "127.0.0.1"
    live_view: bool = True  # the rich live view on a terminal; False: plain log lines
    max_record_bytes: int = 1_000_000  # larger records are dead-lettered as too_large (producers.wire)
    broker_timeout_s: float = 60.0  # how long the broker may be unreachable (at start, or lost mid-run)
    kafka_security: KafkaSecurity = KafkaSecurity()  # protocol, SASL user, TLS files; never the password
    metrics_security: MetricsSecurity = MetricsSecurity()  # the exporter's TLS and basic-auth files

    @property
    def resolved_lr(self) -> float:
        """The learning rate the strategy gets: --lr, else the model's default."""
        return self.lr if self.lr is not None else default_lr(self.model_name)

    def with_manifest(self, manifest: dict | None) -> "LearnConfig":
        """This config with what the producer's manifest knows of the stream (its length, classes, N); a
        looped stream's ("loop": true, `produce --loop`) has no end, its totals and N being one lap's (its
        fragments go on numbering past N: a span or a report bounded by one lap's N refused them)."""
        manifest = manifest or {}
        ends = not manifest.get("loop")
        return dataclasses.replace(
            self, total_batches=manifest.get("total_batches") if ends else None,
            total_records=manifest.get("total_records") if ends else None,
            classes=tuple(manifest.get("classes", ())), n_fragments=manifest.get("n_fragments") if ends else None)


def span_start(span: str | int, n_fragments: int | None) -> int:
    """The first fragment of a span: 'all' is 0, 'half' the paper's N/2 (needs N), an int itself; an int
    past the last of N fragments is a ValueError (its span would score nothing)."""
    if span == "all":
        return 0
    if span == "half":
        if not n_fragments:
            raise ValueError("the span 'half' needs the number of fragments N (a manifest)")
        return n_fragments // 2
    start = int(span)
    if n_fragments and start >= n_fragments:
        raise ValueError(f"--from-fragment {start} is past the stream's last fragment: its manifest has "
                         f"{n_fragments} (0 to {n_fragments - 1}); give one of those, 'half' or 'all'")
    return start


@dataclass(frozen=True)
class RunSummary:
    batches: int
    tokens: int
    seconds: float
    stop_reason: str
    dead_letters: dict
    run_dir: Path
    probes: int = 0
    probe_seconds: float = 0.0
    compute_seconds: float | None = None  # consuming and checkpointing; None: not measured (offline runs)
    joining_seconds: float = 0.0  # waiting for the consumer group's JoinGroup
    idle_seconds: float = 0.0  # caught up, waiting for records
    broker_lost_seconds: float = 0.0
    topic_missing_seconds: float = 0.0  # waiting for the topic to be created
    batches_before: int = 0  # learned before this start (a resumed run's checkpoint); batches, tokens: since
    skipped: int = 0  # batches of this start whose update was skipped (non-finite loss or gradients)
    stop_line: str = ""  # the source's line of a stop it caused (log_changed, codec_missing)
    topic_gone: bool = False  # broker_lost as the topic was deleted, not as the broker stopped answering
