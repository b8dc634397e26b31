"""The metric catalogue on a fresh registry, fed by the live monitor from step results."""

import math
from types import SimpleNamespace

from prometheus_client import generate_latest

from monitor.exporter import CATALOGUE, create_metrics
from monitor.live import LiveMonitor

LABELS = {"run", "strategy", "class", "partition", "reason"}


def _result(index, loss, class_name, fragment, tokens=200):
    return SimpleNamespace(index=index, loss=loss, train_loss=loss, tokens=tokens,
                           truth=SimpleNamespace(class_name=class_name, fragment=fragment),
                           predict_s=0.001, learn_s=0.002, finished_at=0.0)


def test_catalogue_uses_only_the_fixed_labels_and_fresh_registries_are_isolated():
    for _, _, labels, help_text in CATALOGUE:
        assert labels[:2] == ("run", "strategy") and set(labels) <= LABELS and len(labels) <= 3 and help_text
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
