"""The live monitor's state: plain values that continue a run exactly where it was saved.

Feed N step results, save, load into a fresh monitor, feed M more: the loss-log lines, the
view's snapshot, the trackers' snapshots and the exported series equal those of one monitor
fed all N + M. Hand-made StepResult values; no torch.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from prometheus_client import generate_latest

from monitor.drift import detector_state, load_detector, make_detector
from monitor.exporter import create_metrics
from monitor.live import LiveMonitor
from monitor.results import BatchTruth, StepResult

CLASSES = ("en", "fr", "de")
PLAIN = (dict, list, tuple, str, int, float, bool, type(None))


def stream(n: int, seed: int = 0, classifier: bool = False) -> list[StepResult]:
    """Fragments of 5-30 batches cycling through three classes whose losses differ."""
    rng = random.Random(seed)
    results, fragment, index = [], 0, 0
    level = {"en": 2.0, "fr": 3.5, "de": 5.0}
    while len(results) < n:
        name = CLASSES[rng.randrange(3)]
        for position in range(rng.randint(5, 30)):
            loss = level[name] + 1.5 * math.exp(-position / 4) + rng.uniform(-0.2, 0.2)
            labels = tuple(rng.randrange(4) for _ in range(3)) if classifier else None
            predicted = tuple(label if rng.random() < 0.7 else rng.randrange(4) for label in labels) if classifier else None
            results.append(StepResult(
                index=index, loss=loss, train_loss=loss - 0.1, grad_norm=1.0, tokens=100 + index % 7,
                truth=BatchTruth(class_name=name, fragment=fragment), predict_s=0.001 * (index % 5),
                learn_s=0.002 * (index % 3), finished_at=1_700_000_000.0 + index, gpu_memory_bytes=1000 + index,
                gates=(0.25, 0.75) if index % 2 else None, predicted=predicted, labels=labels))
            index += 1
        fragment += 1
    return results[:n]


def assert_plain(value, where="state"):
    assert isinstance(value, PLAIN), f"{where}: {type(value).__name__}"
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{where}: key {key!r}"
            assert_plain(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")


def monitor(detector: str) -> LiveMonitor:
    return LiveMonitor(run="r", strategy="naive", classes=CLASSES, k=3, from_fragment=1,
                       metrics=create_metrics(), detector=detector)


def feed(live: LiveMonitor, results, probe_every: int = 17) -> list[dict]:
    lines = []
    for result in results:
        lines.append(live.observe(result))
        if result.index % probe_every == 0:
            live.probed({"ended_class": result.truth.class_name,
                         "scores": {name: 2.0 + (result.index % (i + 3)) / 10 for i, name in enumerate(CLASSES)}})
        if result.index % 23 == 0:
            live.dead_letter("bad_utf8" if result.index % 2 else "extra_stream")
    return lines


# wall-clock readings, and histograms (which start again after a restart, as any target's do)
TIMED = ("streamer_tokens_per_second", "streamer_checkpoint_age_seconds", "streamer_predict_seconds",
         "streamer_learn_seconds", "streamer_batch_loss_nats")


def exported(live: LiveMonitor) -> list[str]:
    text = generate_latest(live.metrics.registry).decode()
    return [line for line in text.splitlines()
            if not line.startswith("#") and "_created" not in line and not line.startswith(TIMED)]


def view(live: LiveMonitor) -> dict:
    snapshot = vars(live.snapshot()).copy()
    del snapshot["tokens_per_s"], snapshot["elapsed_s"]  # wall clock
    return snapshot


@pytest.mark.parametrize("detector", ["page-hinkley", "adwin", "kswin", "none"])
@pytest.mark.parametrize("cut", [0, 1, 57, 140])
def test_a_loaded_monitor_continues_like_an_uninterrupted_one(detector, cut):
    results = stream(260, seed=cut, classifier=detector == "page-hinkley")
    whole = monitor(detector)
    whole_lines = feed(whole, results)

    first = monitor(detector)
    lines = feed(first, results[:cut])
    state = first.state_dict()
    assert_plain(state)
    state = json.loads(json.dumps(state))  # any plain-value format (torch weights_only, JSON) carries it
    resumed = monitor(detector)
    resumed.load_state_dict(state)
    lines += feed(resumed, results[cut:])

    assert lines == whole_lines
    assert view(resumed) == view(whole)
    assert resumed.tracker.snapshot() == whole.tracker.snapshot()
    assert resumed.detection.snapshot() == whole.detection.snapshot()
    assert resumed.accuracy.snapshot() == whole.accuracy.snapshot()
    assert exported(resumed) == exported(whole)
    assert resumed.dead_letters == whole.dead_letters


def test_the_stream_exercises_switches_detections_and_accuracy():
    live = monitor("page-hinkley")
    lines = feed(live, stream(260, classifier=True))
    snapshot = live.snapshot()
    assert snapshot.switches > 10 and snapshot.detected_switches > 3 and snapshot.overall["ppl@sw"] is not None
    assert snapshot.accuracy["utterances"] == 780 and any(line.get("gates") for line in lines)


def test_a_monitor_without_metrics_saves_no_series():
    live = LiveMonitor(run="r", strategy="naive")
    feed(live, stream(30))
    state = live.state_dict()
    assert state["prometheus"] is None
    other = LiveMonitor(run="r", strategy="naive")
    other.load_state_dict(state)
    assert view(other) == view(live)


def test_a_state_of_another_version_is_refused():
    live = LiveMonitor(run="r", strategy="naive")
    with pytest.raises(ValueError, match="version"):
        live.load_state_dict({"version": 0})


@pytest.mark.parametrize("name", ["page-hinkley", "adwin", "kswin"])
def test_detectors_round_trip_through_plain_values(name):
    losses = [2.0 + random.Random(i).uniform(-0.1, 0.1) + (3.0 if (i // 80) % 2 else 0.0) for i in range(400)]
    whole, part = make_detector(name), make_detector(name)
    fired = []
    for loss in losses:
        whole.update(loss)
        fired.append(whole.drift_detected)
    resumed_fired = []
    for loss in losses[:130]:
        part.update(loss)
        resumed_fired.append(part.drift_detected)
    state = json.loads(json.dumps(detector_state(part)))
    assert_plain(state)
    part = load_detector(state)
    for loss in losses[130:]:
        part.update(loss)
        resumed_fired.append(part.drift_detected)
    assert resumed_fired == fired and any(fired)
    assert detector_state(None) is None and load_detector(None) is None


def test_adwin_on_a_stream_that_never_drifts_keeps_a_bounded_record_and_still_round_trips():
    """ADWIN's record of the inputs since its last reset grew with every loss on steady traffic (200,000
    losses: 1.8 MB in each checkpoint, replayed at each resume); bounded by max_inputs, it is rebuilt
    from the newest half, a restart anywhere still gives the same detections, and a later switch is found."""
    from monitor.drift import RecordingADWIN

    rng = random.Random(0)
    losses = [rng.gauss(2.0, 0.1) for _ in range(5_000)] + [rng.gauss(3.0, 0.1) for _ in range(300)]
    whole = RecordingADWIN(max_inputs=1_000)
    fired = []
    for loss in losses:
        whole.update(loss)
        fired.append(whole.drift_detected)
        assert len(whole.inputs) < 1_000
    assert not any(fired[:5_000]) and any(fired[5_000:5_020])  # the switch, within 20 losses
    for cut in (999, 1_000, 2_345, 5_005):
        part = RecordingADWIN(max_inputs=1_000)
        for loss in losses[:cut]:
            part.update(loss)
        part = load_detector(json.loads(json.dumps(detector_state(part))))
        resumed = []
        for loss in losses[cut:]:
            part.update(loss)
            resumed.append(part.drift_detected)
        assert resumed == fired[cut:], cut
    assert make_detector("adwin").max_inputs == 20_000


def test_a_series_this_version_no_longer_exports_is_left_out_on_resume():
    """A checkpoint of an older version may hold a metric since renamed (the single last-switch
    time before the switch-time slots): the run resumes with the rest."""
    live = monitor("none")
    feed(live, stream(60))
    state = json.loads(json.dumps(live.state_dict()))
    state["prometheus"]["series"].append(["last_switch_timestamp_seconds", "gauge", ["true"], 1_700_000_000.0])
    resumed = monitor("none")
    resumed.load_state_dict(state)
    assert exported(resumed) == exported(live)


def _value(live: LiveMonitor, sample: str) -> float:
    """A sample's value in the exposition, by its name and labels as written there."""
    return next(float(line.rsplit(" ", 1)[1]) for line in exported(live) if line.startswith(sample + " "))


