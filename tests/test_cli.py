"""The command line as a user meets it: help, one-line errors, the demo, the report, the broker."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import write_corpus

STREAMER = [sys.executable, "-m", "streamer.cli"]
TINY_FLAGS = ["--hidden", "32", "--embedding", "16", "--no-view"]


# Every command these tests start carries this mark in its environment, and so do its Tansu children:
# brokers that other tests (or other checkouts) run on the same machine are not counted.
MARK = f"STREAMER_TEST_CLI_{os.getpid()}"


def streamer(*args, env=None, timeout=240, **kw):
    return subprocess.run([*STREAMER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, MARK: "1", **(env or {})}, **kw)


def tansu_pids() -> set[int]:
    """Tansu processes started by this module's commands (their environment holds MARK)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                if not (cmdline and b"tansu" in Path(cmdline[0].decode(errors="replace")).name.encode()):
                    continue
                if MARK.encode() + b"=" not in (entry / "environ").read_bytes():
                    continue
            except OSError:
                continue
            pids.add(int(entry.name))
    return pids


def test_a_ctrl_c_while_the_commands_modules_load_is_one_line_not_a_traceback():
    """`python -m streamer` (as the `streamer` script: streamer.__main__.run) interrupted while the CLI's
    modules load (its first half second: `-X importtime` says when the first of them is in) ends with
    `streamer: interrupted` and status 130, as later; it printed a KeyboardInterrupt traceback."""
    process = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "streamer", "strategies"], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, MARK: "1"},
                               # as a terminal starts it: a script's background job (as this suite may run in)
                               # passes SIGINT on ignored, and Python then keeps ignoring it
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.rstrip().endswith(("streamer.cli.errors", "streamer.cli")):
            process.send_signal(signal.SIGINT)
            break
    stderr = "".join(lines) + process.stderr.read()
    process.stdout.read()
    assert process.wait(timeout=60) == 130, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.rstrip().endswith("streamer: interrupted"), stderr[-3000:]


@pytest.mark.parametrize("command", ["broker", "data", "produce", "learn", "demo", "report", "compare", "strategies",
                                     "models"])
def test_every_subcommand_has_help(command, capsys):
    from streamer.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert "usage: streamer " + command in capsys.readouterr().out


