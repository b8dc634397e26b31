"""CALM metrics on small streams whose values are worked out by hand, and live == offline."""

import math
import random

import pytest

from monitor.calm import calm_metrics, format_table
from monitor.calm_tracker import CalmTracker

NAMES = {0: "A", 1: "B", 2: "C"}


def stream(*fragments):
    """Records from (class id, [losses]) fragments; fragment i gets sequence i."""
    return [
        {"loss": loss, "domain": domain, "domain_name": NAMES[domain], "sequence": sequence}
        for sequence, (domain, losses) in enumerate(fragments)
        for loss in losses
    ]


# seq 0  A [4, 2]        mean 3
# seq 1  B [6, 6, 3]     mean 5
# seq 2  A [5, 3, 2, 1]  revisit, prev A mean 3: first k=2 -> (5+3)/2 = 4;
#                        5 >= 3, 3 >= 3, 2 < 3 -> rec 2; mean 11/4 = 2.75
# seq 3  B [5, 4, 3]     revisit, prev B mean 5: (5+4)/2 = 4.5; 5 >= 5, 4 < 5 -> rec 1; mean 4
# seq 4  A [2, 4]        revisit, prev A mean 2.75: (2+4)/2 = 3; 2 < 2.75 at once -> rec 0
# seq 5  B [7, 1]        last fragment: loss only
SWITCHY = stream((0, [4, 2]), (1, [6, 6, 3]), (0, [5, 3, 2, 1]), (1, [5, 4, 3]), (0, [2, 4]), (1, [7, 1]))


def test_several_switches_and_revisits():
    result = calm_metrics(SWITCHY, k=2)
    # 16 batches summing to 6 + 15 + 11 + 12 + 6 + 8 = 58
    assert result["loss"] == pytest.approx(58 / 16)
    assert result["ppl"] == pytest.approx(math.exp(3.625))
    # intensities 4, 4.5, 3; durations 2, 1, 0
    assert result["ppl@sw"] == pytest.approx(math.exp(11.5 / 3))
    assert result["rec"] == pytest.approx(1.0)
    assert (result["n_batches"], result["n_fragments"], result["n_revisits"]) == (16, 6, 3)
    assert (result["k"], result["from_fragment"]) == (2, 0)
    a, b = result["per_class"]["A"], result["per_class"]["B"]
    # A: 4+2+5+3+2+1+2+4 = 23 over 8; revisits (4, rec 2) and (3, rec 0)
    assert a["loss"] == pytest.approx(23 / 8)
    assert a["ppl@sw"] == pytest.approx(math.exp(3.5))
    assert a["rec"] == pytest.approx(1.0)
    assert (a["n_batches"], a["n_fragments"], a["n_revisits"]) == (8, 3, 2)
    # B: 6+6+3+5+4+3+7+1 = 35 over 8; one revisit (4.5, rec 1); seq 5 is last
    assert b["loss"] == pytest.approx(35 / 8)
    assert b["ppl"] == pytest.approx(math.exp(35 / 8))
    assert b["ppl@sw"] == pytest.approx(math.exp(4.5))
    assert b["rec"] == pytest.approx(1.0)
    assert (b["n_batches"], b["n_fragments"], b["n_revisits"]) == (8, 3, 1)
    assert result["notes"] == []


def test_fragment_that_never_recovers_and_k_longer_than_fragment():
    # seq 0 A [1, 1] mean 1; seq 1 B [2]; seq 2 A [3, 2, 4]: revisit, no loss < 1 -> rec 3 (its
    # length); k = 10 > 3 so the intensity is the mean of all three = 3; seq 3 B [1] is last.
    result = calm_metrics(stream((0, [1, 1]), (1, [2]), (0, [3, 2, 4]), (1, [1])), k=10)
    assert result["loss"] == pytest.approx(14 / 7)
    assert result["ppl@sw"] == pytest.approx(math.exp(3))
    assert result["rec"] == 3
    assert result["per_class"]["A"]["rec"] == 3
    # B's second fragment is the last one, so B was never revisited
    assert result["per_class"]["B"]["ppl@sw"] is None
    assert result["per_class"]["B"]["rec"] is None
    assert any("'B'" in note and "never revisited" in note for note in result["notes"])


