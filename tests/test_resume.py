"""A restart continues the same run: `streamer learn` killed with SIGKILL after a checkpoint and run
again with the same command gives, batch for batch, the losses of an uninterrupted run (each batch
once, to 1e-4 nats), and the loss-log lines written before each kill up to its checkpoint are kept,
not learned again. Real processes through the embedded broker; the default group and run directory
(derived from the topic and strategy) are what the restarts find."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamer import checkpoint
from tests.conftest import write_corpus
from tests.helpers import until_stopped

STREAMER = [sys.executable, "-m", "streamer.cli"]
TOPIC = "resume"
STRATEGY_FLAGS = {
    "naive": [],
    "poe": ["--set", "n_experts=3", "--set", "gate_steps=5", "--set", "warmup_batches=10"],
    "replay": ["--set", "r_interval=5", "--set", "n_replay=4", "--set", "memory_size=30"],
    "ewc": [],
    "mbpa": ["--set", "r_interval=5", "--set", "n_replay=4", "--set", "memory_size=30", "--set", "neighbours=4",
             "--set", "local_steps=2"],
}
KILLS = {"naive": 3}  # the other strategies: one kill each, to keep the test short
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def stream(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    corpus = write_corpus(root / "corpus")
    manifest = root / "manifest.json"
    result = subprocess.run([*STREAMER, "produce", "--corpus", str(corpus), "--bootstrap-servers",
                             broker.bootstrap_servers, "--topic", TOPIC, "--fragments", "6", "--lambda", "2500",
                             "--streams", "3", "--window", "10", "--seed", "0", "--manifest", str(manifest)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return root, manifest


def learn_command(broker, manifest, strategy, *extra):
    return [*STREAMER, "learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", TOPIC,
            "--manifest", str(manifest), "--streams", "3", "--window", "10", "--hidden", "24", "--embedding", "8",
            "--strategy", strategy, *STRATEGY_FLAGS[strategy], "--no-view", "--no-probe", "--checkpoint-every", "0.1",
            *extra]


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def checkpoint_step(path: Path) -> int:
    return checkpoint.load(path)["step"] if path.exists() else 0


def kill_after_checkpoint(command, cwd: Path, run_dir: Path, at_least: int, timeout_s: float = 180):
    """Start `command`, wait for a checkpoint past batch `at_least`, freeze the process, note the loss
    log and the checkpoint's step, then SIGKILL it. Returns (lines before the kill, checkpoint step)."""
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        # a torch.load of the checkpoint costs ~8 ms of CPU, every 20 ms 40% of a core taken from the learner:
        # read only once the log is past `at_least`, and only a checkpoint written since the last read
        path, read = run_dir / "checkpoint.pt", None
        while True:
            assert process.poll() is None, f"the learner exited early: {process.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint past batch %d" % at_least
            written = path.stat().st_mtime_ns if path.exists() else None
            if written != read and len(read_lines(run_dir / "losses.jsonl")) > at_least:
                read = written
                if checkpoint_step(path) > at_least:
                    break
            time.sleep(0.02)
        time.sleep(0.1)  # a few batches past the checkpoint, to be learned again after the restart
        process.send_signal(signal.SIGSTOP)  # frozen: the log and the checkpoint are read as they stand
        until_stopped(process.pid)
        lines, step = read_lines(run_dir / "losses.jsonl"), checkpoint_step(run_dir / "checkpoint.pt")
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
    return lines, step


# naive (three kills) runs by default; the other strategies (one kill each, about 50 s apiece) are `slow`.
@pytest.mark.parametrize("strategy", [name if name == "naive" else pytest.param(name, marks=pytest.mark.slow)
                                      for name in sorted(STRATEGY_FLAGS)])
