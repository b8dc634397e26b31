"""A CalmTracker state dict in the format checkpoints hold (written by the tracker of 2026-11-30, before one
accumulator served the live and the offline CALM metrics) still loads and continues with exactly its numbers."""

import math

from monitor.calm import calm_metrics
from monitor.calm_tracker import CalmTracker

NAMES = {0: "A", 1: "B", 2: "C"}
FRAGMENTS = [(0, [2.3, 0.1, 0.7]), (1, [1.1, 0.3]), (0, [0.9, 0.2, 0.3, 0.1]), (2, [3.1, 0.6]),
             (1, [1.3, 0.2, 0.1]), (0, [0.4, 0.7, 0.2]), (2, [0.5, 0.3, 0.1]), (1, [0.8, 0.1])]
RECORDS = [(loss, domain, NAMES[domain], sequence)
           for sequence, (domain, losses) in enumerate(FRAGMENTS) for loss in losses]
SAVED_AT = 15  # mid-fragment: the open fragment (sequence 5, class A) has one batch

# CalmTracker(k=2, from_fragment=2).state_dict() after RECORDS[:15], as the tracker wrote it: compensated sums as
# [count, sum, compensation], classes as [domain, state] pairs in first-seen order, the open fragment with its class.
SAVED = {
    "k": 2, "from_fragment": 2, "switches": 5, "sequence": 5, "class_name": "A", "batches_in_fragment": 1,
    "span_sequence": 5, "n_fragments": 4, "rec_total": 0,
    "last_intensity": None, "last_rec": None, "last_revisit_class": None,
    "classes": [
        [0, {"name": "A", "loss": [5, 1.9000000000000004, -3.0531133177191805e-16], "n_fragments": 2,
             "intensity": [0, 0.0, 0.0], "rec_total": 0, "previous_mean": 0.375}],
        [2, {"name": "C", "loss": [2, 3.7, -1.1102230246251565e-16], "n_fragments": 1,
             "intensity": [0, 0.0, 0.0], "rec_total": 0, "previous_mean": 1.85}],
        [1, {"name": "B", "loss": [3, 1.6, -2.7755575615628914e-17], "n_fragments": 1,
             "intensity": [0, 0.0, 0.0], "rec_total": 0, "previous_mean": 0.5333333333333333}],
    ],
    "open": {"domain": 0, "previous_mean": 0.375, "loss": [1, 0.4, 0.0], "head": [1, 0.4, 0.0],
             "duration": 1, "recovered": False},
    "loss": [10, 7.2, 0.0], "intensity": [0, 0.0, 0.0],
}

# What that tracker reported after the rest of RECORDS (bit for bit).
EXPECTED = {
    "loss": 0.5823529411764706, "ppl": 1.7902458220475328, "ppl@sw": 1.608014197485783, "rec": 1.0,
    "n_batches": 17, "n_fragments": 6, "n_revisits": 2, "from_fragment": 2, "k": 2,
    "per_class": {
        "A": {"loss": 0.39999999999999997, "ppl": 1.4918246976412703, "ppl@sw": 1.7332530178673953, "rec": 2.0,
              "n_batches": 7, "n_fragments": 2, "n_revisits": 1},
        "C": {"loss": 0.9199999999999999, "ppl": 2.5092903899362975, "ppl@sw": 1.4918246976412703, "rec": 0.0,
              "n_batches": 5, "n_fragments": 2, "n_revisits": 1},
        "B": {"loss": 0.5, "ppl": 1.6487212707001282, "ppl@sw": None, "rec": None,
              "n_batches": 5, "n_fragments": 2, "n_revisits": 0},
    },
    "notes": ["class 'B': ppl@sw, rec n/a, never revisited in the evaluated span (fragments >= 2; 2 fragment(s), "
              "the last fragment is never counted)"],
    "live": {"switches": 7, "current_sequence": 7, "current_class": "B", "batches_in_fragment": 2,
             "last_loss_after_switch": 0.4, "last_rec": 0, "last_revisit_class": "C",
             "mean_loss_after_switch": 0.47500000000000003, "mean_rec": 1.0},
}
EXPECTED_LOSS_SUM = [17, 9.9, -1.6653345369377348e-16]  # the whole span's compensated sum at the end


def tracked(records, tracker=None):
    tracker = tracker or CalmTracker(k=2, from_fragment=2)
    for record in records:
        tracker.update(*record)
    return tracker


def test_the_state_dict_format_is_the_one_checkpoints_hold():
    assert tracked(RECORDS[:SAVED_AT]).state_dict() == SAVED


def test_a_saved_state_loads_and_continues_with_the_numbers_it_had():
    resumed = CalmTracker(k=2, from_fragment=2)
    resumed.load_state_dict(SAVED)
    assert resumed.state_dict() == SAVED
    tracked(RECORDS[SAVED_AT:], resumed)
    assert resumed.snapshot() == EXPECTED
    assert resumed.state_dict()["loss"] == EXPECTED_LOSS_SUM
    uninterrupted = tracked(RECORDS)
    assert uninterrupted.state_dict() == resumed.state_dict()
    assert uninterrupted.snapshot() == EXPECTED


def test_the_resumed_tracker_still_equals_the_offline_metrics():
    resumed = CalmTracker(k=2, from_fragment=2)
    resumed.load_state_dict(SAVED)
    snapshot = tracked(RECORDS[SAVED_AT:], resumed).snapshot()
    offline = calm_metrics([{"loss": loss, "domain": domain, "domain_name": name, "sequence": sequence}
                            for loss, domain, name, sequence in RECORDS], k=2, from_fragment=2)
    for key in ("loss", "ppl", "ppl@sw", "rec"):
        assert math.isclose(snapshot[key], offline[key], rel_tol=1e-12)
