"""The metric catalogue on a fresh registry, fed by the live monitor from step results."""

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest

from monitor.exporter import CATALOGUE, LOSS_BUCKETS, UNITS, create_metrics
from monitor.live import LiveMonitor
from monitor.losslog import LossLogWriter
from monitor.report import build_report

LABELS = {"run", "strategy", "class", "partition", "reason", "phase", "kind", "slot"}  # slot: at most SWITCH_SLOTS values
README = Path(__file__).resolve().parents[1] / "README.md"


def _result(index, loss, class_name, fragment, tokens=200):
    return SimpleNamespace(index=index, loss=loss, train_loss=loss, tokens=tokens,
                           truth=SimpleNamespace(class_name=class_name, fragment=fragment),
                           predict_s=0.001, learn_s=0.002, finished_at=1000.0 + index)


def _values(metrics):
    """{(sample name, frozenset of labels other than run and strategy): value} of run r."""
    text = generate_latest(metrics.registry).decode()
    found = {}
    for line in text.splitlines():
        match = re.match(r'(\w+)\{([^}]*)\} (\S+)$', line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            if labels.pop("run", None) == "r" and labels.pop("strategy", None) == "naive":
                found[(match.group(1), frozenset(labels.items()))] = float(match.group(3))
    return found


def test_catalogue_uses_only_the_fixed_labels_and_fresh_registries_are_isolated():
    for _, _, labels, help_text in CATALOGUE:
        assert labels[:2] == ("run", "strategy") and set(labels) <= LABELS and len(labels) <= 4 and help_text
    a, b = create_metrics(), create_metrics()
    a.batches_learned_total.labels("r", "naive").inc()
    assert 'streamer_batches_learned_total{run="r"' in generate_latest(a.registry).decode()
    assert 'streamer_batches_learned_total{run="r"' not in generate_latest(b.registry).decode()


def test_switch_metrics_follow_the_calm_definitions():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a", "b"), k=2, metrics=metrics)
    # fragment 0 (a): 3, 1 -> mean 2 ; fragment 1 (b): 5, 4 ; fragment 2 (a, a revisit): 4, 2, 1 ; fragment 3 (b)
    stream = [(3, "a", 0), (1, "a", 0), (5, "b", 1), (4, "b", 1), (4, "a", 2), (2, "a", 2), (1, "a", 2), (6, "b", 3)]
    for i, (loss, cls, frag) in enumerate(stream):
        monitor.observe(_result(i, float(loss), cls, frag))
    text = generate_latest(metrics.registry).decode()

    def value(name, **labels):
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"run": "r", "strategy": "naive", **labels}.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{{wanted}}}"):
                return float(line.split()[-1])
        raise AssertionError(f"{name} {labels} not exported")

    # the revisit of a: first k=2 losses 4, 2 -> 3 nats; previous mean of a is 2: 4 >= 2, 2 >= 2, 1 < 2 -> rec 2
    assert value("streamer_loss_after_switch_last", **{"class": "a"}) == 3.0
    assert value("streamer_recovery_batches_last", **{"class": "a"}) == 2.0
    assert value("streamer_loss_after_switch_mean", **{"class": "a"}) == math.log(math.exp(3.0))
    assert value("streamer_recovery_batches_mean", **{"class": "all"}) == 2.0
    assert value("streamer_switches_total") == 3.0
    assert value("streamer_batches_learned_total") == 8.0
    assert value("streamer_tokens_total") == 1600.0
    assert value("streamer_batch_loss", **{"class": "b"}) == 6.0
    # rolling perplexity over the last 100 batches = exp(mean of all 8 losses) = exp(26 / 8)
    assert math.isclose(value("streamer_rolling_perplexity"), math.exp(26 / 8))


def test_class_means_and_after_switch_means_cover_the_reports_span(tmp_path):
    """ppl per class (streamer_class_loss_mean) was the class's mean over the whole stream while ppl@sw
    (streamer_loss_after_switch_mean) covers CALM's span, fragments >= from_fragment: the dashboard's bars
    and streamer:switch_spike_ratio compared two spans. Both are now the report's, per class and for all."""
    metrics = create_metrics()
    k, start = 2, 5
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a", "b"), k=k, from_fragment=start, metrics=metrics)
    run_dir = tmp_path / "run"
    with LossLogWriter(run_dir / "losses.jsonl") as log:
        index = 0
        for fragment in range(10):  # a b a b a | b a b a b: high losses before the span, lower in it
            for position in range(4):
                loss = (6.0 if fragment < start else 2.0) + (0.5 if fragment % 2 else 0.0) + 0.3 / (1 + position)
                log.write(monitor.observe(_result(index, loss, "ab"[fragment % 2], fragment)))
                index += 1
    (run_dir / "config.json").write_text(json.dumps({"k": k, "from_fragment": start}))
    report = build_report(run_dir)["metrics"]
    got = _values(metrics)

    def gauge(name, cls):
        return got[(f"streamer_{name}", frozenset({("class", cls)}))]

    for cls, entry in (("a", report["per_class"]["a"]), ("b", report["per_class"]["b"]), ("all", report)):
        assert entry["n_revisits"] and entry["ppl"] < 20, (cls, entry)
        assert math.isclose(math.exp(gauge("class_loss_mean", cls)), entry["ppl"]), cls
        assert math.isclose(math.exp(gauge("loss_after_switch_mean", cls)), entry["ppl@sw"]), cls