def test_sigkill_and_restart_give_the_losses_of_an_uninterrupted_run(strategy, broker, stream):
    root, manifest = stream
    total = json.loads(manifest.read_text())["total_batches"]
    started = time.monotonic()
    whole_dir = root / f"whole-{strategy}"
    whole = subprocess.run(learn_command(broker, manifest, strategy, "--group", f"whole-{strategy}",
                                         "--run-dir", str(whole_dir)),
                           cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = [json.loads(line) for line in read_lines(whole_dir / "losses.jsonl")]
    assert len(expected) == total

    # the default group and run directory; metrics on (an ephemeral port): counters after a crash start at 0
    command = learn_command(broker, manifest, strategy, "--metrics-port", "0")
    run_dir = root / "runs" / f"{TOPIC}-streamer-{TOPIC}-{strategy}"
    kills = KILLS.get(strategy, 1)
    before_kills, step = [], 0
    for kill in range(kills):
        # past 1/8, 2/8 and 3/8 of the stream (naive; one kill: 1/4), with a checkpoint every 0.1 s (100-200 of
        # these batches apart on the 2-core VM), so every kill lands well before the end: with 1/5..3/5 and 0.5 s,
        # a kill sometimes came at the final checkpoint, and the next restart had nothing left to learn
        target = max(step, total * (kill + 1) // (2 * kills + 2))
        lines, step = kill_after_checkpoint(command, root, run_dir, at_least=target)
        assert len(lines) >= step  # every learned batch was logged before the checkpoint covering it
        before_kills.append((lines, step))
    last = subprocess.run(command, cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resuming from the checkpoint at batch {step}" in last.stdout
    assert ("the counters start at 0 (the run's last learner did not stop at its checkpoint's batch "
            f"{step}") in last.stdout
    again = subprocess.run(command, cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"resuming from the checkpoint at batch {total}" in again.stdout, again.stderr
    assert "counters start at 0" not in again.stdout  # after a clean stop the counters continue

    got = [json.loads(line) for line in read_lines(run_dir / "losses.jsonl")]
    assert [line["batch"] for line in got] == list(range(total))  # each batch once, in order
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, expected))
    assert worst <= 1e-4, f"{strategy}: largest difference {worst:.3g} nats"
    assert [(a["domain_name"], a["sequence"]) for a in got] == [(b["domain_name"], b["sequence"]) for b in expected]
    final = read_lines(run_dir / "losses.jsonl")
    for lines, step in before_kills:  # kept as written (their time stamps too), not learned again
        assert final[:step] == lines[:step]
    print(f"{strategy}: {kills} kill(s) at batches {[s for _, s in before_kills]} of {total}; "
          f"largest loss difference {worst:.2g}; {time.monotonic() - started:.0f}s")


def test_a_resumed_learners_first_scrape_holds_its_restored_counters(broker, stream):
    """After a clean stop the counters continue from the checkpoint's totals, and no scrape sees them at 0
    first: the exporter is served once the run is restored (a scrape between saw 0, then the totals, and
    increase() counted the whole run again)."""
    import socket
    import urllib.request

    root, manifest = stream
    run_dir = root / "clean-resume"
    flags = ["--group", "clean-resume", "--run-dir", str(run_dir), "--no-probe"]
    first = subprocess.run(learn_command(broker, manifest, "naive", *flags, "--max-batches", "30", "--metrics-port",
                                         "0"), cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(learn_command(broker, manifest, "naive", *flags, "--max-batches", "60",
                                             "--metrics-port", str(port)),
                               cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scraped, deadline = None, time.monotonic() + 120
    try:
        while scraped is None and process.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                scraped = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                               if line.startswith("streamer_batches_learned_total{"))
            except OSError:
                time.sleep(0.005)
        output = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    assert process.returncode == 0 and "resuming from the checkpoint at batch 30" in output, output[-3000:]
    assert "counters start at 0" not in output and scraped is not None and scraped >= 30, (scraped, output[-2000:])


def test_a_file_too_large_or_a_full_disk_is_one_line_and_the_same_command_continues(broker, stream):
    """A disk that refuses a write (full, a quota; here the file-size limit, whose EFBIG takes the same
    path) ended the learner with chained tracebacks (torch's "unexpected pos" for the checkpoint) and exit 1,
    leaving checkpoint.pt.partial behind. Now: one line naming the file, exit 2, nothing half-written, and
    the same command continues the run, each batch once."""
    import resource

    root, manifest = stream
    total = json.loads(manifest.read_text())["total_batches"]
    run_dir = root / "full-disk"
    command = learn_command(broker, manifest, "naive", "--group", "full-disk", "--run-dir", str(run_dir))
    first = subprocess.run([*command, "--max-batches", "200"], cwd=root, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert re.search(r"^model lstm-char, strategy naive: [\d,]+ parameters on (cpu|cuda\S*) \(--device auto: "
                     r"(no|a) CUDA device here\)$", first.stdout, re.M), first.stdout  # said, not only in config.json
    # the loss log may grow 86 lines; the checkpoint (over 90 kB, more than the log) is refused at its next write
    limit = (run_dir / "losses.jsonl").stat().st_size + 20_000
    assert (run_dir / "checkpoint.pt").stat().st_size > limit

    def limited() -> None:  # a write past `limit` bytes fails with EFBIG (not SIGXFSZ's kill)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run(command, cwd=root, env=ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=limited)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    (line,) = full.stderr.splitlines()
    assert re.fullmatch(rf"streamer learn: error: {re.escape(str(run_dir))}/\S+: File too large \(errno EFBIG\); "
                        rf"once it can be written, the same command continues from the last checkpoint in "
                        rf"{re.escape(str(run_dir))}", line), line
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".partial") or re.match(r"\..*\.\d+$", p.name)]
    step = checkpoint_step(run_dir / "checkpoint.pt")
    assert step == 200 and "checkpoint.pt: File too large" in line

    again = subprocess.run([*command, "--max-batches", "300"], cwd=root, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and f"resuming from the checkpoint at batch {step}" in again.stdout, again.stderr
    got = [json.loads(line)["batch"] for line in read_lines(run_dir / "losses.jsonl")]
    assert got == list(range(300))  # each batch once, in order
    print(f"the refused write: {line}; resumed at {step} of {total}")


def test_an_old_run_without_its_checkpoint_is_set_aside_not_written_over(broker, stream):
    """A run directory whose checkpoint is gone (removed, lost) but which holds the run's loss log and report:
    a plain `learn` in a group without committed offsets (another group; an idle group's offsets expired) said
    "no checkpoint yet" and its new run wrote over the old run's losses.jsonl and results.json, silently. Now
    the old run's files move aside as --fresh moves them, said in one line, and the new run starts."""
    root, manifest = stream
    run_dir = root / "lost-checkpoint"
    command = learn_command(broker, manifest, "naive", "--run-dir", str(run_dir), "--max-batches", "40")
    first = subprocess.run([*command, "--group", "lost-a"], cwd=root, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    old = {name: (run_dir / name).read_bytes() for name in ("losses.jsonl", "results.json", "config.json")}
    assert len(old["losses.jsonl"].splitlines()) == 40
    (run_dir / "checkpoint.pt").unlink()

    # in its own group, whose committed offsets are the lost checkpoint's: refused, and the old run is back
    refused = subprocess.run([*command, "--group", "lost-a"], cwd=root, env=ENV, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "committed offsets" in refused.stderr, refused.stderr[-3000:]
    assert f"the new run ended before its first checkpoint; the old run is back in {run_dir}" in refused.stdout
    assert {name: (run_dir / name).read_bytes() for name in old} == old
    assert not [p.name for p in root.iterdir() if p.name.startswith("lost-checkpoint.replaced-")]

    again = subprocess.run([*command, "--group", "lost-b"], cwd=root, env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no checkpoint yet" not in again.stdout
    (moved,) = re.findall(rf"^run dir {re.escape(str(run_dir))} holds a loss log of 40 batches but no checkpoint: "
                          r"its files moved to (\S+); a new run starts$", again.stdout, re.M)
    aside = Path(moved)
    assert aside.parent == run_dir.parent and aside.name.startswith("lost-checkpoint.replaced-")
    assert {name: (aside / name).read_bytes() for name in old} == old  # the old run, whole
    assert not (aside / "checkpoint.pt").exists()
    got = [json.loads(line)["batch"] for line in read_lines(run_dir / "losses.jsonl")]
    assert got == list(range(40)) and checkpoint_step(run_dir / "checkpoint.pt") == 40  # the new run's own


def test_a_kill_9_before_the_first_checkpoint_restarts_the_same_run_in_place(broker, stream):
    """The case the above must leave alone: a learner killed (kill -9, out of memory) before its first
    checkpoint and restarted by systemd with the same command. Its loss log holds batches the restart learns
    again, seeded, from the topic's beginning: nothing moves aside (a crash loop would leave a copy a
    restart), and the log ends as an uninterrupted run's, each batch once."""
    root, manifest = stream
    batches = 400
    whole_dir = root / "whole-before-first"
    whole = subprocess.run(learn_command(broker, manifest, "naive", "--group", "whole-before-first", "--run-dir",
                                         str(whole_dir), "--max-batches", str(batches)),
                           cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = [json.loads(line) for line in read_lines(whole_dir / "losses.jsonl")]

    run_dir = root / "killed-before-first"
    command = [*learn_command(broker, manifest, "naive", "--group", "killed-before-first", "--run-dir",
                              str(run_dir), "--max-batches", str(batches)), "--checkpoint-every", "3600"]
    process = subprocess.Popen(command, cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    try:
        while len(read_lines(run_dir / "losses.jsonl")) < 20:
            assert process.poll() is None, f"the learner exited early: {process.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, "no 20 batches logged"
            time.sleep(0.005)
        process.send_signal(signal.SIGSTOP)
        until_stopped(process.pid)
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
    logged = len(read_lines(run_dir / "losses.jsonl"))
    assert 20 <= logged < batches and not (run_dir / "checkpoint.pt").exists()

    restart = subprocess.run(command, cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert re.search(r"no checkpoint yet \(its learner stopped before its first checkpoint; a loss log of \d+ "
                     r"batch(es)? is logged again\)", restart.stdout), restart.stdout[-3000:]
    assert "moved to" not in restart.stdout
    assert not [p.name for p in root.iterdir() if p.name.startswith("killed-before-first.replaced-")]
    got = [json.loads(line) for line in read_lines(run_dir / "losses.jsonl")]
    assert [line["batch"] for line in got] == list(range(batches))  # each batch once, in order
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, expected))
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"


def test_two_set_asides_within_one_second_keep_both_old_runs(tmp_path, monkeypatch):
    """--fresh twice in one second (or a moved-aside old run, then --fresh): the second set-aside took the
    first's `<name>.replaced-<second>` and failed in a traceback. Each now gets its own directory."""
    from streamer import resume

    monkeypatch.setattr(resume.time, "strftime", lambda *_: "20261130-070000")  # both in the same second
    run_dir = tmp_path / "run"
    asides = []
    for number in (1, 2, 3):
        run_dir.mkdir(exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({"attempt": number}))
        (run_dir / "status.json").write_text("{}")
        (run_dir / ".lock").write_text("")
        asides.append(resume.set_aside(run_dir))
    assert [p.name for p in asides] == ["run.replaced-20261130-070000", "run.replaced-20261130-070000-2",
                                        "run.replaced-20261130-070000-3"]
    assert [json.loads((p / "config.json").read_text())["attempt"] for p in asides] == [1, 2, 3]
    assert [p.name for p in run_dir.iterdir()] == [".lock"]


def test_a_resume_keeps_the_probe_rows_scored_before_its_step_and_stops_at_a_torn_or_broken_row(tmp_path):
    """A checkpoint at step 5: rows of batches 3 and 4 stay; the probe at 5 is scored again after the restart
    (kept, it was in the log twice), and nothing after it stays. A row cut short by a crash (no newline) or
    not JSON ends what is kept, whatever its batch."""
    from streamer.resume import trim_logs

    def probes(*rows):
        (tmp_path / "probes.jsonl").write_text("".join(rows), encoding="utf-8")

    def row(batch, end="\n"):
        return json.dumps({"batch": batch, "scores": {"en": 1.0}}) + end

    probes(row(3), row(4), row(5), row(5), row(7))
    assert trim_logs(tmp_path, 5) == (0, 2)
    assert (tmp_path / "probes.jsonl").read_text() == row(3) + row(4)
    probes(row(3), "{not json\n", row(4))
    assert trim_logs(tmp_path, 5) == (0, 1)
    probes(row(3), row(4, end=""))
    assert trim_logs(tmp_path, 5) == (0, 1)
    assert (tmp_path / "probes.jsonl").read_text() == row(3)


def test_fresh_moves_only_a_runs_directory_not_one_with_a_config_json_of_its_own(tmp_path):
    """A model's or a project's folder has a config.json of its own; a run's has it beside status.json, its
    loss log or its checkpoint. --fresh (set_aside) refuses the others and moves a run's."""
    from streamer.resume import set_aside

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.safetensors").write_text("")
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "status.json").write_text("{}")
    for folder in (model, stray):
        with pytest.raises(ValueError, match="not a run's"):
            set_aside(folder)
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "weights.safetensors"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "losses.jsonl").write_text("")
    aside = set_aside(run)
    assert sorted(p.name for p in aside.iterdir()) == ["config.json", "losses.jsonl"] and not any(run.iterdir())


def _status(run_dir, checkpoint_age_s):
    required = dict(run="r", strategy="naive", batches=40, total_batches=None, last_loss=1.0, rolling_ppl=2.0,
                    recent_losses=[], recent_switches=[], current_class=None, overall={}, per_class={},
                    from_fragment=0, switches=0, detected_switches=0, tokens_per_s=0.0, lag=0, queue_depth=0,
                    dead_letters=0, elapsed_s=1.0)
    (run_dir / "status.json").write_text(json.dumps({**required, "checkpoint_age_s": checkpoint_age_s}))


def test_an_old_run_without_a_checkpoint_is_its_own_only_when_it_never_checkpointed_with_this_configuration(
        tmp_path):
    """(words, own) of old_run_without_checkpoint: its loss log's batches (0 to 39: 40 batches); its own run
    (restarted in place) only when its status says no checkpoint was written and its config.json is this
    run's; a checkpoint written then lost, or another configuration, is an old run to set aside. A probe log
    alone is a run's history too."""
    from streamer.checkpoint import plain
    from streamer.config import LearnConfig
    from streamer.resume import old_run_without_checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = LearnConfig(bootstrap_servers="x:1", topic="t", run_dir=run_dir)
    assert old_run_without_checkpoint(run_dir, config) == (None, False)
    (run_dir / "probes.jsonl").write_text(json.dumps({"batch": 0, "scores": {}}) + "\n")
    assert old_run_without_checkpoint(run_dir, config) == ("probes.jsonl", False)
    (run_dir / "losses.jsonl").write_text("".join(json.dumps({"batch": b, "loss": 1.0}) + "\n" for b in range(40)))
    (run_dir / "config.json").write_text(json.dumps(plain(config)))
    _status(run_dir, None)
    assert old_run_without_checkpoint(run_dir, config) == ("a loss log of 40 batches", True)
    assert old_run_without_checkpoint(run_dir, dataclasses.replace(config, lr=0.5)) == ("a loss log of 40 batches",
                                                                                        False)
    _status(run_dir, 12.0)  # it had checkpointed: its checkpoint.pt was removed or lost
    assert old_run_without_checkpoint(run_dir, config) == ("a loss log of 40 batches", False)


def test_putting_an_old_run_back_keeps_the_lock_and_removes_the_folder_it_was_set_aside_in(tmp_path):
    from streamer.resume import put_back

    run_dir, aside = tmp_path / "run", tmp_path / "run.replaced"
    run_dir.mkdir()
    aside.mkdir()
    (run_dir / ".lock").write_text("123")
    (run_dir / "status.json").write_text("new")
    (run_dir / "plots").mkdir()
    (aside / "status.json").write_text("old")
    (aside / "losses.jsonl").write_text("old log")
    put_back(run_dir, aside)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "losses.jsonl", "status.json"]
    assert (run_dir / "status.json").read_text() == "old" and (run_dir / ".lock").read_text() == "123"
    assert not aside.exists()


def test_a_run_directorys_lock_names_its_holder_alone(tmp_path):
    """The lock file holds the pid of the learner that has it, not those that held it before."""
    from streamer.resume import RunDirBusy, RunDirLock

    (tmp_path / ".lock").write_text("999999999")
    with RunDirLock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
        with pytest.raises(RunDirBusy, match=rf"in use by a running learner \(pid {os.getpid()}\)"):
            with RunDirLock(tmp_path):
                pass
