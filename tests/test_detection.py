"""Switches found without labels: hand-worked scores, detectors on a seeded stream, live == offline."""

import math
import random
from types import SimpleNamespace

import pytest

from monitor.detection import (
    DetectionTracker,
    calm_metrics_from_detected,
    detect_offline,
    detected_times,
    detection_report,
    evaluate_detection,
    switch_times,
)
from monitor.live import LiveMonitor


# true switches 10, 30, 50, 70; detections 5, 12, 13, 45, 54, 90; tolerance 5
#   5: before switch 10                          -> false alarm (early)
#  12: 10 <= 12 <= 15                            -> matches 10, delay 2
#  13: 10 already matched, 30 > 13               -> false alarm (second detection for one switch)
#  45: 30 + 5 < 45, so 30 is missed; 50 > 45     -> false alarm (early)
#  54: 50 <= 54 <= 55                            -> matches 50, delay 4
#  90: 70 + 5 < 90                               -> false alarm (late) and 70 missed
# TP 2; precision 2/6; recall 2/4; f1 = 2 * (1/3)(1/2) / (1/3 + 1/2) = 0.4; delays 2, 4
def test_several_switches_hand_worked():
    result = evaluate_detection([10, 30, 50, 70], [5, 12, 13, 45, 54, 90], tolerance=5)
    assert (result["n_true"], result["n_detected"], result["true_positives"]) == (4, 6, 2)
    assert (result["n_false_alarms"], result["n_missed"]) == (4, 2)
    assert result["precision"] == pytest.approx(1 / 3)
    assert result["recall"] == pytest.approx(0.5)
    assert result["f1"] == pytest.approx(0.4)
    assert result["mean_delay_batches"] == 3.0
    assert result["median_delay_batches"] == 3.0
    assert result["matched"] == [[10, 12], [50, 54]]
    assert result["false_alarms"] == [5, 13, 45, 90]
    assert result["missed"] == [30, 70]
    assert result["notes"] == []


def test_input_order_does_not_matter():
    ordered = evaluate_detection([10, 30, 50, 70], [5, 12, 13, 45, 54, 90], tolerance=5)
    assert evaluate_detection([70, 10, 50, 30], [90, 54, 5, 45, 13, 12], tolerance=5) == ordered


# tolerance 3, switch at 10: 13 = 10 + 3 is still in time, 14 is not
def test_tolerance_is_inclusive():
    assert evaluate_detection([10], [13], tolerance=3)["matched"] == [[10, 13]]
    late = evaluate_detection([10], [14], tolerance=3)
    assert (late["false_alarms"], late["missed"], late["true_positives"]) == ([14], [10], 0)
    assert late["precision"] == 0.0 and late["recall"] == 0.0 and late["f1"] == 0.0
    exact = evaluate_detection([10], [9, 10, 11], tolerance=0)
    assert (exact["matched"], exact["false_alarms"]) == ([[10, 10]], [9, 11])


# switches 10, 12, tolerance 5: 13 takes the earliest (10, delay 3), 14 the next (12, delay 2);
# median of delays 3, 2 = 2.5
def test_greedy_takes_the_earliest_unmatched_switch():
    result = evaluate_detection([10, 12], [13, 14], tolerance=5)
    assert result["matched"] == [[10, 13], [12, 14]]
    assert result["median_delay_batches"] == 2.5
    # greedy in time, not nearest: 20 is within tolerance of both 10 and 20 and takes 10
    greedy = evaluate_detection([10, 20], [20], tolerance=10)
    assert (greedy["matched"], greedy["missed"]) == ([[10, 20]], [20])


# three matches with delays 0, 1, 7 -> mean 8/3, median 1
def test_delay_statistics():
    result = evaluate_detection([0, 20, 40], [0, 21, 47], tolerance=10)
    assert result["mean_delay_batches"] == pytest.approx(8 / 3)
    assert result["median_delay_batches"] == 1.0


def test_no_detections_leaves_precision_undefined():
    result = evaluate_detection([10, 30], [], tolerance=5)
    assert result["precision"] is None and result["f1"] is None
    assert result["recall"] == 0.0
    assert result["mean_delay_batches"] is None and result["median_delay_batches"] is None
    assert result["missed"] == [10, 30]
    assert "precision, f1: no detections" in result["notes"]
    assert any(note.startswith("detection delay") for note in result["notes"])


def test_no_true_switches_leaves_recall_undefined():
    result = evaluate_detection([], [3, 8], tolerance=5)
    assert result["precision"] == 0.0
    assert result["recall"] is None and result["f1"] is None
    assert any(note.startswith("recall, f1") for note in result["notes"])


def test_bad_tolerance():
    for tolerance in (-1, 1.5, True):
        with pytest.raises(ValueError):
            evaluate_detection([], [], tolerance=tolerance)


def records_from(sequences, losses=None, detected=None):
    records = []
    for i, sequence in enumerate(sequences):
        record = {"loss": 1.0 if losses is None else losses[i], "domain": sequence % 2,
                  "domain_name": "AB"[sequence % 2], "sequence": sequence}
        if detected is not None:
            record["detected_switch"] = i in detected
        records.append(record)
    return records


