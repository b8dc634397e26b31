"""Every Prometheus metric of streamer, declared in one place.

Labels stay few and fixed: run, strategy, and class, partition or reason where a
metric needs one. Never a label per record.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics", "create_metrics", "serve", "CATALOGUE", "NAMESPACE"]

NAMESPACE = "streamer"
RUN = ("run", "strategy")
RUN_CLASS = ("run", "strategy", "class")
RUN_PARTITION = ("run", "strategy", "partition")
RUN_REASON = ("run", "strategy", "reason")  # a fixed, small set of reasons (see producers/wire.py)

# name, type, labels, help: the README's table is generated from this list.
CATALOGUE = [
    ("batch_loss", "gauge", RUN_CLASS, "Recorded (pre-update) loss of the latest batch, nats"),
    ("rolling_perplexity", "gauge", RUN, "exp of the mean recorded loss over the last 100 batches"),
    ("loss_after_switch_last", "gauge", RUN_CLASS, "Mean loss of the first k batches after the latest revisit switch, nats"),
    ("loss_after_switch_mean", "gauge", RUN_CLASS, "Mean over revisits of the loss of the first k batches after a switch, nats (log of ppl@sw)"),
    ("recovery_batches_last", "gauge", RUN_CLASS, "Batches until the loss fell below the previous fragment's mean, latest revisit"),
    ("recovery_batches_mean", "gauge", RUN_CLASS, "Mean recovery time over revisits, batches (rec)"),
    ("class_loss_mean", "gauge", RUN_CLASS, "Mean recorded loss of the class so far, nats"),
    ("switches_total", "counter", RUN, "Class switches seen in the stream (ground truth, evaluation only)"),
    ("switches_detected_total", "counter", RUN, "Switches found by the drift detector on the loss, without labels"),
    ("batches_since_detected_switch", "gauge", RUN, "Batches since the drift detector last fired (its state)"),
    ("detection_precision", "gauge", RUN, "Share of drift-detector alarms within tolerance batches after a true switch (evaluation only)"),
    ("detection_recall", "gauge", RUN, "Share of true switches the drift detector found within tolerance batches (evaluation only)"),
    ("detection_delay_batches", "gauge", RUN, "Mean batches from a true switch to its matched detection (evaluation only)"),
    ("tokens_per_second", "gauge", RUN, "Tokens learned per second over the last few seconds"),
    ("tokens_total", "counter", RUN, "Tokens learned"),
    ("batches_learned_total", "counter", RUN, "Batches scored then learned"),
    ("consumer_lag_records", "gauge", RUN_PARTITION, "Records in the partition beyond the consumer position"),
    ("queue_depth", "gauge", RUN, "Batches waiting for the model worker"),
    ("dead_letter_total", "counter", RUN_REASON, "Records sent to the dead-letter topic instead of the model, by reason"),
    ("checkpoint_age_seconds", "gauge", RUN, "Seconds since the last checkpoint was written"),
    ("gpu_memory_bytes", "gauge", RUN, "GPU memory allocated by the model (only on a GPU)"),
    ("forgetting", "gauge", RUN_CLASS, "Forgetting per class from the probe matrix (only when probe sets exist)"),
    # classifiers only (hf-classifier): utterances predicted before learning, scored against the revealed label
    ("accuracy", "gauge", RUN, "Prequential accuracy of a classifier over all utterances so far"),
    ("accuracy_rolling", "gauge", RUN, "Prequential accuracy of a classifier over the last 1000 utterances"),
    ("macro_f1", "gauge", RUN, "Prequential macro-F1 over labels of a classifier, all utterances so far"),
    ("macro_f1_rolling", "gauge", RUN, "Prequential macro-F1 over labels of a classifier, last 1000 utterances"),
    ("class_accuracy", "gauge", RUN_CLASS, "Prequential accuracy of a classifier on the utterances of a class"),
    ("class_macro_f1", "gauge", RUN_CLASS, "Prequential macro-F1 of a classifier on the utterances of a class"),
    ("predict_seconds", "histogram", RUN, "Time to score a batch"),
    ("learn_seconds", "histogram", RUN, "Time to learn from a batch"),
]

_TYPES = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}


@dataclass(frozen=True)
class Metrics:
    registry: CollectorRegistry
    families: dict

    def __getattr__(self, name):
        try:
            return self.families[name]
        except KeyError:
            raise AttributeError(name) from None


def create_metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """Declare the catalogue on `registry` (a fresh one by default, so tests stay isolated)."""
    registry = registry if registry is not None else CollectorRegistry()
    families = {}
    for name, kind, labels, help_text in CATALOGUE:
        extra = {"buckets": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)} if kind == "histogram" else {}
        # prometheus_client appends _total to counters itself
        metric_name = name[: -len("_total")] if kind == "counter" else name
        families[name] = _TYPES[kind](metric_name, help_text, labels, namespace=NAMESPACE, registry=registry, **extra)
    return Metrics(registry=registry, families=families)


def serve(metrics: Metrics, port: int, host: str = "127.0.0.1"):
    """Start the /metrics endpoint in a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=host, registry=metrics.registry)