def test_recovery_on_first_batch_and_class_seen_once():
    # seq 0 A [2]; seq 1 B [3]; seq 2 A [1]: revisit, 1 < 2 at once -> rec 0, intensity 1;
    # seq 3 C [5] seen once; seq 4 A [4] last. loss (2+3+1+5+4)/5 = 3
    result = calm_metrics(stream((0, [2]), (1, [3]), (0, [1]), (2, [5]), (0, [4])))
    assert result["loss"] == pytest.approx(3.0)
    assert result["ppl@sw"] == pytest.approx(math.e)
    assert result["rec"] == 0
    c = result["per_class"]["C"]
    assert c["loss"] == pytest.approx(5.0)
    assert (c["ppl@sw"], c["rec"], c["n_revisits"], c["n_fragments"]) == (None, None, 0, 1)
    assert any("'C'" in note for note in result["notes"])
    assert any("'B'" in note for note in result["notes"])
    assert not any("'A'" in note for note in result["notes"])


def test_too_short_stream_reports_none_and_says_why():
    result = calm_metrics(stream((0, [1, 2]), (1, [3])))
    assert result["loss"] == pytest.approx(2.0)
    assert result["ppl@sw"] is None and result["rec"] is None
    assert result["n_revisits"] == 0
    assert any("no class was revisited" in note for note in result["notes"])


def test_empty_span():
    result = calm_metrics(SWITCHY, from_fragment=6)
    assert (result["loss"], result["ppl"], result["ppl@sw"], result["rec"]) == (None,) * 4
    assert result["n_batches"] == 0 and result["per_class"] == {}
    assert any("no batches" in note for note in result["notes"])


def test_from_fragment_cuts_the_span():
    # span = seq 2..5: A [5,3,2,1] (first A in span), B [5,4,3] (first B in span),
    # A [2,4] revisit of prev A mean 2.75: intensity (2+4)/2 = 3, rec 0; B [7,1] last.
    result = calm_metrics(SWITCHY, k=2, from_fragment=2)
    assert result["loss"] == pytest.approx((11 + 12 + 6 + 8) / 11)
    assert result["ppl@sw"] == pytest.approx(math.exp(3))
    assert result["rec"] == 0
    assert (result["n_batches"], result["n_fragments"], result["n_revisits"]) == (11, 4, 1)
    assert result["per_class"]["B"]["ppl@sw"] is None
    assert any("fragments >= 2" in note for note in result["notes"])


def test_last_fragment_counts_for_loss_only():
    # seq 2 A [2] revisits A (prev mean 2): 2 < 2 never -> rec 1; seq 3 B [10, 10] would be a
    # revisit of B but is the last fragment. loss (2+2+2+10+10)/5 = 5.2
    result = calm_metrics(stream((0, [2]), (1, [2]), (0, [2]), (1, [10, 10])))
    assert result["loss"] == pytest.approx(5.2)
    assert result["ppl@sw"] == pytest.approx(math.exp(2))
    assert result["rec"] == 1
    assert result["n_revisits"] == 1
    assert result["per_class"]["B"]["loss"] == pytest.approx(22 / 3)
    assert result["per_class"]["B"]["ppl@sw"] is None


def test_ppl_is_inf_from_twenty_nats():
    result = calm_metrics(stream((0, [25.0]), (1, [25.0])))
    assert result["ppl"] == math.inf
    assert result["per_class"]["A"]["ppl"] == math.inf
    assert any(">= 20" in note for note in result["notes"])


def test_invalid_parameters():
    with pytest.raises(ValueError):
        calm_metrics(SWITCHY, k=0)
    with pytest.raises(ValueError):
        CalmTracker(from_fragment=-1)


def assert_same(live, offline, where="result"):
    """Every key of ``offline`` equals ``live`` (floats to 1e-9 relative)."""
    if isinstance(offline, dict):
        assert set(live) >= set(offline), where
        for key in offline:
            assert_same(live[key], offline[key], f"{where}[{key!r}]")
    elif isinstance(offline, float) and not isinstance(live, bool):
        assert isinstance(live, (int, float)), where
        assert live == pytest.approx(offline, rel=1e-9, abs=0), where
    else:
        assert live == offline, where


def track(records, **params):
    tracker = CalmTracker(**params)
    for r in records:
        tracker.update(r["loss"], r["domain"], r["domain_name"], r["sequence"])
    return tracker