def test_loss_log_line_is_calm_format():
    monitor = LiveMonitor(run="r", strategy="naive", classes=("x", "y"))
    line = monitor.observe(_result(0, 2.5, "y", 4))
    assert {k: line[k] for k in ("loss", "domain", "domain_name", "sequence")} == \
        {"loss": 2.5, "domain": 1, "domain_name": "y", "sequence": 4}
    assert line["batch"] == 0 and line["tokens"] == 200


def test_detected_switches_lag_dead_letters_class_means_and_checkpoint_age_are_exported():
    import random
    import time

    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a", "b"), metrics=metrics)
    rng = random.Random(0)
    # 60 batches around 2 nats, then a jump to 5 nats: Page-Hinkley (mode up) must fire soon after 60
    losses = [2 + rng.uniform(-0.1, 0.1) for _ in range(60)] + [5 + rng.uniform(-0.1, 0.1) for _ in range(20)]
    detected = [i for i, loss in enumerate(losses)
                if monitor.observe(_result(i, loss, "a" if i < 60 else "b", 0 if i < 60 else 1))["detected_switch"]]
    assert detected and 60 <= detected[0] <= 62 and all(i >= 60 for i in detected)
    monitor.set_lag({0: 5, 1: 7})
    monitor.dead_letter("bad_utf8")
    monitor.dead_letter("bad_utf8")
    monitor.dead_letter("extra_stream")
    monitor.checkpointed(time.time() - 30)
    text = generate_latest(metrics.registry).decode()
    assert f'streamer_switches_detected_total{{run="r",strategy="naive"}} {float(len(detected))}' in text
    assert 'streamer_consumer_lag_records{partition="1",run="r",strategy="naive"} 7.0' in text
    assert 'streamer_dead_letter_total{reason="bad_utf8",run="r",strategy="naive"} 2.0' in text
    assert 'streamer_dead_letter_total{reason="extra_stream",run="r",strategy="naive"} 1.0' in text
    class_b = sum(losses[60:]) / 20
    line = next(x for x in text.splitlines() if x.startswith('streamer_class_loss_mean{class="b"'))
    assert math.isclose(float(line.split()[-1]), class_b)
    age = next(x for x in text.splitlines() if x.startswith("streamer_checkpoint_age_seconds{"))
    assert 29 <= float(age.split()[-1]) < 60
    assert monitor.snapshot().lag == 12


def test_records_read_again_follow_the_loops_total_and_continue_after_a_resume():
    """The loop's total of records read again (a reading, a few times a second) is the counter's value:
    at 0 before any, never lowered, and a resumed monitor (its state and the loop's from one checkpoint,
    the loop's total being ahead of what was published) goes on from it."""
    from monitor.console import LoopReading

    def read_again(metrics):
        return _values(metrics)[("streamer_records_read_again_total", frozenset())]

    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", metrics=metrics)
    assert read_again(metrics) == 0.0  # exported from the start: increase() sees the first rereading
    for total in (0, 40, 40, 95):
        monitor.read(LoopReading(records=100, lag={0: 3}, read_again=total))
    assert read_again(metrics) == 95.0 and monitor.console_snapshot().read_again == 95
    monitor.read(LoopReading(records=100, lag={0: 3}, read_again=50))  # (lower, as no loop says: it keeps 95)
    assert read_again(metrics) == 95.0
    state = monitor.state_dict()
    resumed_metrics = create_metrics()
    resumed = LiveMonitor(run="r", strategy="naive", metrics=resumed_metrics)
    resumed.load_state_dict(state)
    assert read_again(resumed_metrics) == 95.0
    resumed.read(LoopReading(records=100, lag={0: 3}, read_again=120))  # the checkpoint's loop total: read since
    assert read_again(resumed_metrics) == 120.0


