"""Probe scoring never changes the model and fills probes.jsonl at every true switch."""

import asyncio
import copy
import json

import pytest
import torch
from torch.nn import functional as F

from monitor.exporter import create_metrics
from monitor.live import LiveMonitor
from producers.kafka import produce
from producers.schedule import Schedule
from producers.stream import prepare_stream
from streamer.config import LearnConfig
from streamer.learner import run as run_learner
from streamer.models import LSTMConfig, LSTMLanguageModel
from streamer.probe import ProbeSet, load_probe_set
from tests.helpers import TINY

TEXTS = {"en": "hello world, how are you today? " * 40, "cs": "ahoj světe, jak se dnes máš? " * 40}


def test_scoring_changes_nothing_and_is_the_plain_held_out_loss():
    torch.manual_seed(0)
    model = LSTMLanguageModel(LSTMConfig(embedding=8, hidden=16, dropout=0.5))
    model.train()
    before = copy.deepcopy(model.state_dict())
    probe = ProbeSet(TEXTS, rows=2, window=5, max_bytes=400)
    first, seconds = probe.score(model)
    second, _ = probe.score(model)
    assert first == second and seconds > 0  # no dropout: deterministic
    assert model.training  # flag restored
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    # by hand: the same bytes, one forward over the whole row with a fresh state
    data = TEXTS["en"].encode()[:400]
    per_row = (len(data) - 1) // 2 // 5 * 5 + 1
    grid = torch.tensor(list(data[: 2 * per_row])).view(2, per_row)
    model.eval()
    with torch.no_grad():
        logits, _ = model(grid[:, :-1], model.initial_state(2))
        expected = F.cross_entropy(logits.reshape(-1, 256), grid[:, 1:].reshape(-1)).item()
    assert first["en"] == pytest.approx(expected, rel=1e-5)


def _write(directory, texts):
    directory.mkdir(parents=True)
    for name, text in texts.items():
        (directory / f"{name}.txt").write_text(text, encoding="utf-8")
    return directory


def test_learner_probes_at_every_switch_without_changing_the_losses(broker, tmp_path):
    corpus = {"en": "hello world, how are you today " * 300, "fr": "bonjour le monde, ça va bien " * 300,
              "cs": "ahoj světe, jak se dnes máš " * 300}
    schedule = Schedule(n_fragments=6, mean_tokens=900, streams=3, window=10, seed=2, probe_tokens=600)
    records, manifest = prepare_stream(_write(tmp_path / "corpus", corpus), schedule, tmp_path / "m.json")
    runs = {}
    for name, probe in (("without", False), ("with", True)):
        topic = f"probe-{name}"
        asyncio.run(produce(records, broker.bootstrap_servers, topic))
        config = LearnConfig(bootstrap_servers=broker.bootstrap_servers, topic=topic, group_id=topic,
                             run_dir=tmp_path / name, streams=3, window=10, model=TINY, device="cpu",
                             total_batches=manifest["total_batches"], idle_timeout_s=20, probe_every=25,
                             probe=probe, live_view=False)
        metrics = create_metrics()
        monitor = LiveMonitor(run=name, strategy="naive", classes=tuple(manifest["classes"]), metrics=metrics)
        summary = asyncio.run(run_learner(config, manifest=manifest, monitor=monitor))
        runs[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "losses.jsonl").open()]
    assert runs["with"] == runs["without"]  # scoring the probe never touched the model
    rows = [json.loads(line) for line in (tmp_path / "with" / "probes.jsonl").open()]
    assert rows[0]["batch"] == 0 and rows[0]["trigger"] == "start"
    switches = [f["start_batch"] for f in manifest["fragments"][1:]]
    assert [r["batch"] for r in rows if r["trigger"] == "switch"] == switches
    assert [r["ended_class"] for r in rows if r["trigger"] == "switch"] == [f["class"] for f in manifest["fragments"][:-1]]
    periodic = [r["batch"] for r in rows if r["trigger"] == "periodic"]
    assert periodic == [b for b in range(25, manifest["total_batches"], 25) if b not in switches]
    assert all(set(r["scores"]) == set(corpus) for r in rows)
    assert summary.probes == len(rows)


@pytest.mark.parametrize("size", [116, 117, 118, 542, 543])
def test_the_probe_grid_never_asks_for_more_tokens_than_there_are(size):
    # rows=3 x window=1 on 116 bytes once asked for 117; rows 3 x window 10 on 542 for 543
    for rows, window in ((3, 1), (3, 10), (2, 29)):
        probe = ProbeSet({"en": "a" * size}, rows=rows, window=window, max_bytes=10_000)
        grid = probe._grids["en"]
        assert grid.shape[0] == rows and (grid.shape[1] - 1) % window == 0
        assert grid.numel() <= size and grid.shape[1] - 1 >= window


