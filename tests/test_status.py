"""`streamer status RUN_DIR` against a real learner: a daemon (no limits) learns a short stream through
the embedded broker, catches up and waits; its status, read from the run directory and the metrics
endpoint, says so, and its view's batch count equals streamer_batches_learned_total; after SIGTERM
the status says the learner is gone and shows its last state. The learner's plain log says the same."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from producers.kafka import produce
from producers.wire import Record
from streamer.cli.main import main
from streamer.cli.status import run_status
from tests.conftest import write_corpus

STREAMER = [sys.executable, "-m", "streamer.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _status_json(run_dir):
    path = run_dir / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _wait_for(condition, process, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the learner exited early: {process.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s}s"
        time.sleep(0.2)


@pytest.fixture
def waiting_learner(broker, tmp_path):
    """A learner that has learned the whole stream and waits for more: (process, run_dir, manifest)."""
    corpus = write_corpus(tmp_path / "corpus", lines=100)
    manifest_path = tmp_path / "manifest.json"
    produced = subprocess.run([*STREAMER, "produce", "--corpus", str(corpus), "--bootstrap-servers",
                               broker.bootstrap_servers, "--topic", "status", "--fragments", "3", "--lambda", "600",
                               "--streams", "3", "--window", "10", "--seed", "0", "--probe-tokens", "0", "--manifest", str(manifest_path)],
                              capture_output=True, text=True, timeout=120)
    assert produced.returncode == 0, produced.stderr
    manifest = json.loads(manifest_path.read_text())
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [*STREAMER, "learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", "status",
         "--streams", "3", "--window", "10", "--hidden", "16", "--embedding", "8", "--no-view", "--no-probe",
         "--metrics-port", "0", "--run-dir", str(run_dir)],
        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: _status_json(run_dir).get("batches") == manifest["total_batches"]
                  and _status_json(run_dir).get("activity") == "waiting"
                  and _status_json(run_dir).get("tokens_per_s") == 0, process, "idle status")
        yield process, run_dir, manifest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


def test_status_of_a_waiting_daemon_then_of_a_stopped_one(broker, waiting_learner, capsys):
    process, run_dir, manifest = waiting_learner
    total = manifest["total_batches"]

    assert main(["status", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert f"learner running (pid {process.pid})" in text
    assert "topic status, group streamer-status-naive, strategy naive" in text
    assert f"loss log: {total:,} batches" in text
    assert "[caught up, waiting for records since " in text and f"batch {total} records " in text
    assert f"metrics http://127.0.0.1:" in text and f"batches {total:,}; tokens/s 0;" in text

    status = run_status(run_dir)
    console, metrics = status["status"], status["metrics"]["values"]
    assert console["batches"] == metrics["batches"] == total  # the view counts what Prometheus counts
    assert console["records"] == manifest["total_records"]
    assert set(console["lag_by_partition"].values()) == {0} and set(metrics["lag"].values()) == {0}
    assert console["tokens_per_s"] == 0 and metrics["tokens/s"] == 0  # the last 5 s: nothing learned
    assert console["tokens_per_s_compute"] > 0  # the model's speed over its last minute of compute
    assert console["waiting_s"] > 0 and console["compute_s"] > 0

    # streams 0 and 2 send 7 records (315 windows: more than 256) each, stream 1 nothing: after 5 s without a
    # batch the learner names it (console, status, metric, log), and learns on once its records come
    text = "the quick brown fox jumps over the lazy dog. " * 10  # 450 bytes
    asyncio.run(produce([Record(stream, text) for _ in range(7) for stream in ("0", "2")], broker.bootstrap_servers,
                        "status"))
    _wait_for(lambda: _status_json(run_dir).get("waiting_for") == [1], process, "stream 1 waited for", 60)
    status = run_status(run_dir)
    assert status["status"]["activity"] == "waiting" and status["metrics"]["url"]
    assert main(["status", str(run_dir)]) == 0
    assert "[waiting for stream 1 since " in capsys.readouterr().out
    with urllib.request.urlopen(status["metrics"]["url"], timeout=5) as answer:
        assert 'streamer_streams_waited_for{run="run",strategy="naive"} 1.0' in answer.read().decode()
    asyncio.run(produce([Record("1", text)] * 7, broker.bootstrap_servers, "status"))
    _wait_for(lambda: _status_json(run_dir).get("batches", 0) >= total + 314  # 3,150 bytes more in each stream
              and _status_json(run_dir).get("activity") == "waiting", process, "the batches of stream 1's records")
    assert _status_json(run_dir)["waiting_for"] == [] and _status_json(run_dir)["batches"] <= total + 315

    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output[-3000:]
    assert "[caught up, waiting for records since " in output  # the plain log said it too
    said = [line for line in output.splitlines() if line.startswith(("the next batch waits", "stream ", "streams "))]
    assert said == [], output[-3000:]  # a wait of under a minute: for the log, a stream far slower than others
    total = _status_json(run_dir)["batches"]
    summary = next(line for line in output.splitlines() if line.startswith(f"{total} batches"))
    assert "s computing (" in summary and "s waiting (" in summary and "idle " in summary

    after = run_status(run_dir)
    assert after["learner"] == {"pid": process.pid, "running": False}
    assert after["metrics"]["error"].startswith("unreachable")
    assert after["status"]["activity"] == "stopped" and after["status"]["stop_reason"] == "signal"
    assert after["checkpoint_age_s"] is not None and after["last_batch"]["batch"] == total - 1


def test_status_of_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"streamer status: error: {tmp_path} is not a run directory (no config.json): "
                   "give the --run-dir of a learner"]


def test_a_failed_runs_status_says_its_error_on_one_line():
    """What status.json's "stopped: failed: ..." says: streamer's own errors in their words, gloo's less its
    C++ source location, Python's own with their type (a bare KeyError('x') said only 'x')."""
    from streamer.learner import _said
    from streamer.source import SourceError

    assert _said(SourceError("cannot reach Kafka at 127.0.0.1:9 (no answer for 2 s; --broker-timeout)")) == (
        "cannot reach Kafka at 127.0.0.1:9 (no answer for 2 s; --broker-timeout)")
    assert _said(KeyError("x")) == "KeyError: 'x'"
    assert _said(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
                              "[127.0.0.1]:29500")) == "RuntimeError: Connection closed by peer [127.0.0.1]:29500"
    assert _said(ValueError()) == "ValueError"


