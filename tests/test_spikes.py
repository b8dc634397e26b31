"""Switch spikes as a Prometheus user sees them (issue 14), with time scaled down: a paced run
scraped by a real Prometheus every second, its dashboard queries evaluated through the HTTP API
(tests/spike_check.py: the same definitions benchmarks/spikes.py measures at 5 s and 15 s).

Asserted are properties that hold at any speed of the machine: pacing stretches every batch to
at least PACE_S, so a slower machine only lengthens fragments (in scrape intervals), and each
figure is taken over what the run's own clock shows (fragments of at least three scrapes, gauge
values held for at least two). The fast test (default suite, ~35 s on a quiet machine, 90 s at
load 20): a seed whose fragments all last 24 batches or more, so its three revisits qualify; the
slow one: a longer stream with fragments of 1 to 15 s, fewer of which do.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from monitor.dashboard import annotation_queries
from monitor.exporter import create_metrics, serve
from monitor.live import LiveMonitor
from producers.kafka import produce
from streamer.config import LearnConfig
from streamer.learner import run as run_learner
from streamer.step import prequential_step
from tests.helpers import TINY, small_stream
from tests.prometheus_util import start_prometheus, stop
from tests.spike_check import (
    counters_perplexity, first_timeseries_panel, marker_times, markers_cover, panel_series, read_loss_log,
    report_perplexity, spike_figures, switches)

ROOT = Path(__file__).resolve().parents[1]
SCRAPE_S = 1.0
PACE_S = 0.15  # each batch takes at least this long: fragments of 20 batches last 3 scrapes or more
LR = 1e-2  # the tiny model learns each class within a fragment and forgets it in the next: every revisit spikes
# three classes a tiny model forgets quickly: different alphabets, so every revisit spikes
CORPUS = {"en": "hello world, how are you today? " * 600, "digits": "31415 92653 58979 32384 62643 " * 600,
          "ru": "привет мир, как дела сегодня? " * 600}


def paced_step(*args, **kwargs):
    """The loop's prequential step stretched to PACE_S or more, as a slower device would: in the
    worker thread, so each result reaches the monitor as soon as its step ends (pacing the monitor
    instead would let the next step run ahead and end up to PACE_S before its metrics are written)."""
    time.sleep(PACE_S)
    return prequential_step(*args, **kwargs)


def scraped_run(broker, tmp_path: Path, topic: str, settled: bool = False, **stream) -> dict:
    """Produce a small stream, learn it paced with a metrics endpoint scraped every SCRAPE_S by a
    real Prometheus; evaluate the dashboard's queries and the loss log."""
    records, manifest = small_stream(CORPUS, streams=3, window=10, **stream)
    asyncio.run(produce(records, broker.bootstrap_servers, topic))
    metrics = create_metrics()
    server, _ = serve(metrics, 0)
    (tmp_path / "rules.yml").write_text((ROOT / "deploy/prometheus/rules.yml").read_text())
    config = f"""
global: {{scrape_interval: {SCRAPE_S:g}s, evaluation_interval: {SCRAPE_S:g}s}}
rule_files: [{tmp_path / 'rules.yml'}]
scrape_configs:
  - job_name: streamer
    static_configs: [{{targets: ["127.0.0.1:{server.server_address[1]}"]}}]
"""
    process, base = start_prometheus(config, tmp_path)
    try:
        learn_config = LearnConfig(
            bootstrap_servers=broker.bootstrap_servers, topic=topic, group_id=f"{topic}-g",
            run_dir=tmp_path / "run", run_name=topic, streams=3, window=10, model=TINY, device="cpu", lr=LR,
            total_batches=manifest["total_batches"], classes=tuple(manifest["classes"]), idle_timeout_s=30)
        monitor = LiveMonitor(run=topic, strategy="naive", classes=learn_config.classes, metrics=metrics)
        started = time.time()
        thread = threading.Thread(target=lambda: asyncio.run(run_learner(learn_config, monitor=monitor)))
        with mock.patch("streamer.step_worker.prequential_step", paced_step):  # the real step, slowed
            thread.start()
            thread.join(timeout=600)
        assert not thread.is_alive()
        time.sleep(3 * SCRAPE_S)  # the last batches scraped (the endpoint outlives the learner here)
        ended = time.time()
        lines = read_loss_log(tmp_path / "run" / "losses.jsonl")
        switch_list = switches(lines)
        series = panel_series(base, first_timeseries_panel(), started, ended, SCRAPE_S)
        queries = annotation_queries()
        return {
            "lines": lines, "switches": switch_list,
            "figures": spike_figures(series, switch_list, started, ended, SCRAPE_S, settled=settled),
            "detected_marks": marker_times(base, queries["Detected switches"], started, ended, SCRAPE_S),
            "true_marks": marker_times(base, queries["True switches"], started, ended, SCRAPE_S),
            "ppl_counters": counters_perplexity(base, topic), "ppl_report": report_perplexity(tmp_path / "run"),
        }
    finally:
        stop(process)
        server.shutdown()


