"""Prequential accuracy / macro-F1 and DMI (seed 001, Eq. 5-7) on examples worked by hand."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import generate_latest

from monitor.accuracy import AccuracyTracker, accuracy_metrics
from monitor.dmi import dmi, dmi_from_run, dmi_scores, kmeans, matched_correct
from monitor.exporter import create_metrics
from monitor.live import LiveMonitor
from monitor.report import build_report

# (class, predicted, labels) per batch. Pairs (truth, predicted): (0,0) (1,1) (0,1) | (2,2) (1,2)
BATCHES = [("en", [0, 1, 1], [0, 1, 0]), ("fr", [2, 2], [2, 1])]


def _rows():
    return [{"loss": 1.0, "domain": i, "domain_name": name, "sequence": i, "predicted": p, "labels": y}
            for i, (name, p, y) in enumerate(BATCHES)]


def test_accuracy_and_macro_f1_by_hand():
    snap = accuracy_metrics(_rows(), window=3)
    assert snap["utterances"] == 5 and snap["batches"] == 2
    assert snap["accuracy"] == pytest.approx(3 / 5)
    # F1: label 0 p=1 r=1/2 -> 2/3; label 1 p=1/2 r=1/2 -> 1/2; label 2 p=1/2 r=1 -> 2/3
    assert snap["macro_f1"] == pytest.approx((2 / 3 + 1 / 2 + 2 / 3) / 3)
    # last 3: (0,1) (2,2) (1,2): one right; F1 only for label 2 (p=1/2, r=1), labels 0 and 1 count 0
    assert snap["rolling"] == pytest.approx({"window": 3, "utterances": 3, "accuracy": 1 / 3, "macro_f1": 2 / 9})
    assert snap["per_class"]["en"] == pytest.approx({"utterances": 3, "accuracy": 2 / 3, "macro_f1": 2 / 3})
    # fr: (2,2) (1,2): label 2 p=1/2 r=1 -> 2/3; label 1 never predicted -> 0
    assert snap["per_class"]["fr"] == pytest.approx({"utterances": 2, "accuracy": 1 / 2, "macro_f1": 1 / 3})


def test_language_model_rows_have_no_accuracy():
    assert accuracy_metrics([{"loss": 1.0, "domain": 0, "domain_name": "en", "sequence": 0}]) is None
    assert AccuracyTracker().snapshot() is None
    with pytest.raises(ValueError):
        AccuracyTracker().update([1, 2], [1], "en")


def _result(index, name, predicted, labels):
    return SimpleNamespace(index=index, loss=1.0, train_loss=1.0, tokens=len(labels), predict_s=0.0,
                           learn_s=0.0, finished_at=0.0, truth=SimpleNamespace(class_name=name, fragment=index),
                           predicted=tuple(predicted), labels=tuple(labels))


def _gauge(text, name, **labels):
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"run": "r", "strategy": "naive", **labels}.items()))
    for line in text.splitlines():
        if line.startswith(f"streamer_{name}{{") and line.split("{")[1].split("}")[0] == wanted:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_live_monitor_snapshot_and_gauges_equal_the_offline_numbers():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", metrics=metrics, detector="none")
    lines = [monitor.observe(_result(i, *batch)) for i, batch in enumerate(BATCHES)]
    assert [line["predicted"] for line in lines] == [b[1] for b in BATCHES]
    assert monitor.snapshot().accuracy == accuracy_metrics(lines)
    text = generate_latest(metrics.registry).decode()
    assert _gauge(text, "accuracy") == pytest.approx(0.6)
    assert _gauge(text, "macro_f1") == pytest.approx(11 / 18)
    assert _gauge(text, "accuracy_rolling") == pytest.approx(0.6)  # 5 utterances < the 1000 window
    assert _gauge(text, "class_accuracy", **{"class": "en"}) == pytest.approx(2 / 3)
    assert _gauge(text, "class_macro_f1", **{"class": "fr"}) == pytest.approx(1 / 3)


def test_live_forgetting_of_accuracy_probes_is_the_drop_from_the_best():
    metrics = create_metrics()
    monitor = LiveMonitor(run="r", strategy="naive", metrics=metrics, detector="none")
    for row in ({"scores": {"en": 0.5}, "ended_class": "en"}, {"scores": {"en": 0.8}}, {"scores": {"en": 0.6}}):
        monitor.probed({**row, "unit": "accuracy"})
    assert _gauge(generate_latest(metrics.registry).decode(), "forgetting", **{"class": "en"}) == pytest.approx(0.2)


def test_hungarian_matching_is_one_to_one_not_greedy():
    # cluster 0 holds a a a b b, cluster 1 holds a a: greedy would call both "a" (5 right);
    # one-to-one, 0 -> a, 1 -> b gives 3, while 0 -> b, 1 -> a gives 4: the maximum matching
    correct = matched_correct(np.array([0, 0, 0, 0, 0, 1, 1]), np.array(list("aaabbaa")))
    assert correct.tolist() == [False, False, False, True, True, True, True]
    # more clusters than labels: the unmatched cluster's samples are all wrong
    assert matched_correct(np.array([0, 0, 1, 2]), np.array(list("aaab"))).tolist() == [True, True, False, True]


def test_kmeans_finds_well_separated_groups_and_is_seeded():
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [10, 0], [0, 10]])
    x = np.concatenate([c + rng.normal(scale=0.1, size=(5, 2)) for c in centres])
    truth = np.repeat([0, 1, 2], 5)
    assignment = kmeans(x, 3, seed=1)
    assert matched_correct(assignment, truth).all()
    assert (kmeans(x, 3, seed=1) == assignment).all()
    with pytest.raises(ValueError):
        kmeans(x, 16)


def test_kmeans_keeps_the_restart_of_least_inertia():
    # the separated groups above come out alike from every restart: keeping the worst restart passed the suite.
    # A structureless cloud has restarts that differ; the first of n_init restarts is the one n_init=1 makes.
    x = np.random.default_rng(1).normal(size=(40, 2))

    def inertia(assignment):
        return sum(((x[assignment == c] - x[assignment == c].mean(0)) ** 2).sum() for c in np.unique(assignment))
    assert inertia(kmeans(x, 4, n_init=10)) < inertia(kmeans(x, 4, n_init=1)) - 0.1


# Two tasks. Task A has labels x, y; task B has labels z, w. Points 100 apart are different groups.
TASKS = np.array(["A"] * 4 + ["B"] * 4)
LABELS = np.array(["x", "x", "y", "y", "z", "z", "w", "w"])
SEPARATED_A = [[0, 100], [0, 101], [0, -100], [0, -101]]  # x and y apart
MIXED_A = [[0, 100], [0, 300], [1, 100], [1, 300]]  # clusters {x1, y1} and {x2, y2}: one right in each
SEPARATED_B = [[100, 0], [101, 0], [300, 0], [301, 0]]
MIXED_B = [[100, 0], [100, 200], [101, 0], [101, 200]]
STAGES = [np.array(SEPARATED_A + MIXED_B, float), np.array(MIXED_A + SEPARATED_B, float)]


def test_dmi_matrix_and_its_three_means_by_hand():
    result = dmi(STAGES, TASKS, LABELS, ["A", "B"], seed=0)
    # after A: A separated (1.0), B not learned yet: 2 of its 4 right by clustering (0.5)
    # after B: A forgotten into mixed clusters (0.5), B separated (1.0)
    assert result["matrix"] == [[1.0, 0.5], [0.5, 1.0]]
    assert (result["stability"], result["plasticity"], result["generalizability"]) == (0.5, 1.0, 0.5)
    assert (result["samples"], result["clusters"]) == (8, 4)


def test_dmi_scores_are_the_triangle_and_diagonal_means():
    matrix = [[0.9, 0.2, 0.1], [0.7, 0.8, 0.3], [0.6, 0.5, 0.95]]
    scores = dmi_scores(matrix)
    assert scores["stability"] == pytest.approx((0.7 + 0.6 + 0.5) / 3)
    assert scores["plasticity"] == pytest.approx((0.9 + 0.8 + 0.95) / 3)
    assert scores["generalizability"] == pytest.approx((0.2 + 0.1 + 0.3) / 3)
    assert dmi_scores([[0.4, 0.3]]) == {"stability": None, "plasticity": 0.4, "generalizability": None}
    assert dmi_scores([[0.9, None], [0.5, 0.7]])["generalizability"] is None  # a stage not scored


def _write_run(run, probe_rows, saved):
    run.mkdir()
    records = [dict(row, loss=1.0, domain=0 if row["domain_name"] == "A" else 1, sequence=i)
               for i, row in enumerate([{"domain_name": "A", "predicted": [0, 1], "labels": [0, 1]},
                                        {"domain_name": "B", "predicted": [2, 2], "labels": [2, 3]}])]
    (run / "losses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "probes.jsonl").write_text("".join(json.dumps({**r, "unit": "accuracy"}) + "\n" for r in probe_rows))
    (run / "probe_features").mkdir()
    for batch, features in saved.items():
        np.savez(run / "probe_features" / f"batch-{batch:08d}.npz", features=features, classes=TASKS,
                 labels=LABELS, predicted=np.zeros(8, int), vocabulary=np.array(["x"]), batch=batch)
    return records


def test_dmi_from_a_run_takes_each_task_first_ending_and_the_end_of_run(tmp_path):
    rows = [{"batch": 0, "trigger": "start", "ended_class": None, "scores": {"A": 0.0, "B": 0.0}},
            {"batch": 1, "trigger": "switch", "ended_class": "A", "scores": {"A": 1.0, "B": 0.0}},
            {"batch": 2, "trigger": "periodic", "ended_class": None, "scores": {"A": 0.9, "B": 0.5}},
            {"batch": 3, "trigger": "switch", "ended_class": "A", "scores": {"A": 0.9, "B": 0.5}},
            {"batch": 4, "trigger": "end", "ended_class": "B", "scores": {"A": 0.5, "B": 1.0}}]
    saved = {0: STAGES[1], 1: STAGES[0], 2: STAGES[1], 3: STAGES[1], 4: STAGES[1]}
    records = _write_run(tmp_path / "run", rows, saved)
    result = dmi_from_run(tmp_path / "run", records)
    assert result["stages"] == [1, 4] and result["matrix"] == [[1.0, 0.5], [0.5, 1.0]]
    assert result["probe_utterances"] == {"A": 4, "B": 4} and result["labels_per_task"] == {"A": 2, "B": 2}
    assert result["notes"] == []  # two probe utterances per label: enough not to warn

    report = build_report(tmp_path / "run")
    assert report["dmi"]["stability"] == 0.5 and report["accuracy"]["accuracy"] == 0.75
    # the forgetting family on accuracy (higher is better), the end-of-run probe as the last stage
    assert report["probe_matrix"]["unit"] == "held-out accuracy" and report["probe_matrix"]["stages"] == [1, 4]
    assert report["forgetting"]["last_acc"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2 after the last stage
    assert report["forgetting"]["bwt"] == pytest.approx(0.5 - 1.0)
    with open(tmp_path / "run" / "probes.jsonl", "a") as log:  # a row torn by a kill -9: left out, as the report does
        log.write('{"batch": 5, "trigger": "swi')
    assert dmi_from_run(tmp_path / "run", records)["stages"] == [1, 4]


def test_no_saved_representations_no_dmi(tmp_path):
    assert dmi_from_run(tmp_path, []) is None
    records = _write_run(tmp_path / "run", [{"batch": 0, "trigger": "start", "ended_class": None,
                                             "scores": {"A": 0.0}}], {0: STAGES[0]})
    assert dmi_from_run(tmp_path / "run", records)["notes"] == ["no probe row ended a task: no stage to evaluate"]


def test_report_prints_and_returns_a_classifiers_accuracy(tmp_path, capsys):
    """A classifier run's accuracy was in results.json only: `report --json` left it out and no text said it."""
    from streamer.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "losses.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows()))
    assert main(["report", str(run)]) == 0
    assert "classifier: prequential accuracy 0.600, macro-F1 0.611 over 5 utterances" in capsys.readouterr().out
    assert main(["report", str(run), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["accuracy"]["accuracy"] == pytest.approx(3 / 5) and "dmi" in printed
