"""The two references of a comparison: the `independent` oracle (one model per class) and `multitask`
(the stream's batches shuffled i.i.d., learned offline, logged at their stream positions)."""

import json

import pytest
import torch
from rich.console import Console

from monitor.report import write_report
from producers.stream import prepare_stream
from producers.schedule import Schedule
from monitor.results import BatchTruth
from streamer.config import LearnConfig
from streamer.learner import told_the_class, write_run_config
from streamer.models import BuiltModel, LSTMLanguageModel
from streamer.multitask import ShuffledNaive, records_from_manifest, run_multitask, shuffled_order
from streamer.probe import ProbeSet
from streamer.step import run
from streamer.strategies import STRATEGIES, Independent
from tests.conftest import write_corpus
from tests.helpers import TINY, batches_from_records, small_stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CORPUS = {"en": "hello world, how are you " * 200, "fr": "bonjour le monde, ça va " * 200}


def params(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def stream():
    records, manifest = small_stream(CORPUS, fragments=4, mean_tokens=600, streams=3, window=10)
    return records, manifest, batches_from_records(records, 3, 10)


def test_independent_routes_by_class_and_leaves_other_classes_models_untouched(stream):
    _, _, batches = stream
    torch.manual_seed(0)
    strategy = Independent(LSTMLanguageModel(TINY), lr=2e-3)
    initial = params(strategy.model["0"])
    a_batches = [b for b, t in batches if t.class_name == "en"][:3]
    b_batches = [b for b, t in batches if t.class_name == "fr"][:5]
    a, b = BatchTruth("en", 0), BatchTruth("fr", 1)

    strategy.route(a)
    for batch in a_batches:
        strategy.predict(batch)
        strategy.learn(batch)
    after_a = params(strategy.model["0"])
    assert not same(after_a, initial)

    strategy.route(b)  # a new class: a copy of the *initial* weights, its own model
    assert strategy.classes == {"en": "0", "fr": "1"}
    assert same(params(strategy.model["1"]), initial)
    for batch in b_batches:
        strategy.predict(batch)
        strategy.learn(batch)
    assert same(params(strategy.model["0"]), after_a)  # A's model never moved while B learned
    assert not same(params(strategy.model["1"]), initial)

    after_b = params(strategy.model["1"])
    strategy.route(a)  # back to A: A's model moves, B's does not
    strategy.learn(a_batches[0])
    assert not same(params(strategy.model["0"]), after_a) and same(params(strategy.model["1"]), after_b)
    one_model = sum(p.numel() for p in LSTMLanguageModel(TINY).parameters())
    assert sum(p.numel() for p in strategy.model.parameters()) == 2 * one_model  # grows per class


def test_independent_routes_a_batch_without_a_class_to_a_model_of_its_own(stream):
    # no test routed None: a route(None) that kept the previous class's model (its batches learned into
    # that class's model) passed the suite
    _, _, batches = stream
    torch.manual_seed(0)
    strategy = Independent(LSTMLanguageModel(TINY), lr=2e-3)
    strategy.route(BatchTruth("en", 0))
    strategy.learn(batches[0][0])
    after_en = params(strategy.model["0"])
    strategy.route(None)
    assert strategy.classes == {"en": "0", "unlabelled": "1"} and strategy.model.selected == "1"
    strategy.learn(batches[1][0])
    assert same(params(strategy.model["0"]), after_en)
    strategy.route(None)  # the same model for every batch without a class
    assert strategy.model.selected == "1" and len(strategy.classes) == 2


def test_independent_probe_scores_each_class_with_its_own_model(stream):
    _, _, batches = stream
    torch.manual_seed(0)
    strategy = Independent(LSTMLanguageModel(TINY), lr=2e-3)
    probe = ProbeSet({"en": CORPUS["en"][:600], "fr": CORPUS["fr"][:600]}, rows=3, window=10)
    untrained, _ = probe.score(strategy.model)
    assert untrained["en"] == pytest.approx(untrained["fr"], abs=1.0)  # both from the initial weights
    for batch, truth in batches:
        if truth.class_name == "en":
            strategy.route(truth)
            strategy.learn(batch)
    scores, _ = probe.score(strategy.model)
    assert scores["en"] < untrained["en"] - 0.5  # en's model learned en
    assert scores["fr"] == pytest.approx(untrained["fr"])  # fr has no model yet: the initial one


def test_independent_is_labelled_an_oracle(tmp_path):
    assert Independent.oracle is True and not getattr(STRATEGIES["naive"], "oracle", False)
    config = LearnConfig(bootstrap_servers="x", topic="t", run_dir=tmp_path / "run", strategy="independent")
    model = LSTMLanguageModel(TINY)
    write_run_config(config, torch.device("cpu"), 1, BuiltModel(model=model, encode=str.encode))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["oracle"] is True

    from monitor.live import LiveMonitor
    from monitor.view import render

    # the learner's monitor is told what config.json says (the monitor knows no strategy names)
    snapshot = LiveMonitor(run="r", strategy="independent", oracle=told_the_class(config)).run_tracker.snapshot()
    assert not LiveMonitor(run="r", strategy="naive").run_tracker.snapshot().oracle
    console = Console(width=120, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(render(snapshot))
    assert "strategy independent (oracle" in console.export_text()


def _config(tmp_path, seed=0, **kw):
    return LearnConfig(bootstrap_servers="", topic="", run_dir=tmp_path / f"multitask-{seed}", run_name="mt",
                       strategy="multitask", streams=3, window=10, model=TINY, seed=seed, device="cpu",
                       classes=("en", "fr"), n_fragments=4, **kw)


def test_multitask_sees_every_batch_once_in_a_seeded_order_and_logs_stream_order(stream, tmp_path):
    records, manifest, batches = stream
    summary = run_multitask(_config(tmp_path), manifest, records)
    rows = [json.loads(line) for line in (tmp_path / "multitask-0" / "losses.jsonl").read_text().splitlines()]
    n = len(batches)
    assert summary.batches == n and summary.stop_reason == "end_of_stream"
    assert [r["batch"] for r in rows] == list(range(n))  # stream order, every batch once
    assert [(r["domain_name"], r["sequence"]) for r in rows] == [(t.class_name, t.fragment) for _, t in batches]
    order = shuffled_order(n, 0)
    assert sorted(order) == list(range(n)) and order != list(range(n))
    assert order == shuffled_order(n, 0) and order != shuffled_order(n, 1)
    assert [rows[index]["trained_at"] for index in order] == list(range(n))  # trained in that order

    # the first batch trained was scored by the untrained model, from a zero hidden state
    torch.manual_seed(0)
    fresh = ShuffledNaive(LSTMLanguageModel(TINY), lr=2e-3)
    first = order[0]
    assert rows[first]["loss"] == pytest.approx(fresh.predict(batches[first][0]).loss.item(), rel=1e-6)
    config = json.loads((tmp_path / "multitask-0" / "config.json").read_text())
    assert config["strategy"] == "multitask" and config["reference"] is True and config["oracle"] is False

    report = write_report(tmp_path / "multitask-0", from_fragment="all")
    assert report["metrics"]["ppl"] is not None and report["span"]["complete"]


def test_multitask_rebuilds_the_stream_from_the_manifest(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", lines=60)
    schedule = Schedule(n_fragments=3, mean_tokens=300, streams=2, window=8, record_tokens=8, seed=3)
    records, manifest = prepare_stream(corpus, schedule, tmp_path / "m.json")
    assert records_from_manifest(json.loads((tmp_path / "m.json").read_text())) == records
    with pytest.raises(ValueError, match="total_batches"):
        records_from_manifest({**manifest, "total_batches": manifest["total_batches"] + 1})


def test_multitask_conformance_with_the_naive_learner_when_the_state_carries(stream):
    _, _, batches = stream
    torch.manual_seed(1)
    carried = [r.loss for r in run(ShuffledNaive(LSTMLanguageModel(TINY), lr=2e-3, carry_state=True), batches[:8])]
    torch.manual_seed(1)
    naive = [r.loss for r in run(STRATEGIES["naive"](LSTMLanguageModel(TINY), lr=2e-3), batches[:8])]
    assert carried == naive
    torch.manual_seed(1)
    zeroed = [r.loss for r in run(ShuffledNaive(LSTMLanguageModel(TINY), lr=2e-3), batches[:8])]
    assert zeroed[0] == naive[0] and zeroed[1:] != naive[1:]