def held(times: list[float], last: float, scrapes: float = 2) -> list[float]:
    """The events whose value a gauge holds for `scrapes` scrape intervals or more (until the next
    event, or the end of the run at `last`): each is scraped at least once."""
    ends = [*times[1:], last + 3 * SCRAPE_S]
    return [t for t, end in zip(times, ends) if end - t >= scrapes * SCRAPE_S]


def check(run: dict, min_revisits: int) -> None:
    figures, lines = run["figures"], run["lines"]
    print("spike figures (1 s scrape):", figures)
    # every revisit between fragments of three scrapes or more shows in the top panel
    assert figures["revisits"] >= min_revisits, figures
    assert figures["shown"] >= 0.9 * figures["revisits"], figures
    # far from switches rises are rare: the bound is 20% over a long run (benchmarks/spikes.py
    # checks it); here there are only about 9 such moments, where 2 are already 22%, so one third
    assert figures["far_rises"] <= max(figures["far_moments"], 1) / 3, figures
    # markers: every switch whose gauge value was held for two scrapes is one marker, at its time
    last = lines[-1]["time"]
    detected = [line["time"] for line in lines if line["detected_switch"]]
    assert not markers_cover(held(detected, last), run["detected_marks"]), (detected, run["detected_marks"])
    true = [s["time"] for s in run["switches"]]
    assert not markers_cover(held(true, last), run["true_marks"]), (true, run["true_marks"])
    # the whole run's perplexity from the counters is the report's
    print(f"perplexity: counters {run['ppl_counters']:.4f}, report {run['ppl_report']:.4f}")
    assert abs(run["ppl_counters"] / run["ppl_report"] - 1) < 0.01


def test_revisit_spikes_markers_and_perplexity_at_a_one_second_scrape(broker, tmp_path, prometheus_binaries):
    # 6 fragments (ru digits ru en digits en... by seed 83), 36 to 77 batches each: three revisits
    # between fragments of 5 s or more; about 320 batches, 55 s. `settled`: the fragment left has run
    # three scrapes past its own first K batches, so the two scrapes before a switch show its settled
    # loss, not its own spike (with fragments of 4 s, a loaded machine missed one revisit in four runs)
    run = scraped_run(broker, tmp_path, "spikes-fast", settled=True, fragments=6, mean_tokens=1800, seed=83)
    assert [s["revisit"] for s in run["switches"]].count(True) == 3
    check(run, min_revisits=3)


@pytest.mark.slow  # about 100 s; the qualifying revisits depend on the machine's speed (see below)
def test_every_revisit_spike_shows_at_a_one_second_scrape(broker, tmp_path, prometheus_binaries):
    # 14 fragments of 3 classes, fragments of 1 to 15 s (seed 333: about 540 batches, 11 revisits).
    # Fragments this short need `settled`: on a loaded machine (load 15-20 on 2 cores) a batch takes
    # 0.5 s, the first K batches of the fragment left (its own spike) last 5 s, and the two scrapes
    # before a switch still show that spike: 7 of 10 revisits between fragments of 3 s rose then.
    run = scraped_run(broker, tmp_path, "spikes", settled=True, fragments=14, mean_tokens=1100, seed=333)
    check(run, min_revisits=2)


def test_the_top_panel_draws_the_loss_and_nothing_that_knows_where_a_switch_is():
    # what the spike check counts must come from the loss: the batch-loss histogram and the loss and
    # token counters, never a switch gauge, a switch counter or the after-switch phase on its own
    exprs = [target["expr"] for target in first_timeseries_panel()["targets"]]
    metrics = {name for expr in exprs for name in re.findall(r"\b(streamer_\w+)\{", expr)}
    assert metrics == {"streamer_batch_loss_nats_bucket", "streamer_loss_nats_total", "streamer_scored_tokens_total"}
    assert not any("after_switch" in expr for expr in exprs)