def test_help_and_a_user_error_load_neither_torch_nor_river_nor_scipy():
    """What `streamer` imports before main() runs is the parser's, and `--help` or a user's error loads no
    more: torch, river and scipy (seconds on 2 cores) load only in the commands that use them. So a rank
    asks for its torchrun agent's death signal (streamer.cli.rank_process) a fraction of a second after
    it starts, not seconds, and a mistyped path is answered as fast. A fresh interpreter, so no other
    test's imports hide the command's own."""
    code = ("import json, sys\nfrom streamer.cli import main\n"
            "loaded = lambda: sorted({name.split('.')[0] for name in sys.modules} & set(sys.argv[1:]))\n"
            "before = loaded()\n"
            "for argv in (['--help'], ['learn', '--help'], ['demo', '--help'], ['compare', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "helped = loaded()\nstatus = main(['report', '/nowhere/run'])\n"
            "print(json.dumps([before, helped, status, loaded()]))")
    heavy = ["torch", "river", "scipy", "transformers", "matplotlib"]
    result = subprocess.run([sys.executable, "-c", code, *heavy], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    before, helped, status, after_the_error = json.loads(result.stdout.splitlines()[-1])
    assert before == helped == after_the_error == [], (before, helped, after_the_error)
    assert (status, result.stderr) == (2, "streamer report: error: /nowhere/run does not exist (give a run "
                                          "directory or a losses.jsonl file)\n")


def test_the_strategies_listing_loads_torch_but_neither_river_nor_scipy():
    """`streamer strategies` reads every strategy's signature (its classes: torch), but the drift
    detectors' river and scipy (about a second on 2 cores) load only when a strategy builds one."""
    code = ("import json, sys\nfrom streamer.cli import main\nstatus = main(['strategies'])\n"
            "print(json.dumps([status, sorted({name.split('.')[0] for name in sys.modules} & set(sys.argv[1:]))]))")
    result = subprocess.run([sys.executable, "-c", code, "torch", "river", "scipy"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [0, ["torch"]]
    assert "ewc: " in result.stdout and "boundary" in result.stdout


@pytest.mark.parametrize("module", ["streamer", "streamer.cli"])
def test_python_dash_m_runs_the_command(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage: streamer" in result.stdout


def test_flag_defaults_come_from_the_configs():
    from streamer.cli import parse
    from streamer.config import LearnConfig
    from streamer.models.catalog import LSTMConfig

    learn = parse(["learn"])
    assert (learn.hidden, learn.embedding, learn.layers, learn.dropout) == (
        LSTMConfig.hidden, LSTMConfig.embedding, LSTMConfig.layers, LSTMConfig.dropout)
    assert (learn.detector, learn.probe_every, learn.checkpoint_every) == (
        LearnConfig.detector, LearnConfig.probe_every, LearnConfig.checkpoint_every_s)
    assert learn.group is None and not learn.fresh  # derived at start: streamer.config.default_group(topic, strategy)
    assert learn.lr is None  # the model's own (streamer.models.catalog)
    demo = parse(["demo"])
    assert (demo.fragments, demo.minutes, demo.metrics_port) == (40, None, 0)  # no time limit: it reaches its table


def _one_clean_line(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unreachable_broker_names_the_address(tmp_path):  # (its runs/ in tmp_path, not in the checkout)
    line = _one_clean_line(streamer("learn", "--bootstrap-servers", "127.0.0.1:9", "--idle-timeout", "1",
                                    "--broker-timeout", "2", *TINY_FLAGS, cwd=tmp_path))
    assert "127.0.0.1:9" in line
    (run_dir,) = (tmp_path / "runs").iterdir()  # `streamer status` says how it ended (it said "joining")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["activity"] == "stopped" and "cannot reach Kafka at 127.0.0.1:9" in status["stop_reason"]
    shown = streamer("status", str(run_dir))
    assert shown.returncode == 0 and "[stopped: failed: cannot reach Kafka at 127.0.0.1:9" in shown.stdout


def test_producer_to_unreachable_broker_names_the_address(tiny_corpus):
    line = _one_clean_line(streamer("produce", "--corpus", str(tiny_corpus), "--bootstrap-servers", "127.0.0.1:9",
                                    "--fragments", "3", "--manifest", str(tiny_corpus / "m.json"),
                                    "--broker-timeout", "2"))
    assert "127.0.0.1:9" in line


def test_missing_corpus_names_the_command_that_builds_it(tmp_path):
    line = _one_clean_line(streamer("produce", "--corpus", "calm-multilingual", env={"STREAMER_CACHE": str(tmp_path)}))
    assert "streamer data build calm-multilingual" in line


def test_bad_flag_value_lists_the_allowed_values():
    line = _one_clean_line(streamer("learn", "--device", "tpu"))
    assert "'auto', 'cpu', 'cuda'" in line
    line = _one_clean_line(streamer("report", "x", "--from-fragment", "middle"))
    assert "'half', 'all'" in line


def test_an_unknown_strategy_option_is_one_line(tmp_path, tiny_corpus):
    line = _one_clean_line(streamer("demo", "--corpus", str(tiny_corpus), "--set", "no_such_option=1",
                                    "--run-dir", str(tmp_path / "run"), *TINY_FLAGS))
    assert "no_such_option" in line and "naive" in line


def test_report_of_a_missing_path_is_one_line(tmp_path):
    line = _one_clean_line(streamer("report", str(tmp_path / "nope")))
    assert "does not exist" in line


def test_a_manifest_produce_cannot_write_is_one_line_before_the_broker_is_asked(tmp_path, tiny_corpus):
    """Before the topic is created (the broker here is nowhere: never reached), so nothing is left behind."""
    (tmp_path / "file").write_text("x")
    line = _one_clean_line(streamer("produce", "--corpus", str(tiny_corpus), "--bootstrap-servers", "127.0.0.1:9",
                                    "--manifest", str(tmp_path / "file" / "m.json"), "--probe-tokens", "0"))
    assert f"--manifest {tmp_path / 'file' / 'm.json'}: {tmp_path / 'file'} is not a folder" in line


def test_demo_runs_end_to_end_and_leaves_no_broker_behind(tmp_path, tiny_corpus, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    before = tansu_pids()
    result = streamer("demo", "--corpus", str(tiny_corpus), "--fragments", "8", "--lambda", "1500",
                      "--run-dir", str(run_dir), *TINY_FLAGS)
    assert result.returncode == 0, result.stderr
    assert tansu_pids() <= before
    for name in ("losses.jsonl", "results.json", "loss_curve.png", "manifest.json", "config.json", "checkpoint.pt"):
        assert (run_dir / name).stat().st_size > 0, name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert len((run_dir / "losses.jsonl").read_text().splitlines()) == manifest["total_batches"]
    assert "| all |" in result.stdout and "ppl@sw" in result.stdout

    report = streamer("report", str(run_dir), "--json", "--from-fragment", "all")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert {"ppl", "ppl@sw", "rec", "per_class"} <= set(data)
    assert set(data["per_class"]) == {"cs", "en", "fr"}
    assert data["n_batches"] == manifest["total_batches"]
    assert data["detection"]["evaluation"]["n_true"] == manifest["n_fragments"] - 1
    assert data["forgetting"]["n_stages"] >= 2  # the demo scored the probe split

    import shutil
    shutil.copytree(run_dir, tmp_path / "again")  # a second run, for the comparison
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    from streamer.cli import main  # (the reports below in this process: `streamer report` ran as one above)

    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["report", str(run_dir), str(tmp_path / "again"), "--from-fragment", "all"]) == 0
    assert "| naive | 2 |" in capsys.readouterr().out
    out = tmp_path / "report"  # beside the runs, not in the current directory
    assert list(elsewhere.iterdir()) == []
    for name in ("table1.md", "forgetting.md", "after_switch.png", "comparison.json", "run/results.json"):
        assert (out / name).stat().st_size > 0, name
    assert main(["report", str(run_dir)]) == 0  # the span the demo learned with (its config.json)
    assert "CALM metrics over fragments >= 4 of 8 (the paper's span: N/2)" in capsys.readouterr().out
    assert main(["report", str(run_dir), "--from-fragment", "all"]) == 0
    assert "fragments >= 0 of 8 (the whole stream; --from-fragment all)" in capsys.readouterr().out


def test_ctrl_c_stops_the_demo_and_its_broker(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", lines=3000)
    before = tansu_pids()
    process = subprocess.Popen([*STREAMER, "demo", "--corpus", str(corpus), "--fragments", "100", "--lambda", "50000",
                                "--run-dir", str(tmp_path / "run"), *TINY_FLAGS],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, MARK: "1"})
    deadline = time.monotonic() + 240  # a bound for a busy machine, not a speed check
    while time.monotonic() < deadline and not (tansu_pids() - before):
        time.sleep(0.1)
    assert tansu_pids() - before, "the demo never started its broker"
    log = tmp_path / "run" / "losses.jsonl"
    while time.monotonic() < deadline and not (log.exists() and log.stat().st_size > 0):
        time.sleep(0.1)
    time.sleep(1)  # inside the learning loop
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr[-2000:]  # a clean stop: the step in flight, a checkpoint, the report
    assert "Traceback" not in stderr
    assert tansu_pids() <= before
    results = json.loads((tmp_path / "run" / "results.json").read_text())  # the report of what was learned
    assert results["whole_stream"]["n_batches"] > 0


def test_broker_command_prints_its_address_and_stops_on_ctrl_c():
    before = tansu_pids()
    # started with SIGINT ignored, as a script's background job is (and as a test worker may pass it on):
    # Ctrl-C must still stop it
    process = subprocess.Popen([*STREAMER, "broker"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, MARK: "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    line = process.stdout.readline()
    assert line.startswith("broker listening on 127.0.0.1:")
    address = line.split()[3]
    host, port = address.rsplit(":", 1)
    import socket
    socket.create_connection((host, int(port)), timeout=2).close()
    assert tansu_pids() - before
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=30)
    assert process.returncode == 130
    assert tansu_pids() <= before


def test_cli_choices_match_the_registries():
    from monitor.drift import DETECTORS
    from streamer.cli.data import WEIGHTS_CHOICES
    from streamer.cli.flags import DETECTOR_CHOICES, MODEL_CHOICES, STRATEGY_CHOICES
    from streamer.models import MODELS
    from streamer.models.weights import WEIGHTS
    from streamer.strategies import STRATEGIES

    assert tuple(sorted(STRATEGIES)) == STRATEGY_CHOICES
    assert tuple(sorted(MODELS)) == MODEL_CHOICES
    assert tuple(sorted([*DETECTORS, "none"])) == DETECTOR_CHOICES
    assert tuple(sorted(WEIGHTS)) == WEIGHTS_CHOICES


def test_an_error_after_the_broker_started_still_stops_it(tmp_path, tiny_corpus):
    before = tansu_pids()  # (a vocabulary file that is not there: refused when the model is built)
    line = _one_clean_line(streamer("demo", "--corpus", str(tiny_corpus), "--fragments", "4", "--model", "lstm-word",
                                    "--model-opt", f"vocab={tmp_path / 'none.txt'}", "--run-dir", str(tmp_path / "run"),
                                    *TINY_FLAGS))
    assert "cannot read the vocabulary file" in line
    assert tansu_pids() <= before


def test_the_learning_rate_defaults_by_model_and_a_given_one_wins(tmp_path):
    from streamer.cli import parse
    from streamer.cli.configs import learn_config

    def lr(*flags):
        args = parse(["learn", "--topic", "t", *flags])
        return learn_config(args, bootstrap="x:1", topic="t", group="g", run_dir=tmp_path, manifest=None).lr

    assert lr() == 2e-3
    assert lr("--model", "lstm-word") == 2e-3
    assert lr("--model", "hf-classifier") == 5e-5 and lr("--model", "hf-causal") == 5e-5
    assert lr("--model", "hf-classifier", "--lr", "1e-4") == 1e-4


def test_produce_writes_its_manifest_under_the_cache_and_says_what_it_decided(tmp_path, monkeypatch, capsys, broker):
    """Nothing in the current directory; recycling and the probe split said in one line each."""
    from streamer.cli import main
    from streamer.cli.runs import default_manifest_path

    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": f"utterance {i} here", "class": "ab"[i % 2]}) + "\n"
                            for i in range(40)))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "cache"))
    assert main(["produce", "--corpus", str(data), "--bootstrap-servers", broker.bootstrap_servers, "--topic", "own",
                 "--fragments", "4", "--lambda", "60", "--probe-examples", "3", "--no-truth-topic"]) == 0
    out = capsys.readouterr().out
    assert list(cwd.iterdir()) == []
    manifest = default_manifest_path("own")
    assert manifest == tmp_path / "cache" / "streams" / "own.manifest.json" and manifest.is_file()
    assert (manifest.parent / "own.manifest.probe").is_dir()
    recycled = next(line for line in out.splitlines() if line.startswith("recycled:"))
    assert "times over" in recycled
    probe = next(line for line in out.splitlines() if line.startswith("probe split:"))
    assert "3 utterances of each of 2 classes" in probe and "--probe-examples 0" in probe


def test_a_probe_split_too_large_names_the_flag(tmp_path):
    from producers.schedule import Schedule
    from streamer.cli.errors import UserError
    from streamer.cli.runs import prepare_and_say

    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": f"u {i}", "class": "ab"[i % 2]}) + "\n" for i in range(20)))
    with pytest.raises(UserError, match="--probe-examples 0"):
        prepare_and_say(data, Schedule(n_fragments=2, mean_tokens=20), tmp_path / "m.json", log=print,
                        probe_examples=50)
    corpus = write_corpus(tmp_path / "text", lines=5)
    with pytest.raises(UserError, match="--probe-tokens 0"):
        prepare_and_say(corpus, Schedule(n_fragments=2, mean_tokens=200, probe_tokens=10**6), tmp_path / "m2.json",
                        log=print)


def test_the_probe_split_line_says_the_bytes_held_out_where_whole_lines_took_more(tmp_path):
    """The split takes the last whole lines of about --probe-tokens bytes: calm-multidomain's encyclopedia
    (an article a line) gave 56,105 bytes for 5000, and the line said "5000 bytes of each of 4 classes"."""
    from producers.schedule import Schedule
    from streamer.cli.runs import prepare_and_say

    corpus = tmp_path / "text"
    corpus.mkdir()
    (corpus / "long.txt").write_text("".join(f"line {i} " + "word " * 400 + "\n" for i in range(20)))
    (corpus / "short.txt").write_text("".join(f"line {i} word word word\n" for i in range(2000)))
    said = []
    _, manifest = prepare_and_say(corpus, Schedule(n_fragments=2, mean_tokens=200, probe_tokens=300),
                                  tmp_path / "m.json", log=said.append)
    sizes = sorted(entry["bytes"] for entry in manifest["probe"]["classes"].values())
    assert sizes[0] < 450 < 2000 < sizes[1]
    probe = next(line for line in said if line.startswith("probe split:"))
    assert probe.startswith(f"probe split: the last whole lines, {sizes[0]:,} to {sizes[1]:,} bytes "
                            "(--probe-tokens 300), of each of 2 classes held out")
    (corpus / "long.txt").write_text("".join(f"line {i} word word word\n" for i in range(2000)))  # short lines
    prepare_and_say(corpus, Schedule(n_fragments=2, mean_tokens=200, probe_tokens=300), tmp_path / "m2.json",
                    log=said.append)
    assert said[-1].startswith("probe split: 300 bytes of each of 2 classes held out")


def test_a_from_fragment_past_the_manifests_last_is_one_line(tmp_path):
    """--from-fragment 99 on an 8-fragment stream scored nothing: an empty table titled 'fragments >= 99'."""
    from streamer.cli import parse
    from streamer.cli.configs import learn_config
    from streamer.cli.errors import UserError

    manifest = {"n_fragments": 8, "streams": 4, "window": 20}

    def start(*flags):
        args = parse(["learn", "--topic", "t", *flags])
        return learn_config(args, bootstrap="x:1", topic="t", group="g", run_dir=tmp_path, manifest=manifest,
                            log=lambda line: None).from_fragment

    assert (start(), start("--from-fragment", "all"), start("--from-fragment", "7")) == (4, 0, 7)
    with pytest.raises(UserError, match=r"^--from-fragment 8 is past the stream's last fragment: its manifest "
                                        r"has 8 \(0 to 7\); give one of those, 'half' or 'all'$"):
        start("--from-fragment", "8")


def test_fresh_moves_the_old_run_only_once_the_model_is_built_and_never_a_folder_of_other_files(tmp_path):
    """--fresh moved the old run aside before the model was built: a flag the model refused (here a
    vocabulary file that is not there) left the run moved and the plain command refused (the group's offsets, no checkpoint); so did a
    run that failed before its first checkpoint (an unreachable broker). `--run-dir .` was a traceback (an
    empty name), and a folder of the user's own files would have been moved whole (one with a config.json
    of its own too). A bad --metrics-host with port 0 (the demo's) was a traceback after the move."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "losses.jsonl").write_text("")
    learn = ["learn", "--bootstrap-servers", "127.0.0.1:9", "--broker-timeout", "1", "--streams", "2", "--window",
             "5", *TINY_FLAGS]
    line = _one_clean_line(streamer(*learn, "--run-dir", "run", "--fresh", "--model", "lstm-word", "--model-opt",
                                    f"vocab={tmp_path / 'none.txt'}", cwd=tmp_path))
    assert "cannot read the vocabulary file" in line
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "losses.jsonl"]  # where it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "config.json").write_text("{}")
    line = _one_clean_line(streamer(*learn, "--run-dir", ".", "--fresh", cwd=folder))
    assert line.endswith(f"--fresh: {folder} holds 2 file(s) (config.json, notes.txt) but not a run's (config.json "
                         "with status.json, losses.jsonl or checkpoint.pt); not moving them: give an empty or new "
                         "--run-dir")
    assert (folder / "notes.txt").read_text() == "mine"

    back = streamer(*learn, "--run-dir", ".", "--fresh", cwd=run)  # the run's own folder
    assert "127.0.0.1:9" in _one_clean_line(back)  # moved, then the broker is unreachable: put back
    assert f"the new run ended before its first checkpoint; the old run is back in {run}" in back.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "run"]
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "losses.jsonl"]
    assert (run / "config.json").read_text() == "{}"

    line = _one_clean_line(streamer(*learn, "--metrics-host", "999.1.1.1", "--metrics-port", "0", cwd=tmp_path))
    assert line.startswith("streamer learn: error: --metrics-port 0: cannot bind 999.1.1.1:0 (")


def test_an_old_runs_loss_log_without_checkpoint_moves_aside_and_back_and_a_folder_of_other_files_stays(tmp_path):
    """A plain `learn` in a run directory that holds an old run's loss log but no checkpoint wrote over it (the
    new run's log starts afresh); now its files move aside as --fresh moves them (here the broker is
    unreachable, so they come back), and a folder whose loss log is not a run's is refused in one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")  # (no status.json: nothing says the run never checkpointed)
    (run / "losses.jsonl").write_text('{"batch": 0, "loss": 5.5}\n{"batch": 1, "loss": 5.4}\n')
    learn = ["learn", "--bootstrap-servers", "127.0.0.1:9", "--broker-timeout", "1", "--streams", "2", "--window",
             "5", *TINY_FLAGS]
    back = streamer(*learn, "--run-dir", "run", cwd=tmp_path)
    assert "127.0.0.1:9" in _one_clean_line(back)
    assert re.search(rf"^run dir run holds a loss log of 2 batches but no checkpoint: its files moved to "
                     rf"{re.escape(str(run))}\.replaced-\S+; a new run starts$", back.stdout, re.M), back.stdout
    assert f"the new run ended before its first checkpoint; the old run is back in {run}" in back.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "losses.jsonl"]
    assert (run / "losses.jsonl").read_text().count("\n") == 2

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "losses.jsonl").write_text('{"batch": 0, "loss": 5.5}\n')
    line = _one_clean_line(streamer(*learn, "--run-dir", ".", cwd=folder))
    assert line.endswith(f"no checkpoint, and a new run would write over a loss log of 1 batch: {folder} holds 2 "
                         "file(s) (losses.jsonl, notes.txt) but not a run's (config.json with status.json, "
                         "losses.jsonl or checkpoint.pt); not moving them: give an empty or new --run-dir"), line
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "losses.jsonl", "notes.txt"]