def test_a_wait_for_streams_is_said_once_it_has_lasted_a_minute_with_the_streams_it_adds_and_its_end():
    """A stream far slower than the others is waited for at each of its windows, briefly: not said."""
    from types import SimpleNamespace

    from streamer.result_consumers import WaitsSaid

    loop = SimpleNamespace(streams_waited_for=(), intake=SimpleNamespace(ahead_windows=256),
                           waiting_for_records_since=time.time() - 30)
    lines = []
    say = WaitsSaid(loop, lines.append)
    say()
    loop.streams_waited_for = (1,)
    say()  # 30 s: not yet
    loop.streams_waited_for = ()
    say()
    assert lines == []  # a wait of under a minute: neither it nor its end
    loop.streams_waited_for, loop.waiting_for_records_since = (1,), time.time() - 65
    say(), say()
    loop.streams_waited_for = (1, 2)
    say()
    loop.streams_waited_for = (2,)  # (a rank's report may drop one)
    say()
    loop.streams_waited_for = ()
    say()
    assert [line.split(" while ")[0] for line in lines[:2]] == [
        "the next batch waits for stream 1: no batch for 1m05s", "the next batch waits for streams 1, 2: no batch for 1m05s"]
    assert lines[2] == "streams 1, 2: records came, learning on after 1m05s of waiting" and len(lines) == 3