def test_loss_counters_histogram_and_last_switch_gauges_count_every_batch():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a", "b"), k=2, metrics=metrics)
    # phases with k=2 (after_switch: the first k batches of a revisit, as CALM's ppl@sw):
    # a steady, steady | b (first visit) steady, steady | a (revisit) after, after, steady | b (revisit) after
    stream = [(3, "a", 0), (1, "a", 0), (5, "b", 1), (4, "b", 1), (4, "a", 2), (2, "a", 2), (1, "a", 2), (6, "b", 3)]
    for i, (loss, cls, frag) in enumerate(stream):
        monitor.observe(_result(i, float(loss), cls, frag))
    got = _values(metrics)

    def value(name, **labels):
        return got[(name, frozenset(labels.items()))]

    # summed loss = mean loss x 200 tokens per batch
    assert value("streamer_loss_nats_total", **{"class": "a", "phase": "steady"}) == (3 + 1 + 1) * 200
    assert value("streamer_loss_nats_total", **{"class": "a", "phase": "after_switch"}) == (4 + 2) * 200
    assert value("streamer_loss_nats_total", **{"class": "b", "phase": "steady"}) == (5 + 4) * 200
    assert value("streamer_loss_nats_total", **{"class": "b", "phase": "after_switch"}) == 6 * 200
    assert value("streamer_scored_tokens_total", **{"class": "a", "phase": "steady"}) == 600
    assert value("streamer_scored_tokens_total", **{"class": "b", "phase": "after_switch"}) == 200
    # both phases exist from a class's first batch (so increase() sees a revisit's first batches)
    assert value("streamer_loss_nats_total", **{"class": "a", "phase": "after_switch"}) == 1200
    monitor.observe(_result(8, 2.0, "c", 4))
    assert _values(metrics)[("streamer_loss_nats_total", frozenset({("class", "other"), ("phase", "after_switch")}))] == 0
    # the perplexity of the whole run from the counters: exp(5200 / 1600) = exp(26 / 8), the rolling one here
    loss = sum(v for (n, _), v in got.items() if n == "streamer_loss_nats_total")
    tokens = sum(v for (n, _), v in got.items() if n == "streamer_scored_tokens_total")
    assert math.isclose(math.exp(loss / tokens), value("streamer_rolling_perplexity"))
    # the histogram: a saw 3, 1, 4, 2, 1; b saw 5, 4, 6
    assert value("streamer_batch_loss_nats_count", **{"class": "a"}) == 5
    assert value("streamer_batch_loss_nats_sum", **{"class": "b"}) == 15
    one = next(b for b in LOSS_BUCKETS if b >= 1.0)  # 1.006: the bucket of a's two losses of 1
    assert value("streamer_batch_loss_nats_bucket", **{"class": "a", "le": str(one)}) == 2
    assert value("streamer_batch_loss_nats_bucket", **{"class": "b", "le": "+Inf"}) == 3
    # every true switch keeps its time in a slot of its own (batches 2, 4 and 7, finished at 1002, 1004,
    # 1007), however close they are; the latest one's first batch so far: 6 nats
    assert [value("streamer_switch_timestamp_seconds", kind="true", slot=str(i)) for i in range(3)] == [1002.0, 1004.0, 1007.0]
    assert value("streamer_last_switch_spike_nats", kind="true") == 6.0
    # set at each revisit: the mean loss of the class's previous fragment (a: 3, 1; b: 5, 4), held
    assert value("streamer_previous_fragment_loss_nats", **{"class": "a"}) == 2.0
    assert value("streamer_previous_fragment_loss_nats", **{"class": "b"}) == 4.5


def test_last_switch_spike_holds_the_worst_of_the_first_k_batches_until_the_next_switch():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a", "b"), k=3, metrics=metrics, detector="none")
    for i, (loss, cls, frag) in enumerate([(2, "a", 0), (3, "b", 1), (5, "b", 1), (4, "b", 1), (9, "b", 1), (1, "b", 1)]):
        monitor.observe(_result(i, float(loss), cls, frag))
    got = _values(metrics)
    # b's first k=3 batches: 3, 5, 4 -> 5; the 9 of the fourth batch is mid-fragment
    assert got[("streamer_last_switch_spike_nats", frozenset({("kind", "true")}))] == 5.0
    assert got[("streamer_switch_timestamp_seconds", frozenset({("kind", "true"), ("slot", "0")}))] == 1001.0
    assert not [key for key in got if key[0] == "streamer_switch_timestamp_seconds" and ("kind", "detected") in key[1]]


def test_class_labels_are_the_manifests_classes_or_other():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a",), metrics=metrics, detector="none")
    monitor.observe(_result(0, 2.0, "a", 0))
    monitor.observe(_result(1, 3.0, "zz", 1))
    got = _values(metrics)
    assert got[("streamer_batch_loss", frozenset({("class", "other")}))] == 3.0
    assert got[("streamer_batch_loss_nats_count", frozenset({("class", "other")}))] == 1
    assert not any(("class", "zz") in labels for _, labels in got)
    # without a manifest: the first 64 classes keep their names, the 65th is "other"
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", metrics=metrics, detector="none")
    for i in range(65):
        monitor.observe(_result(i, 1.0, f"c{i}", i))
    classes = {dict(labels).get("class") for name, labels in _values(metrics) if name == "streamer_batch_loss"}
    assert classes == {f"c{i}" for i in range(64)} | {"other"}