def test_a_classifier_on_a_stream_of_running_text_is_one_line(tmp_path):
    """--model hf-classifier on a text topic dead-lettered every record (no label) and waited for more."""
    from streamer.cli import parse
    from streamer.cli.configs import learn_config
    from streamer.cli.errors import UserError

    def config(level):
        args = parse(["learn", "--topic", "t", "--model", "hf-classifier"])
        return learn_config(args, bootstrap="x:1", topic="t", group="g", run_dir=tmp_path, log=lambda line: None,
                            manifest={"n_fragments": 8, "streams": 4, "window": 1, "level": level})

    with pytest.raises(UserError, match=r"^--model hf-classifier learns labelled utterances, and the manifest is of "
                                        r"running text \(level byte\): produce an utterance corpus"):
        config("byte")
    assert config("utterance").model_name == "hf-classifier"


def test_demo_and_compare_give_up_on_an_unreachable_broker_after_broker_timeout(tmp_path, tiny_corpus):
    """Their producer ignored --broker-timeout: a minute of silence, then a line that said 60 s."""
    for command in (["demo", "--run-dir", str(tmp_path / "run"), *TINY_FLAGS],
                    ["compare", "--strategies", "naive", "--out", str(tmp_path / "cmp"), "--hidden", "32",
                     "--embedding", "16"]):
        started = time.monotonic()
        done = streamer(*command, "--corpus", str(tiny_corpus), "--fragments", "4", "--bootstrap-servers",
                        "127.0.0.1:9", "--broker-timeout", "2", timeout=60)
        line = _one_clean_line(done)
        assert "127.0.0.1:9" in line and "2 s" in line and time.monotonic() - started < 40, (command[0], line)
        if command[0] == "demo":  # on the user's cluster: the topic it makes is named
            assert re.search(r"^topic demo-\d+ on 127.0.0.1:9 \(new\), learned by group demo-\d+-learner$",
                             done.stdout, re.M), done.stdout
