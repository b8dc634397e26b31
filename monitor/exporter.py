"""Every Prometheus metric of streamer, declared in one place.

Labels stay few and fixed: run, strategy, and class, partition or reason where a
metric needs one. Never a label per record.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from monitor.web_security import MetricsSecurity, read_credentials, require_basic_auth, server_context

__all__ = ["Metrics", "create_metrics", "serve", "CATALOGUE", "UNITS", "NAMESPACE", "LOSS_BUCKETS", "SWITCH_SLOTS",
           "STATUS_AGENT"]

NAMESPACE = "streamer"
RUN = ("run", "strategy")
RUN_CLASS = ("run", "strategy", "class")
RUN_PARTITION = ("run", "strategy", "partition")
RUN_REASON = ("run", "strategy", "reason")  # a fixed, small set of reasons (see producers/wire.py)
# phase: "after_switch" (the first k batches of a revisit, as CALM's ppl@sw) or "steady"
RUN_CLASS_PHASE = ("run", "strategy", "class", "phase")
RUN_KIND = ("run", "strategy", "kind")  # kind: "true" (from the truth headers) or "detected" (the drift detector)
RUN_KIND_SLOT = ("run", "strategy", "kind", "slot")  # slot: "0" to SWITCH_SLOTS - 1, the switch's number modulo it
SWITCH_SLOTS = 8  # switch times kept: every switch keeps its marker unless more than this many fall between two scrapes
# class values come from monitor.tracker.RunTracker.class_label: the manifest's classes, else "other"
# batch loss in nats: 0.1 to 10 in steps of about 8%, so a 10% rise always crosses a bucket boundary
LOSS_BUCKETS = tuple(round(0.1 * 1.08 ** i, 3) for i in range(61))
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# name, type, labels, help: the README's table is generated from this list.
CATALOGUE = [
    # what happens between scrapes: counters and a histogram, exact over any window
    ("loss_nats_total", "counter", RUN_CLASS_PHASE, "Summed recorded loss, nats (batch mean loss x tokens); exp(increase of it / increase of scored_tokens_total) is the perplexity of any window"),
    ("scored_tokens_total", "counter", RUN_CLASS_PHASE, "Tokens whose recorded loss loss_nats_total sums"),
    ("batch_loss_nats", "histogram", RUN_CLASS, "Recorded (pre-update) loss of each batch, nats"),
    ("switch_timestamp_seconds", "gauge", RUN_KIND_SLOT, f"Unix time of each of the latest {SWITCH_SLOTS} switches, one slot each (the switch's number modulo {SWITCH_SLOTS}), held until that slot's next switch: switches closer than a scrape keep their own markers"),
    ("last_switch_spike_nats", "gauge", RUN_KIND, "Worst batch loss of the first k batches after the latest switch, nats, held until the next one"),
    ("previous_fragment_loss_nats", "gauge", RUN_CLASS, "Mean loss of the class's previous fragment, nats, set when the class is revisited: what its spike is measured against (CALM's rec reference)"),
    ("batch_loss", "gauge", RUN_CLASS, "Recorded (pre-update) loss of the latest batch, nats"),
    ("rolling_perplexity", "gauge", RUN, "exp of the mean recorded loss over the last 100 batches"),
    ("loss_after_switch_last", "gauge", RUN_CLASS, "Mean loss of the first k batches after the latest revisit switch, nats"),
    ("loss_after_switch_mean", "gauge", RUN_CLASS,
     "Mean over the evaluated span's revisits of the loss of the first k batches after a switch, nats (log of ppl@sw)"),
    ("recovery_batches_last", "gauge", RUN_CLASS, "Batches until the loss fell below the previous fragment's mean, latest revisit"),
    ("recovery_batches_mean", "gauge", RUN_CLASS, "Mean recovery time over revisits, batches (rec)"),
    ("class_loss_mean", "gauge", RUN_CLASS, "Mean recorded loss of the class over the evaluated span (fragments >= "
     "--from-fragment, as ppl@sw and the report), nats (log of ppl); class all: every class"),
    ("switches_total", "counter", RUN, "Class switches seen in the stream (ground truth, evaluation only)"),
    ("switches_detected_total", "counter", RUN, "Switches found by the drift detector on the loss, without labels"),
    ("run_switches", "gauge", RUN_KIND, "Switches of the whole run, true (ground truth) or detected: the run's totals, "
     "which a restart takes from the checkpoint (the counters start again at 0 after a crash)"),
    ("batches_since_detected_switch", "gauge", RUN, "Batches since the drift detector last fired (its state)"),
    ("detection_precision", "gauge", RUN, "Share of drift-detector alarms within tolerance batches after a true switch (evaluation only)"),
    ("detection_recall", "gauge", RUN, "Share of true switches the drift detector found within tolerance batches (evaluation only)"),
    ("detection_delay_batches", "gauge", RUN, "Mean batches from a true switch to its matched detection (evaluation only)"),
    ("tokens_per_second", "gauge", RUN, "Tokens learned per second over the last few seconds"),
    ("tokens_total", "counter", RUN, "Tokens learned"),
    ("batches_learned_total", "counter", RUN, "Batches scored then learned"),
    ("consumer_lag_records", "gauge", RUN_PARTITION, "Records in the partition (up to its end as last fetched, or as the broker says while it is held) that the learner has not yet taken into its batcher (those read past while their stream holds --keep-windows windows count until read again)"),
    ("streams_waited_for", "gauge", RUN, "Streams the learning waits for now: no batch cut for 5 s, records read after that, and the next batch needs a window of these while another stream holds more than 256 windows (a stream that stopped sending, one far slower than the others, or one whose records lie further on in the topic); 0 from the next cut"),
    ("queue_depth", "gauge", RUN, "Batches cut whose results are not yet taken in: queued, or handed to the model worker (the step in flight included); 0 when the model can learn none now"),
    ("records_read_again_total", "counter", RUN, "Records the consumer read more than once, each read after the first: a stream that holds more than --keep-windows windows while the learning waits for another has its further records left in Kafka, read again once it has room; the reading that bound costs"),
    ("dead_letter_total", "counter", RUN_REASON, "Records sent to the dead-letter topic instead of the model, by reason"),
    ("run_dead_letters", "gauge", RUN_REASON, "Records dead-lettered over the whole run, by reason: the run's totals, "
     "which a restart takes from the checkpoint (the counters start again at 0 after a crash)"),
    ("skipped_updates_total", "counter", RUN, "Batches whose update was skipped: a NaN or infinite loss or gradient (parameters left as before)"),
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
    ("ready", "gauge", RUN, "1 while the learner consumes with the broker reachable, else 0 (what /readyz answers)"),
    ("openmp_short_spins", "gauge", RUN, "1 while OpenMP's spins are short because other work shares the learner's CPUs, else 0 (only where the spin is governed)"),
    ("predict_seconds", "histogram", RUN, "Time to score a batch"),
    ("learn_seconds", "histogram", RUN, "Time to learn from a batch"),
]

# the unit of each metric, as the README's table and the dashboard's axes name it
# ("ratio": 0 to 1; "0/1": a boolean state; "Unix s": seconds since the epoch)
UNITS = {
    "loss_nats_total": "nats", "scored_tokens_total": "tokens", "batch_loss_nats": "nats",
    "switch_timestamp_seconds": "Unix s", "last_switch_spike_nats": "nats",
    "previous_fragment_loss_nats": "nats", "batch_loss": "nats",
    "rolling_perplexity": "ppl", "loss_after_switch_last": "nats", "loss_after_switch_mean": "nats",
    "recovery_batches_last": "batches", "recovery_batches_mean": "batches", "class_loss_mean": "nats",
    "switches_total": "switches", "switches_detected_total": "switches", "run_switches": "switches",
    "batches_since_detected_switch": "batches",
    "detection_precision": "ratio", "detection_recall": "ratio", "detection_delay_batches": "batches",
    "tokens_per_second": "tokens/s", "tokens_total": "tokens", "batches_learned_total": "batches",
    "consumer_lag_records": "records", "streams_waited_for": "streams",
    "queue_depth": "batches", "records_read_again_total": "records", "dead_letter_total": "records",
    "run_dead_letters": "records",
    "skipped_updates_total": "batches", "checkpoint_age_seconds": "s", "gpu_memory_bytes": "bytes", "forgetting": "nats or ratio",
    "accuracy": "ratio", "accuracy_rolling": "ratio", "macro_f1": "ratio", "macro_f1_rolling": "ratio",
    "class_accuracy": "ratio", "class_macro_f1": "ratio", "ready": "0/1", "openmp_short_spins": "0/1",
    "predict_seconds": "s", "learn_seconds": "s",
}

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
        extra = {}
        if kind == "histogram":
            extra = {"buckets": LOSS_BUCKETS if name.endswith("_nats") else SECONDS_BUCKETS}
        # prometheus_client appends _total to counters itself
        metric_name = name[: -len("_total")] if kind == "counter" else name
        families[name] = _TYPES[kind](metric_name, help_text, labels, namespace=NAMESPACE, registry=registry, **extra)
    return Metrics(registry=registry, families=families)


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        """Scrapes and probes are not worth a line each."""


FINAL_SCRAPE_MAX_S = 15.0  # the longest a stopping exporter waits for its final scrape
STATUS_AGENT = "streamer-status"  # `streamer status` reads /metrics as this User-Agent: not a scrape to wait for


class FinalScrapeServer(ThreadingWSGIServer):
    """On shutdown, waits for one more scrape of /metrics (at most 1.2 x the interval between the
    last two scrapes, and FINAL_SCRAPE_MAX_S; not at all before two scrapes): a run that ends
    leaves Prometheus its final counters instead of the batches since the previous scrape."""

    scrapes: deque = deque()  # monotonic times of the latest /metrics requests (serve() sets its own)

    def shutdown(self, final_scrape: bool = True) -> None:
        """`final_scrape`: False when the run was stopped by a signal (it must exit within seconds)."""
        if final_scrape and len(self.scrapes) >= 2:
            asked = time.monotonic()
            wait = min(1.2 * (self.scrapes[-1] - self.scrapes[-2]), FINAL_SCRAPE_MAX_S)
            while self.scrapes[-1] < asked and time.monotonic() < asked + wait:
                time.sleep(0.05)
        super().shutdown()


class IPv6Server(FinalScrapeServer):
    address_family = socket.AF_INET6


def serve(metrics: Metrics, port: int, host: str = "127.0.0.1", ready: Callable[[], bool] = lambda: True,
          labels: tuple[str, ...] = (), security: MetricsSecurity | None = None):
    """Serve, in a daemon thread: /metrics; /healthz, 200 while the process answers; /readyz, 200
    when `ready()` is true (the learner: consuming, broker reachable), else 503. With `labels`
    (run, strategy), the streamer_ready gauge follows `ready()` at each scrape. `security`: HTTPS
    and/or basic auth on /metrics (monitor.web_security). Returns (server, thread)."""
    metrics_app = make_wsgi_app(metrics.registry)

    def is_ready() -> bool:
        try:
            answer = bool(ready())
        except Exception:  # a readiness check that fails means not ready
            answer = False
        if labels:
            metrics.ready.labels(*labels).set(1 if answer else 0)
        return answer

    def app(environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        if path in ("/healthz", "/readyz"):
            ok = path == "/healthz" or is_ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not ready\n"]
        is_ready()
        if not environ.get("HTTP_USER_AGENT", "").startswith(STATUS_AGENT):  # (two `status` calls made a
            scrapes.append(time.monotonic())  # stopping learner wait for a third that never came)
        return metrics_app(environ, start_response)

    security = security or MetricsSecurity()
    context = server_context(security) if security.tls else None  # ValueError before the port is taken
    if security.auth_file:
        app = require_basic_auth(app, *read_credentials(security.auth_file))
    scrapes: deque = deque(maxlen=2)
    server_class = IPv6Server if ":" in host else FinalScrapeServer
    server = make_server(host, port, app, server_class, handler_class=QuietHandler)
    server.scrapes = scrapes
    if context is not None:  # as prometheus_client.start_wsgi_server(certfile=, keyfile=) does
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