def test_a_class_name_that_is_no_safe_file_name_gets_a_probe_file_by_index(tmp_path):
    """Class names are the user's data: "../../evil" wrote its probe split outside the probe folder, "a/b" and a
    253-byte name were tracebacks. Each is now named by its index (a name like class-000 too, so none collides),
    stays inside the folder, and the learner's loader finds each class's text through the manifest."""
    classes = ["../../evil", "a/b", "x" * 253, "class-000", "ok.v2"]
    corpus = tmp_path / "data.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"utterance {i} of {name} " * 3, "class": name}) + "\n"
                              for name in classes for i in range(8)), encoding="utf-8")
    out = tmp_path / "out" / "deep"
    schedule = Schedule(n_fragments=5, mean_tokens=3, streams=1, window=10, seed=0)
    _, manifest = prepare_stream(corpus, schedule, out / "s.manifest.json", probe_examples=2)
    probe_dir = out / "s.manifest.probe"
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert written == ["data.jsonl", "out/deep/s.manifest.json",
                       *(f"out/deep/s.manifest.probe/{name}" for name in
                         ("class-000.txt", "class-001.txt", "class-002.txt", "class-004.txt", "ok.v2.txt"))]
    files = {name: entry["file"] for name, entry in manifest["probe"]["classes"].items()}
    assert files == {"../../evil": "class-000.txt", "a/b": "class-001.txt", "class-000": "class-002.txt",
                     "ok.v2": "ok.v2.txt", "x" * 253: "class-004.txt"}  # (indices in the sorted classes)
    assert manifest["classes"] == sorted(classes)
    for name, file in files.items():
        held_out = (probe_dir / file).read_text(encoding="utf-8").split("\n")
        assert len(held_out) == 2 and all(line.endswith(f" of {name} ") for line in held_out)
    probe = load_probe_set(json.loads((out / "s.manifest.json").read_text()), rows=1, window=5)
    assert sorted(probe.classes) == sorted(classes)


def test_an_index_like_class_name_in_capitals_is_named_by_its_index_too():
    """CLASS-001 kept its name: on a file system that does not tell case, CLASS-001.txt is class-001.txt, which
    another class's index may name."""
    from producers.stream import probe_file_names

    assert probe_file_names(["CLASS-001", "a/b"]) == {"CLASS-001": "class-000.txt", "a/b": "class-001.txt"}


def test_a_classifier_probe_saves_representations_only_where_dmi_reads_them(tmp_path):
    """Every classifier probe saved probe_features/batch-<batch>.npz (about 1.6 MB for 900 utterances of a
    384-wide encoder), at every switch and --probe-every batch of a daemon's looped stream, never removed;
    DMI reads those of the probe that ends each class's first fragment. Those and the run's last are saved,
    and a resumed run's scheduler knows the classes its probes.jsonl rows have ended already."""
    from types import SimpleNamespace

    from monitor.results import BatchTruth
    from streamer.probe import ProbeScheduler

    saved = []

    class Probe:
        saves_features = True

        def score(self, model, save_features=True):
            saved.append(save_features)
            return {"en": 1.0, "fr": 0.5}, 0.0

    class Loop:
        strategy, step, truth = SimpleNamespace(model=None), 0, None

        async def in_worker(self, function, *args):
            return function(*args)

    async def probed(scheduler, plan):
        loop = Loop()
        for step, truth, trigger in plan:
            loop.step, loop.truth = step, truth and BatchTruth(*truth)
            await scheduler.score(loop, trigger)

    path = tmp_path / "probes.jsonl"
    asyncio.run(probed(ProbeScheduler(Probe(), path, every=5, unit="accuracy"), [
        (0, None, "start"), (5, ("en", 0), "periodic"), (8, ("en", 0), "switch"), (10, ("fr", 1), "periodic"),
        (12, ("fr", 1), "switch"), (15, ("en", 2), "switch"), (20, ("fr", 3), "switch"), (22, ("en", 4), "end")]))
    assert saved == [False, False, True, False, True, False, False, True]
    assert [json.loads(line)["trigger"] for line in path.open()][-1] == "end"
    saved.clear()
    asyncio.run(probed(ProbeScheduler(Probe(), path, every=5, unit="accuracy"), [
        (25, ("fr", 5), "switch"), (30, ("de", 6), "switch"), (31, ("en", 7), "switch")]))
    assert saved == [False, True, False]


def test_names_that_differ_only_in_case_or_hide_the_file_are_named_by_index():
    """"A" and "a" are one file where case is not told; ".hidden" is a hidden file: each but the first of a
    case-fold is named by its index, and so is a name that starts with a dot."""
    from producers.stream import probe_file_names

    assert probe_file_names([".hidden", "A", "a", "B"]) == {".hidden": "class-000.txt", "A": "A.txt",
                                                            "a": "class-002.txt", "B": "B.txt"}