def test_switch_and_detected_times():
    records = records_from([0, 0, 1, 1, 1, 2, 3, 3], detected={0, 3, 6})
    assert switch_times(records) == [2, 5, 6]  # the first batch is never a switch
    assert detected_times(records) == [0, 3, 6]
    assert detected_times(records_from([0, 1])) == []  # no field: nothing detected
    assert switch_times([]) == []


# 5 segments of 50 batches alternating 2.0 and 4.0 (seeded noise sd 0.1): true switches 50, 100,
# 150, 200. Page-Hinkley in mode "up" watches increases only: it finds the upward jumps 2 -> 4 at
# 50 (delay 0) and 150 (delay 1) and never the downward ones at 100 and 200.
def synthetic_losses(seed=0):
    rng = random.Random(seed)
    return [level + rng.gauss(0.0, 0.1) for level in (2.0, 4.0, 2.0, 4.0, 2.0) for _ in range(50)]


def test_page_hinkley_finds_the_upward_switches():
    detected = detect_offline(synthetic_losses(), "page-hinkley")
    assert detected == [50, 151]
    result = evaluate_detection([50, 100, 150, 200], detected, tolerance=10)
    assert result["matched"] == [[50, 50], [150, 151]]
    assert result["missed"] == [100, 200]  # downward jumps
    assert (result["precision"], result["recall"]) == (1.0, 0.5)


def test_the_default_page_hinkley_waits_its_warm_up_sees_a_small_rise_and_never_a_fall():
    """The defaults tuned on the demo (min_instances 10, threshold 1.0, mode up) were pinned by no test: a rise of
    0.6 nats at batch 3 is found at batch 9, once its 10 warm-up losses are in (2 of them: at 6; threshold 2.0: at
    14), and the falls after it are not switches (mode both: at 9, 19 and 29)."""
    losses = [1.0] * 3 + [1.6] * 12 + [1.0] * 10 + [0.2] * 10
    assert detect_offline(losses, "page-hinkley") == [9]


def test_detect_offline_other_detectors_and_none():
    assert detect_offline(synthetic_losses(), "none") == []
    assert detect_offline([], "adwin") == []
    for name in ("adwin", "kswin"):
        detected = detect_offline(synthetic_losses(), name)
        assert detected == sorted(detected) and all(0 <= d < 250 for d in detected)
    with pytest.raises(ValueError):
        detect_offline([1.0], "cusum")


def test_detect_offline_skips_non_finite_losses_but_keeps_positions():
    losses = synthetic_losses()
    with_nan = losses[:10] + [math.nan, math.inf] + losses[10:]
    assert detect_offline(with_nan) == [d + 2 for d in detect_offline(losses)]