def test_the_learner_says_once_when_the_truth_headers_have_named_more_classes_than_the_notice_limit(tmp_path):
    """The learner's results consumer says once that the truth headers named more classes than the
    tracker's notice limit (a stream of en, fr, en, ... with a limit of 1), and the loss log keeps each."""
    from monitor.live import LiveMonitor
    from streamer.batching import Batcher
    from streamer.checkpointer import Checkpointer
    from streamer.config import LearnConfig
    from streamer.loop import PrequentialLoop
    from streamer.result_consumers import consume_results
    from tests.helpers import naive, small_stream
    from tests.test_loop import CORPUS, MemorySource

    class Quiet:
        def update(self, *_args, **_kw):
            pass

    records = small_stream(CORPUS, fragments=4, mean_tokens=200, streams=2, window=10, seed=1)[0]
    lines = []

    async def go():
        loop = PrequentialLoop(naive(), Batcher(2, 10), MemorySource(records), total_records=len(records))
        monitor = LiveMonitor(run="r", strategy="naive")
        monitor.run_tracker.class_limit = 1
        checkpointer = Checkpointer(tmp_path / "checkpoint.pt", 60.0, config=LearnConfig("b:9092", "t", tmp_path),
                                    loop=loop, monitor=monitor)
        await consume_results(loop, monitor, checkpointer, None, tmp_path, Quiet(), final_probe=False, log=lines.append)

    asyncio.run(go())
    logged = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert {row["domain_name"] for row in logged} == {"en", "fr"}
    second = "fr" if logged[0]["domain_name"] == "en" else "en"
    assert lines == [f"the truth headers have named more than 1 classes (the next: {second!r}): each is kept apart "
                     "for the life of the run, about 1 KB of memory and 0.2 KB of every checkpoint a class; a "
                     "header with a value per record (an id) is not a class (README: How a stream looks)"]


def test_a_resumed_runs_status_shows_the_learners_start_and_the_runs(tmp_path, capsys):
    """config.json's `started` is the running learner's start, `run_started` the run's: a resumed run
    keeps its first (before, each restart wrote over it, and status showed the restart as the run's start)."""
    from types import SimpleNamespace

    import torch

    from streamer.config import LearnConfig
    from streamer.learner import write_run_config

    config = LearnConfig(bootstrap_servers="127.0.0.1:1", topic="t", run_dir=tmp_path)
    built = SimpleNamespace(kind="lm", details={})
    write_run_config(config, torch.device("cpu"), 10, built)
    first = json.loads((tmp_path / "config.json").read_text())
    assert first["run_started"] == first["started"]
    (tmp_path / "config.json").write_text(json.dumps({**first, "started": first["started"] - 3600,
                                                      "run_started": first["started"] - 3600}))
    write_run_config(config, torch.device("cpu"), 10, built, resumed=True)
    again = json.loads((tmp_path / "config.json").read_text())
    assert again["run_started"] == first["started"] - 3600 and again["started"] >= first["started"]
    assert main(["status", str(tmp_path)]) == 0
    shown = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first["started"] - 3600))
    assert f" (the run: {shown})" in capsys.readouterr().out