EXAMPLES = [
    (SWITCHY, {"k": 2}),
    (SWITCHY, {"k": 2, "from_fragment": 2}),
    (SWITCHY, {"k": 2, "from_fragment": 6}),
    (stream((0, [1, 1]), (1, [2]), (0, [3, 2, 4]), (1, [1])), {}),
    (stream((0, [2]), (1, [3]), (0, [1]), (2, [5]), (0, [4])), {}),
    (stream((0, [1, 2]), (1, [3])), {}),
    (stream((0, [2]), (1, [2]), (0, [2]), (1, [10, 10])), {}),
    (stream((0, [25.0]), (1, [25.0])), {}),
    ([], {}),
]


@pytest.mark.parametrize("records, params", EXAMPLES)
def test_live_equals_offline_on_examples(records, params):
    snapshot = track(records, **params).snapshot()
    assert set(snapshot) == set(calm_metrics(records, **params)) | {"live"}
    assert_same(snapshot, calm_metrics(records, **params))


def test_live_fields():
    live = track(SWITCHY, k=2).snapshot()["live"]
    assert live == {
        "switches": 5,
        "current_sequence": 5,
        "current_class": "B",
        "batches_in_fragment": 2,
        "last_loss_after_switch": pytest.approx(3.0),  # seq 4's first two losses (2+4)/2
        "last_rec": 0,
        "last_revisit_class": "A",  # seq 4 is a revisit of class A
        "mean_loss_after_switch": pytest.approx(11.5 / 3),
        "mean_rec": pytest.approx(1.0),
    }
    # switches count the whole stream, the revisit fields only the span
    live = track(SWITCHY, k=2, from_fragment=5).snapshot()["live"]
    assert (live["switches"], live["last_rec"], live["mean_rec"]) == (5, None, None)


def random_stream(seed, n_fragments, n_classes, mean_length):
    rng = random.Random(seed)
    records, previous = [], None
    for sequence in range(n_fragments):
        domain = rng.choice([d for d in range(n_classes) if d != previous])
        previous = domain
        level = 1.0 + domain
        for step in range(1 + int(rng.expovariate(1 / mean_length))):
            loss = level + 2.0 * math.exp(-step / 5) + rng.gauss(0, 0.3)
            records.append({"loss": loss, "domain": domain, "domain_name": f"c{domain}",
                            "sequence": sequence, "extra": step})
    return records


@pytest.mark.parametrize("from_fragment", [0, 50])
def test_live_equals_offline_on_long_random_stream(from_fragment):
    records = random_stream(seed=7, n_fragments=100, n_classes=5, mean_length=60)
    assert len(records) > 3000
    offline = calm_metrics(records, k=10, from_fragment=from_fragment)
    assert offline["n_revisits"] > 30  # the comparison exercises revisits
    assert_same(track(records, k=10, from_fragment=from_fragment).snapshot(), offline)


def test_live_equals_offline_after_every_prefix():
    records = random_stream(seed=3, n_fragments=25, n_classes=3, mean_length=8)
    for params in ({"k": 3}, {"k": 3, "from_fragment": 6}):
        tracker = CalmTracker(**params)
        for i, r in enumerate(records):
            tracker.update(r["loss"], r["domain"], r["domain_name"], r["sequence"])
            assert_same(tracker.snapshot(), calm_metrics(records[: i + 1], **params), f"prefix {i + 1}")


def test_format_table_shows_na_and_notes():
    table = format_table(calm_metrics(stream((0, [2]), (1, [3]), (0, [1]), (2, [5]), (0, [4]))))
    lines = table.splitlines()
    assert lines[0] == "| class | ppl | ppl@sw | rec | batches | revisits |"
    # all: ppl e^3 = 20.09, ppl@sw e^1 = 2.72, rec 0, 5 batches, 1 revisit
    assert lines[2] == "| all | 20.09 | 2.72 | 0.00 | 5 | 1 |"
    assert "| C | 148.41 | n/a | n/a | 1 | 0 |" in lines
    assert any(line.startswith("- class 'C'") for line in lines)


def test_a_pipe_in_a_class_name_stays_in_its_cell_of_the_markdown_table():
    """A class named `a|b` split its row into one cell more than the header's."""
    import re

    records = [{**record, "domain_name": {0: "a|b", 1: "two\nlines"}.get(record["domain"], "C")} for record in SWITCHY]
    lines = format_table(calm_metrics(records)).splitlines()
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in lines if line.startswith("|")]
    assert len(set(cells)) == 1 and len(cells) == 5
    assert r"| a\|b | " in lines[3] and "| two lines | " in lines[4]