def test_detect_offline_reproduces_the_live_monitor_fields():
    monitor = LiveMonitor(run="r", strategy="s", detector="page-hinkley")
    losses = synthetic_losses(seed=3)
    records = [
        monitor.observe(SimpleNamespace(
            loss=loss, tokens=10, index=i, train_loss=loss, predict_s=0.0, learn_s=0.0, finished_at=0.0,
            truth=SimpleNamespace(class_name="AB"[i // 50 % 2], fragment=i // 50)))
        for i, loss in enumerate(losses)
    ]
    assert detected_times(records) == detect_offline(losses)
    assert switch_times(records) == [50, 100, 150, 200]


# segments cut at detections 2, 5, 9 (k = 2):
#   seg0 [4, 2]         mean 3      first: not scored
#   seg1 [6, 6, 3]      mean 5      head (6+6)/2 = 6; vs seg0 mean 3: 6, 6, 3 never < 3 -> rec 3
#   seg2 [5, 3, 2, 1]   mean 2.75   head (5+3)/2 = 4; vs seg1 mean 5: 5 >= 5, 3 < 5 -> rec 1
#   seg3 [7, 1]                     last: loss only
# ppl@sw = exp((6 + 4) / 2) = exp(5); rec = (3 + 1) / 2 = 2; loss = (6 + 15 + 11 + 8) / 11
HAND_LOSSES = [4, 2, 6, 6, 3, 5, 3, 2, 1, 7, 1]


def test_calm_metrics_from_detected_hand_worked():
    records = records_from([0] * len(HAND_LOSSES), HAND_LOSSES)  # no labels needed
    result = calm_metrics_from_detected(records, [2, 5, 9], k=2)
    assert result["ppl@sw"] == pytest.approx(math.exp(5))
    assert result["rec"] == 2.0
    assert result["loss"] == pytest.approx(40 / 11)
    assert result["ppl"] == pytest.approx(math.exp(40 / 11))
    assert (result["n_batches"], result["n_segments"], result["n_scored_segments"]) == (11, 4, 2)
    assert result["estimated_from"] == "detected switches"
    assert len(result["notes"]) == 1 and result["notes"][0].startswith("label-free estimates")
    # a detection at 0 and a repeated detection start no segment
    assert calm_metrics_from_detected(records, [0, 2, 2, 9, 5], k=2) == result


# from_fragment=1: span seg1..seg3 (34 / 9 loss); only seg2 is scored: exp(4), rec 1
def test_calm_metrics_from_detected_span():
    records = records_from([0] * len(HAND_LOSSES), HAND_LOSSES)
    result = calm_metrics_from_detected(records, [2, 5, 9], k=2, from_fragment=1)
    assert result["loss"] == pytest.approx(34 / 9)
    assert result["ppl@sw"] == pytest.approx(math.exp(4))
    assert result["rec"] == 1.0
    assert (result["n_segments"], result["n_scored_segments"], result["from_fragment"]) == (3, 1, 1)


def test_calm_metrics_from_detected_too_few_segments():
    records = records_from([0] * len(HAND_LOSSES), HAND_LOSSES)
    result = calm_metrics_from_detected(records, [5], k=2)
    assert result["ppl@sw"] is None and result["rec"] is None
    assert result["n_segments"] == 2
    assert any(note.startswith("ppl@sw, rec: fewer than three") for note in result["notes"])
    empty = calm_metrics_from_detected([], [])
    assert empty["loss"] is None and empty["ppl"] is None and empty["n_segments"] == 0
    with pytest.raises(ValueError):
        calm_metrics_from_detected(records, [11])
    with pytest.raises(ValueError):
        calm_metrics_from_detected(records, [], k=0)


def random_stream(n, seed, switch_p=0.03, detect_p=0.05):
    """(sequence, detected) per batch: detections cluster after switches, plus stray ones."""
    rng = random.Random(seed)
    sequence, since_switch, stream = 0, 99, []
    for i in range(n):
        if i and rng.random() < switch_p:
            sequence, since_switch = sequence + 1, 0
        since_switch += 1
        detected = rng.random() < (0.3 if since_switch <= 8 else detect_p)
        stream.append((sequence, detected))
    return stream


def offline(stream, tolerance):
    records = [{"sequence": s, "detected_switch": d} for s, d in stream]
    return evaluate_detection(switch_times(records), detected_times(records), tolerance=tolerance)


def test_tracker_equals_offline_on_a_seeded_stream():
    stream = random_stream(3000, seed=7)
    for tolerance in (0, 3, 10):
        tracker = DetectionTracker(tolerance=tolerance, max_listed=None)
        for i, (sequence, detected) in enumerate(stream):
            tracker.update(i, sequence, detected)
            if i % 500 == 499:
                assert tracker.snapshot() == offline(stream[: i + 1], tolerance)
        result = tracker.snapshot()
        assert result == offline(stream, tolerance)
        assert result["true_positives"] > 0 and result["n_false_alarms"] > 0 and result["n_missed"] > 0
        assert len(tracker._pending) <= tolerance + 1  # bounded memory


def test_tracker_equals_offline_on_every_prefix():
    stream = random_stream(80, seed=2, switch_p=0.15, detect_p=0.1)
    tracker = DetectionTracker(tolerance=4)
    for i, (sequence, detected) in enumerate(stream):
        tracker.update(i, sequence, detected)
        assert tracker.snapshot() == offline(stream[: i + 1], 4), f"prefix of {i + 1} batches"
    final = tracker.snapshot()  # 10 switches: 7 found, 3 missed, 11 false alarms
    assert (final["n_true"], final["true_positives"], final["n_false_alarms"]) == (10, 7, 11)


def test_tracker_lists_are_bounded():
    stream = random_stream(3000, seed=7)
    tracker = DetectionTracker(tolerance=5, max_listed=3)
    for i, (sequence, detected) in enumerate(stream):
        tracker.update(i, sequence, detected)
    full = offline(stream, 5)
    result = tracker.snapshot()
    for key in ("matched", "false_alarms", "missed"):
        assert result[key] == full[key][-3:]
        assert f"{key}: the last 3 of {len(full[key])} are listed" in result["notes"]
    counts = ("n_true", "n_detected", "true_positives", "precision", "recall", "f1",
              "mean_delay_batches", "median_delay_batches")
    assert {key: result[key] for key in counts} == {key: full[key] for key in counts}


def test_tracker_rejects_going_back():
    tracker = DetectionTracker()
    tracker.update(5, 0, False)
    with pytest.raises(ValueError):
        tracker.update(5, 0, False)


def test_detection_report_uses_the_logged_detections():
    sequences = [i // 50 for i in range(250)]
    records = records_from(sequences, synthetic_losses(), detected={52, 120, 203})
    report = detection_report(records, tolerance=5, k=2)
    assert report["source"].startswith("detected_switch field")
    assert report["evaluation"]["matched"] == [[50, 52], [200, 203]]
    assert report["evaluation"]["false_alarms"] == [120]
    assert report["metrics"] == calm_metrics_from_detected(records, [52, 120, 203], k=2)


def test_detection_report_detects_offline_without_the_field():
    sequences = [i // 50 for i in range(250)]
    records = records_from(sequences, synthetic_losses())  # CALM format only
    report = detection_report(records, tolerance=10)
    assert "page-hinkley" in report["source"]
    assert report["evaluation"] == evaluate_detection([50, 100, 150, 200], [50, 151], tolerance=10)
    assert report["metrics"]["n_segments"] == 3