def test_the_dashboards_switch_and_dead_letter_panels_show_the_runs_totals_after_a_crash():
    """The panels "Dead letters by reason" and "Switches: true vs detected" plotted the counters, which a
    resume after a crash starts at 0 (right for rate()): they showed `none 0` and 4 true / 0 detected
    where the console, status.json and the report had the run's 3 dead letters and 11 switches. They plot
    gauges of the run's totals now, which the checkpoint carries."""
    from monitor.dashboard import panel_queries

    live, crashed = monitor("page-hinkley"), monitor("page-hinkley")
    feed(live, stream(200))
    crashed.load_state_dict(json.loads(json.dumps(live.state_dict())), counters=False)
    for resumed in (live, crashed):
        feed(resumed, stream(230)[200:])
    totals = crashed.snapshot()
    assert (totals.switches, totals.detected_switches, totals.dead_letters) == (
        live.snapshot().switches, live.snapshot().detected_switches, live.dead_letters)
    assert totals.switches > 5 and totals.detected_switches > 1 and sum(totals.dead_letters.values()) > 3

    def plotted(title: str) -> dict:
        """{labels other than run and strategy: value} of the series the panel's targets plot."""
        names = {name for t, expr, _ in panel_queries() if t == title
                 for name in re.findall(r"\b(streamer_\w+)\{", expr)} - {"streamer_batches_learned_total"}
        found = {}
        for line in exported(crashed):
            match = re.match(r"(\w+)\{([^}]*)\} (\S+)$", line)
            if match and match.group(1) in names:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
                found[tuple(sorted((k, v) for k, v in labels.items() if k not in ("run", "strategy")))] = \
                    float(match.group(3))
        return found

    dead = {dict(labels)["reason"]: value for labels, value in plotted("Dead letters by reason").items() if value}
    assert dead == totals.dead_letters
    switches = plotted("Switches: true vs detected")
    assert sorted(switches.values()) == sorted([totals.switches, totals.detected_switches]), switches