def test_non_finite_losses_reach_only_the_batch_loss_gauge():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", classes=("a",), metrics=metrics, detector="none")
    monitor.observe(_result(0, 2.0, "a", 0))
    monitor.observe(_result(1, math.nan, "a", 0))
    got = _values(metrics)
    assert math.isnan(got[("streamer_batch_loss", frozenset({("class", "a")}))])
    assert got[("streamer_loss_nats_total", frozenset({("class", "a"), ("phase", "steady")}))] == 400.0
    assert got[("streamer_batch_loss_nats_count", frozenset({("class", "a")}))] == 1


def test_readme_metric_table_lists_every_exported_metric_with_its_type_labels_and_unit():
    section = README.read_text(encoding="utf-8").split("### Prometheus metrics")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(streamer_\w+)` \| (\w+) \| ([\w, ]+) \| ([^|]+) \| (.+) \|$", section, flags=re.MULTILINE)
    table = {name: (kind, tuple(label.strip() for label in labels.split(",")), unit.strip())
             for name, kind, labels, unit, _ in rows}
    assert set(UNITS) == {name for name, *_ in CATALOGUE}, "every catalogued metric has one unit in UNITS"
    registry = {f"streamer_{name}": (kind, labels, UNITS[name]) for name, kind, labels, _ in CATALOGUE}
    assert table == registry
    assert all(meaning.strip() for *_, meaning in rows)
    exported = {metric.name for metric in create_metrics().registry.collect()}
    assert exported == {name.removesuffix("_total") for name in registry}


def test_a_stopping_exporter_waits_for_its_final_scrape(monkeypatch):
    """A run that ends: shutdown() waits (up to 1.2 x the scrape interval seen) until Prometheus
    has read the final values, so the batches since the previous scrape are not lost."""
    import threading
    import time
    import urllib.request

    from monitor import exporter
    from monitor.exporter import serve

    metrics = create_metrics()
    server, _ = serve(metrics, 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    now = time.monotonic()
    server.scrapes.extend([now - 200, now - 100])  # as if scraped every 100 s: waits up to 15 s (the app's own deque)
    metrics.batches_learned_total.labels("r", "naive").inc(7)  # the final batches, not scraped yet
    waiting, sleep = threading.Event(), time.sleep  # set once shutdown() has taken its start and waits

    def sleep_in_shutdown(seconds: float) -> None:  # (time.sleep is the module's: only shutdown's thread counts)
        if threading.current_thread() is stopping:
            waiting.set()
        sleep(seconds)

    monkeypatch.setattr(exporter.time, "sleep", sleep_in_shutdown)
    stopping = threading.Thread(target=server.shutdown)
    stopping.start()
    assert waiting.wait(timeout=10)  # (a scrape before shutdown's start would not end its wait)
    with urllib.request.urlopen(url, timeout=10) as response:  # the final scrape, after shutdown was asked
        final = response.read().decode()
    stopping.join(timeout=10)
    assert not stopping.is_alive()  # it stopped waiting at the scrape, not at its 15 s bound
    assert 'streamer_batches_learned_total{run="r",strategy="naive"} 7.0' in final
    unscraped, _ = serve(create_metrics(), 0)  # never scraped twice: no interval known, no wait
    unscraped.shutdown()

    # `streamer status` reads /metrics too: two of its reads made a stopping learner wait for a third
    from streamer.cli.status import _scrape

    watched, _ = serve(create_metrics(), 0)
    for _ in range(2):
        assert "error" not in _scrape(f"http://127.0.0.1:{watched.server_address[1]}/metrics", 5, {})
    assert not watched.scrapes
    started = time.monotonic()
    watched.shutdown()
    assert time.monotonic() - started < 1


def test_without_a_detector_no_detection_gauge_is_set():
    """--detector none: precision, recall and 'batches since detected' were set as for a detector that
    found nothing (recall 0, a count from the start); they stay unset, and a detector's are set."""
    for detector, present in (("none", False), ("page-hinkley", True)):
        metrics = create_metrics()
        monitor = LiveMonitor(run="r", strategy="naive", classes=("a", "b"), k=3, metrics=metrics, detector=detector)
        for i, (loss, cls, frag) in enumerate([(2, "a", 0), (3, "b", 1), (5, "a", 2), (4, "b", 3)]):
            monitor.observe(_result(i, float(loss), cls, frag))
        names = {name for name, _ in _values(metrics)}
        for gauge in ("streamer_detection_recall", "streamer_batches_since_detected_switch"):
            assert (gauge in names) is present, (detector, gauge)