def test_the_status_of_a_finished_compare_run_says_it_is_over(tmp_path, capsys):
    """compare deletes a run's checkpoint once its report is written, and multitask writes no status.json:
    status said 'checkpoint: none yet' and 'no status.json yet', as of a run about to start."""
    config = {"topic": "t", "group_id": "g", "strategy": "multitask", "model_name": "lstm",
              "bootstrap_servers": "x:1", "device": "cpu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "results.json").write_text("{}")
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: none (the run is over: its report is results.json)" in out
    assert "console: no status.json (the run's report is results.json)" in out  # (it said why, and wrongly)

    # a run of compare's that wrote status.json: its checkpoint's age was shown from it, stale, once deleted
    from dataclasses import replace

    from monitor.console import write_status
    from monitor.view import io_line
    from tests.test_view import SNAPSHOT

    write_status(tmp_path / "status.json", replace(SNAPSHOT, activity="stopped", checkpoint_age_s=0.0))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint_age none " in out and "checkpoint_age 0s" not in out
    assert "checkpoint none  " in io_line(replace(SNAPSHOT, activity="stopped", checkpoint_age_s=None)).plain
    (tmp_path / "status.json").unlink()

    # a report of a learner still running (before its first checkpoint) writes results.json too: not over
    import subprocess
    import sys

    learner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "streamer"])
    try:  # until it has exec'd: before, its command line is this test's, and status said "no learner running"
        deadline = time.monotonic() + 30
        while b"streamer" not in Path(f"/proc/{learner.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / ".lock").write_text(str(learner.pid))
        assert main(["status", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"learner running (pid {learner.pid})" in out and "checkpoint: none yet" in out, out
    finally:
        learner.kill()
        learner.wait()


def test_the_metrics_line_leaves_out_reasons_at_0_and_says_when_the_counters_restarted(capsys):
    """Every dead-letter reason is exported at 0 from the start: status listed all 13; and after a crash's
    restart the batch counter counts this learner's own, below the loss log's, with nothing to say why."""
    from streamer.cli.status import _print_metrics

    values = {"batches": 1072.0, "dead letters": {"bad_key": 2.0, "bad_utf8": 0.0, "nul_byte": 0.0}, "lag": {"0": 0}}
    _print_metrics({"url": "http://h:1/metrics", "values": values}, logged=3194)
    line = capsys.readouterr().out
    assert "batches 1,072 (since this learner's start: a restart after a crash starts the counters at 0)" in line
    assert "dead letters bad_key 2" in line and "bad_utf8" not in line and "lag 0 0" in line
    _print_metrics({"url": "http://h:1/metrics", "values": {**values, "batches": 3194.0}}, logged=3194)
    assert "since this learner's start" not in capsys.readouterr().out


def test_the_json_status_of_a_diverged_run_is_strict_json(tmp_path, capsys):
    """`streamer status --json` printed bare Infinity for a diverged run's perplexity (not JSON to jq and others)."""
    from dataclasses import replace

    from monitor.console import write_status
    from tests.test_view import SNAPSHOT

    config = {"topic": "t", "group_id": "g", "strategy": "naive", "model_name": "lstm", "bootstrap_servers": "x:1",
              "device": "cpu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "losses.jsonl").write_text(json.dumps({"batch": 0, "loss": 1e5, "domain_name": "en"}) + "\n")
    write_status(tmp_path / "status.json", replace(SNAPSHOT, rolling_ppl=float("inf")))
    assert main(["status", str(tmp_path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"non-standard {name}"))
    assert status["status"]["rolling_ppl"] == "inf"


def test_the_metrics_line_counts_the_runs_dead_letters_after_a_crashs_restart():
    """After a crash the dead-letter counters start again at 0: status's metrics line said 0 beside a
    console (status.json) that had the run's; it reads the gauge of the run's totals now."""
    from monitor.exporter import create_metrics, serve
    from monitor.live import LiveMonitor
    from streamer.cli.status import _scrape

    before = LiveMonitor(run="r", strategy="naive", metrics=create_metrics(), dead_letter_reasons=("bad_utf8",))
    for _ in range(3):
        before.dead_letter("bad_utf8")
    restarted = LiveMonitor(run="r", strategy="naive", metrics=create_metrics(), dead_letter_reasons=("bad_utf8",))
    restarted.load_state_dict(before.state_dict(), counters=False)
    server, _ = serve(restarted.metrics, 0)
    try:
        values = _scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics", 5, {})["values"]
    finally:
        server.shutdown()
    assert values["dead letters"] == {"bad_utf8": 3} == restarted.dead_letters


def test_the_console_of_a_status_written_before_snapshots_said_oracle_says_it_from_config(capsys, monkeypatch):
    """status.json's snapshot carries `oracle` (the learner is told); one written before it did still gets
    the panel's "(oracle: told the class)" title from the run's config.json."""
    from monitor.console import as_console, snapshot_to_json
    from monitor.live import LiveMonitor
    from streamer.cli.status import _print_console

    written = snapshot_to_json(as_console(LiveMonitor(run="r", strategy="independent").run_tracker.snapshot()))
    written.pop("oracle")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws the panel, as on a terminal
    monkeypatch.setenv("COLUMNS", "120")
    _print_console({"status": written, "checkpoint_age_s": None, "status_age_s": 1.0,
                    "learner": {"running": False}, "config": {"oracle": True}})
    assert "strategy independent (oracle: told the class)" in capsys.readouterr().out