def test_counters_exist_at_0_from_the_start_and_a_resume_after_a_crash_starts_them_at_0():
    """From the start every counter the alerts and rules read exists at 0 (increase() counts the first
    batch, dead letter; StreamerLearnerStalled sees a learner stuck on its first batch). A resume after
    a crash (counters=False) sets the gauges and leaves the counters at 0: the checkpoint's totals are
    below what Prometheus last scraped, and a counter that comes back lower but not at 0 has its whole
    value counted again by increase(). After a clean stop (the default) they continue."""
    fresh = LiveMonitor(run="r", strategy="naive", metrics=create_metrics(), dead_letter_reasons=("bad_utf8", "nul"))
    for sample in ('streamer_batches_learned_total{run="r",strategy="naive"}',
                   'streamer_tokens_total{run="r",strategy="naive"}',
                   'streamer_dead_letter_total{reason="bad_utf8",run="r",strategy="naive"}',
                   'streamer_dead_letter_total{reason="nul",run="r",strategy="naive"}'):
        assert _value(fresh, sample) == 0.0, sample
    live = monitor("none")
    feed(live, stream(60))
    state = json.loads(json.dumps(live.state_dict()))
    crashed, stopped = monitor("none"), monitor("none")
    crashed.load_state_dict(state, counters=False)
    stopped.load_state_dict(state)
    batches = 'streamer_batches_learned_total{run="r",strategy="naive"}'
    assert (_value(live, batches), _value(stopped, batches), _value(crashed, batches)) == (60.0, 60.0, 0.0)
    assert _value(crashed, 'streamer_dead_letter_total{reason="extra_stream",run="r",strategy="naive"}') == 0.0
    gauges = [line for line in exported(live) if "_total" not in line]
    assert [line for line in exported(crashed) if "_total" not in line] == gauges
    assert exported(stopped) == exported(live)
    feed(crashed, stream(80)[60:])
    assert _value(crashed, batches) == 20.0  # what this process learned


