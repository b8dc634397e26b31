"""SIGTERM and SIGINT stop `streamer learn` cleanly: the step in flight is finished, a checkpoint is
written and committed, the group is left, and the process exits 0 (within 10 s; idle, the run has
stopped within 2 s, before its report and figure are written);
the same command then continues the run to the losses of an uninterrupted one. A second SIGINT
aborts at once (130). Without a manifest or limits the learner waits for records and learns them as
they arrive. Real processes through the embedded broker."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from streamer import checkpoint
from tests.conftest import write_corpus
from tests.learners import line_count, wait_for_lines

STREAMER = [sys.executable, "-m", "streamer.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def produce(broker, corpus: Path, topic: str, manifest: Path, fragments: int = 6, mean_tokens: int = 2500, *extra):
    result = subprocess.run([*STREAMER, "produce", "--corpus", str(corpus), "--bootstrap-servers",
                             broker.bootstrap_servers, "--topic", topic, "--fragments", str(fragments),
                             "--lambda", str(mean_tokens), "--streams", "3", "--window", "10", "--seed", "0",
                             "--manifest", str(manifest), *extra], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def learn_command(broker, topic: str, *extra):
    return [*STREAMER, "learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic,
            "--streams", "3", "--window", "10", "--hidden", "24", "--embedding", "8", "--no-view", "--no-probe",
            *extra]


def stop_with(process, signum) -> float:
    """Send `signum`; the seconds until the process exits."""
    sent = time.monotonic()
    process.send_signal(signum)
    process.wait(timeout=60)
    return time.monotonic() - sent


def timed_lines(process) -> tuple[list, threading.Thread]:
    """The process's output lines as they come, each with the monotonic time it was read, and the thread
    that reads them (it ends with the output)."""
    got = []
    reader = threading.Thread(target=lambda: got.extend((time.monotonic(), line) for line in process.stdout),
                              daemon=True)
    reader.start()
    return got, reader


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("signals") / "corpus")


@pytest.fixture(scope="module")
def reference(broker, corpus, tmp_path_factory):
    """(manifest, total batches, losses) of topic "signals" learned without interruption."""
    root = tmp_path_factory.mktemp("reference")
    manifest = root / "manifest.json"
    produce(broker, corpus, "signals", manifest)
    whole = subprocess.run(learn_command(broker, "signals", "--manifest", str(manifest), "--group", "signals-whole",
                                         "--run-dir", str(root / "whole")),
                           cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (root / "whole" / "losses.jsonl").read_text().splitlines()]
    return manifest, json.loads(manifest.read_text())["total_batches"], losses


def assert_equal_losses(run_dir: Path, total: int, expected: list[float]) -> None:
    got = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert [line["batch"] for line in got] == list(range(total))
    assert max(abs(line["loss"] - loss) for line, loss in zip(got, expected)) <= 1e-4


def test_sigterm_mid_run_checkpoints_and_the_restart_finishes_equal(broker, reference, tmp_path):
    manifest, total, expected = reference
    command = learn_command(broker, "signals", "--manifest", str(manifest))  # the default group and run dir
    run_dir = tmp_path / "runs" / "signals-streamer-signals-naive"
    process = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    wait_for_lines(run_dir / "losses.jsonl", process, total // 3)
    seconds = stop_with(process, signal.SIGTERM)
    output = process.stdout.read()
    process.stdout.close()
    assert process.returncode == 0, output[-3000:]
    assert seconds < 10, f"SIGTERM mid-run took {seconds:.1f}s"
    step = checkpoint.load(run_dir / "checkpoint.pt")["step"]
    assert total // 3 <= step < total and step == line_count(run_dir / "losses.jsonl")
    assert "stopped: signal" in output

    again = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from the checkpoint at batch {step}" in again.stdout
    assert_equal_losses(run_dir, total, expected)
    print(f"SIGTERM at batch {step} of {total}: exit 0 after {seconds:.2f}s")


def test_without_a_manifest_it_learns_records_as_they_arrive_and_sigterm_while_idle_is_quick(broker, corpus, tmp_path):
    """And while it waits for records its checkpoint catches up: the one due at the next result waited for
    a record, so a kill -9 of a quiet daemon lost what it had learned since its last checkpoint."""
    command = learn_command(broker, "arriving", "--checkpoint-every", "1")
    run_dir = tmp_path / "runs" / "arriving-streamer-arriving-naive"
    produce(broker, corpus, "arriving", tmp_path / "first.json", fragments=2, mean_tokens=600)
    process = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    first = wait_for_lines(run_dir / "losses.jsonl", process, 1)
    time.sleep(3)  # the first wave is learned; the learner waits for more
    first = line_count(run_dir / "losses.jsonl")
    produce(broker, corpus, "arriving", tmp_path / "second.json", 2, 600, "--append")  # more of the same
    second = wait_for_lines(run_dir / "losses.jsonl", process, first + 10)
    time.sleep(3)  # idle again
    learned = line_count(run_dir / "losses.jsonl")
    assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == learned  # (before SIGTERM's own checkpoint)
    said, reader = timed_lines(process)
    sent = time.monotonic()
    seconds = stop_with(process, signal.SIGTERM)
    reader.join(timeout=10)
    output = "".join(line for _, line in said)
    assert process.returncode == 0, output[-3000:]
    assert second > first
    # the run itself stops at once (the report's figure then takes most of a second, more on a loaded host)
    stopped = next((at - sent for at, line in said if line.startswith("[stopped: signal]")), None)
    assert stopped is not None and stopped < 2, f"the run stopped {stopped} s after SIGTERM: {output[-2000:]}"
    assert seconds < 10, f"SIGTERM while idle: exit after {seconds:.1f}s"
    assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == line_count(run_dir / "losses.jsonl")
    print(f"learned {first} then {line_count(run_dir / 'losses.jsonl')} batches as records arrived; "
          f"SIGTERM while idle: exit 0 after {seconds:.2f}s")


def test_a_second_sigint_aborts_at_once(broker, corpus, tmp_path):
    manifest = tmp_path / "manifest.json"
    produce(broker, corpus, "aborted", manifest)
    run_dir = tmp_path / "runs" / "aborted-streamer-aborted-naive"
    process = subprocess.Popen(learn_command(broker, "aborted", "--manifest", str(manifest)), cwd=tmp_path, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_lines(run_dir / "losses.jsonl", process, 20)
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    seconds = stop_with(process, signal.SIGINT)
    output = process.stdout.read()
    process.stdout.close()
    assert process.returncode == 130, output[-3000:]
    assert seconds < 2, f"the second SIGINT took {seconds:.1f}s"
    print(f"the second SIGINT: exit 130 after {seconds:.2f}s")


# Learners of another strategy or of the same group beside a running one: tests/test_group.py.


def test_sigterm_before_learning_began_says_so_and_exits_143(broker, tmp_path):
    """Held before the learner exists (its manifest is a pipe nobody writes), a SIGTERM ends the command
    with one line and 143, not by the signal's default action without a word."""
    manifest = tmp_path / "manifest.json"
    os.mkfifo(manifest)
    process = subprocess.Popen(learn_command(broker, "never", "--manifest", str(manifest), "--run-dir",
                                             str(tmp_path / "run")),
                               cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = process.stdout.readline()  # the thread policy's line: the command has started
    assert first.startswith("torch threads:"), first
    time.sleep(0.5)  # it waits on the pipe now
    stop_with(process, signal.SIGTERM)
    output = first + process.stdout.read()
    process.stdout.close()
    assert process.returncode == 143, output[-3000:]
    assert "SIGTERM before learning began" in output and "Traceback" not in output, output[-3000:]
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_sigterm_during_an_import_ends_the_process_there_and_then(tmp_path):
    """torch's C++ initialisation calls back into Python: the SystemExit of a SIGTERM taken there crossed C++
    frames ('terminate called after throwing an instance of pybind11::error_already_set', ~90 lines of stack,
    1 of 28 tries). During an import the handler ends the process at once (no exception is raised: an atexit
    hook of the process does not run), with its one line and 143; outside one it raises SystemExit as before."""
    (tmp_path / "importing.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\n"
                                           "time.sleep(5)\n")
    script = ("import atexit, os, signal, sys\n"
              "from streamer.cli.runs import sigterm_before_learning, unwind_on_sigterm\n"
              "sigterm_before_learning()\natexit.register(lambda: print('exited through Python'))\n"
              "if sys.argv[1] == 'set aside':\n    unwind_on_sigterm('an old run')\n"
              "if sys.argv[1] != 'code':\n    import importing\n"
              "else:\n    os.kill(os.getpid(), signal.SIGTERM)\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), str(tmp_path)])}
    # (once --fresh has set the old run aside, only the unwinding puts it back: it unwinds, import or not)
    for where, through_python in (("import", False), ("code", True), ("set aside", True)):
        done = subprocess.run([sys.executable, "-c", script, where], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 143 and "SIGTERM before learning began" in done.stderr, done.stderr
        assert ("exited through Python" in done.stdout) is through_python and "Traceback" not in done.stderr


def test_after_a_signal_stop_ctrl_c_still_aborts_and_sigterm_is_ignored_while_the_report_is_written():
    """asyncio puts Python's own SIGINT handler back when the run's handlers are removed: a second Ctrl-C
    during the report then raised KeyboardInterrupt inside matplotlib's import (a traceback, status 1,
    once in a full suite) instead of the promised abort. SIGTERM went back to its default: a second one
    (the kernel's, to a rank whose agent died) ended the process without its report."""
    from streamer.run_signals import StopOnSignals

    class Loop:
        stop_reason = None

        def stop(self, reason):
            self.stop_reason = reason

    async def run_stopped_by_sigterm():
        with StopOnSignals((signal.SIGINT, signal.SIGTERM), Loop(), lambda line: None) as stopping:
            stopping._received(signal.SIGTERM)
        return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        handler, on_sigterm = asyncio.run(run_stopped_by_sigterm())
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    # a second SIGTERM (a rank's agent that died sends one) is ignored through the report, as during the stop
    assert on_sigterm == signal.SIG_IGN
    assert handler not in (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN)
    with mock.patch("streamer.run_signals._abort") as aborted:
        handler(signal.SIGINT, None)
    aborted.assert_called_once_with(signal.SIGINT)


def test_a_signal_that_surfaces_as_another_error_is_still_the_signal():
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from streamer.cli.errors import caused_by

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise ImportError("initialization failed") from interrupt  # what a C extension's init gives
    except ImportError as exc:
        assert isinstance(caused_by(exc, KeyboardInterrupt), KeyboardInterrupt)
    try:  # torchrun's agent, SIGTERM landing in its metrics wrapper: the wrapper's finally fails meanwhile
        try:
            raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
        finally:
            start  # noqa: B018, F821 - unbound, as in torch.distributed.elastic.metrics.api
    except NameError as exc:
        assert caused_by(exc, SignalException).sigval == signal.SIGTERM
    assert caused_by(ValueError("a real error"), KeyboardInterrupt) is None


def test_a_ctrl_c_during_freshs_put_back_waits_until_the_old_run_is_whole(tmp_path, monkeypatch):
    """A second Ctrl-C while --fresh put the old run back (its first run ended before a checkpoint) stopped the
    moving midway: the old run was split between its directory and the aside, and the plain command refused
    it. Now the Ctrl-C takes effect once every file is back."""
    from streamer import resume
    from streamer.cli.learn import _fresh_start

    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "losses.jsonl", "status.json", "probes.jsonl"):
        (run / name).write_text(name)
    rename = Path.rename

    def rename_then_ctrl_c(self, target):  # the Ctrl-C comes after the first file moved back
        moved = rename(self, target)
        if target.parent == run and target.name == "config.json":
            os.kill(os.getpid(), signal.SIGINT)
        return moved

    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):
        with _fresh_start(run, None, True) as before_run:
            before_run()
            assert sorted(p.name for p in run.iterdir()) == []
            monkeypatch.setattr(Path, "rename", rename_then_ctrl_c)
            raise KeyboardInterrupt  # the first Ctrl-C, before the new run's first checkpoint
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "losses.jsonl", "probes.jsonl", "status.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # the aside is gone
    assert resume.check_set_aside(run) is None