def test_classes_past_the_notice_limit_are_named_once_and_still_kept_apart_across_a_resume():
    """Past `class_limit` classes the tracker names the next one (the learner says it once: a truth header
    with a value per record grows the per-class state for ever). Each class stays apart: folding the later
    ones into one made each first visit a revisit, and gave a stream without revisits a ppl@sw."""
    def result(index, name, loss):
        return StepResult(index=index, loss=loss, train_loss=loss, grad_norm=1.0, tokens=10,
                          truth=BatchTruth(class_name=name, fragment=index // 2), predict_s=0.0, learn_s=0.0,
                          finished_at=0.0)

    names = ["a", "a", "b", "b", "c", "c", "d", "d", "a", "a", "b"]  # fragments of 2 batches; a comes back
    monitor = LiveMonitor(run="r", strategy="naive", k=1)
    monitor.run_tracker.class_limit = 2
    lines = [monitor.observe(result(i, name, float(i))) for i, name in enumerate(names[:8])]
    assert [line["domain_name"] for line in lines] == names[:8] and len({line["domain"] for line in lines}) == 4
    assert monitor.run_tracker.past_limit == "c"
    assert monitor.snapshot().overall["ppl@sw"] is None  # four first visits: no revisit
    resumed = LiveMonitor(run="r", strategy="naive", k=1)
    resumed.run_tracker.class_limit = 2
    resumed.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert resumed.run_tracker.past_limit == "c"
    lines += [resumed.observe(result(i, name, float(i))) for i, name in enumerate(names[8:], start=8)]
    snapshot = resumed.snapshot()
    assert sorted(snapshot.per_class) == ["a", "b", "c", "d"] and lines[8]["domain"] == lines[0]["domain"]
    assert snapshot.overall["ppl@sw"] == pytest.approx(math.exp(8.0))  # a's closed revisit: its first batch, k 1


@pytest.mark.parametrize("name", ["page-hinkley", "adwin", "kswin"])
def test_a_detector_saved_at_the_update_that_found_a_switch_resets_after_it_as_the_uninterrupted_one(name):
    """A checkpoint right after a detection: the loaded detector says so, and the next update resets it as
    river does after a detection (without the flag restored, it went on from the old statistics). Loaded at
    any moment, it ends in the uninterrupted one's state (its sums, minimum, count and random generator)."""
    losses = [2.0 + random.Random(i).uniform(-0.1, 0.1) + (3.0 if (i // 80) % 2 else 0.0) for i in range(400)]
    whole, fired = make_detector(name), []
    for loss in losses:
        whole.update(loss)
        fired.append(whole.drift_detected)
    found = fired.index(True) + 1
    for cut in (found, found + 1, 3, 17, 101, 160, 233, 330):  # (and at other moments, the same)
        part = make_detector(name)
        for loss in losses[:cut]:
            part.update(loss)
        part = load_detector(json.loads(json.dumps(detector_state(part))))
        assert part.drift_detected == fired[cut - 1], cut
        resumed = []
        for loss in losses[cut:]:
            part.update(loss)
            resumed.append(part.drift_detected)
        assert resumed == fired[cut:] and detector_state(part) == detector_state(whole), cut


def test_the_detectors_are_the_documented_ones():
    """The defaults the README's tuning describes (Page-Hinkley's are pinned by their detections in
    test_detection): ADWIN at delta 0.002 and KSWIN at alpha 1e-4 over a window of 100, seeded."""
    adwin, kswin = (detector_state(make_detector(name))["params"] for name in ("adwin", "kswin"))
    assert adwin["delta"] == 0.002 and adwin["max_inputs"] == 20_000
    assert (kswin["alpha"], kswin["window_size"], kswin["stat_size"], kswin["seed"]) == (0.0001, 100, 30, 0)


def test_adwin_bounded_keeps_the_newest_half_and_a_switch_found_as_it_reaches_the_bound():
    """At max_inputs the record is rebuilt from the newest max_inputs // 2 inputs, unless that very update
    found a switch: ADWIN fires at input 640 of this stream (0.6 s.d. steps up), with a bound of 640 too."""
    from monitor.drift import RecordingADWIN

    bounded = RecordingADWIN(max_inputs=10)
    for x in range(10):
        bounded.update(float(x))
    assert bounded.inputs == [5.0, 6.0, 7.0, 8.0, 9.0]
    rng = random.Random(0)
    losses = [rng.gauss(2.0, 0.1) for _ in range(600)] + [rng.gauss(3.0, 0.1) for _ in range(100)]
    for bound in (100_000, 640):
        adwin = RecordingADWIN(max_inputs=bound)
        fired = []
        for loss in losses:
            adwin.update(loss)
            fired.append(adwin.drift_detected)
        assert fired.index(True) == 639, bound
