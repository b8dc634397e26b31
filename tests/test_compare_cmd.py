"""`streamer compare`: strategies on the same stream per seed through the real broker, then Table 1."""

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamer.cli import parse as parse_flags
from streamer.cli.compare import compare_config
from streamer.cli.compare import run as run_compare_command
from streamer.compare_plan import CompareError, plan, strategy_names
from streamer.strategies import STRATEGIES
from tests.conftest import write_corpus
from tests.helpers import stat_fields

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]

TINY = ["--fragments", "4", "--lambda", "600", "--streams", "3", "--window", "10", "--hidden", "16",
        "--embedding", "8", "--probe-tokens", "2000", "--probe-every", "40"]
MANIFEST = {"n_fragments": 4, "classes": ["cs", "en", "fr"]}  # enough for the plan's checks


def rows(path):
    return [json.loads(line) for line in (path / "losses.jsonl").read_text().splitlines()]


def test_two_strategies_two_seeds_through_the_broker(broker, tmp_path, capfd):
    """Run side by side (--jobs 2, spawned processes, one torch thread each): the tables, and the
    same per-batch losses as the same runs one after the other in this process (--jobs 1)."""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    common = ["compare", "--corpus", str(corpus), "--strategies", "naive,multitask", "--bootstrap-servers",
              broker.bootstrap_servers, "--from-fragment", "all", *TINY]
    assert run_compare_command(parse_flags([*common, "--seeds", "0,1", "--out", str(out), "--jobs", "2"])) == 0
    printed = capfd.readouterr().out  # the job processes write to the same descriptor
    assert "4 runs, 2 at a time" in printed and "1 torch thread" in printed
    assert printed.count("naive seed ") == 2 and printed.count("multitask seed ") == 2

    alone = tmp_path / "alone"
    assert run_compare_command(parse_flags([*common, "--seeds", "0", "--out", str(alone), "--jobs", "1"])) == 0
    assert "at a time" not in capfd.readouterr().out
    for name in ("naive", "multitask"):
        parallel, sequential = rows(out / f"{name}-seed0"), rows(alone / f"{name}-seed0")
        assert [(r["loss"], r["train_loss"]) for r in parallel] == [(r["loss"], r["train_loss"]) for r in sequential]

    truths = {}
    for seed in (0, 1):
        manifest = json.loads((out / "streams" / f"seed{seed}" / "manifest.json").read_text())
        naive, multitask = rows(out / f"naive-seed{seed}"), rows(out / f"multitask-seed{seed}")
        assert len(naive) == len(multitask) == manifest["total_batches"]
        # the Kafka run and the offline shuffled run saw the same batches, logged in stream order
        truths[seed] = [(r["domain_name"], r["sequence"]) for r in naive]
        assert truths[seed] == [(r["domain_name"], r["sequence"]) for r in multitask]
        assert sorted(r["trained_at"] for r in multitask) == list(range(len(multitask)))
        assert [r["trained_at"] for r in multitask] != list(range(len(multitask)))
        for name in ("naive", "multitask"):
            run = out / f"{name}-seed{seed}"
            assert (run / "results.json").is_file() and not (run / "checkpoint.pt").exists()
            config = json.loads((run / "config.json").read_text())
            assert config["seed"] == seed and config["torch_threads"] == 1  # each job's own thread
    assert truths[0] != truths[1]  # one stream per seed

    table = (out / "table1.md").read_text()
    lines = table.splitlines()
    assert lines[2].startswith("| naive | 2 | ") and lines[3].startswith("| multitask (reference) | 2 | ")
    assert lines[2].split("|")[-2] == lines[3].split("|")[-2]  # the same model size
    assert "±" in lines[2].split("|")[3]  # ppl: mean ± std over the two seeds
    assert "| naive | 2/2 |" in (out / "forgetting.md").read_text()
    comparison = json.loads((out / "comparison.json").read_text())
    assert [s["strategy"] for s in comparison["strategies"]] == ["naive", "multitask"]
    assert {"table1.md", "forgetting.md", "after_switch.png"} <= set(comparison["files"])
    assert [s["name"] for s in json.loads((out / "plan.json").read_text())["strategies"]] == ["naive", "multitask"]
    assert table in printed


def test_a_failed_job_is_one_line_and_a_dead_one_is_said():
    from streamer.jobs import run_jobs

    seen = []
    outcomes = run_jobs(job_for_the_test, [("ok",), ("raise",), ("die",)], jobs=2,
                        on_outcome=lambda index, outcome: seen.append(index))
    assert sorted(seen) == [0, 1, 2]
    assert outcomes[0].value == ("ok", 1) and outcomes[0].error is None  # one torch thread in the job
    assert outcomes[1].error == "ValueError: bad value on two lines"
    assert outcomes[2].error == "the job's process ended without a result (exit status 9)"


def job_for_the_test(what: str, path: str = ""):
    """Runs in a spawned job process (importable by name)."""
    import atexit
    import logging
    import os
    import time

    import torch

    if what == "raise":
        raise ValueError("bad value\non two lines")
    if what == "die":
        os._exit(9)
    if what == "slow exit":
        atexit.register(time.sleep, float(path or 3))
    if what == "after":  # the file `path` exists, then says so in `path`.done
        while not Path(path).exists():
            time.sleep(0.02)
        Path(f"{path}.done").touch()
    if what == "levels":
        return logging.getLogger().level, logging.getLogger("aiokafka").getEffectiveLevel()
    if what == "sleep":
        Path(path).write_text(str(os.getpid()))
        time.sleep(120)
    if what == "report":  # stopped, it writes `path`.report for a second, as a stopped run writes its report
        try:
            Path(path).write_text(str(os.getpid()))
            time.sleep(120)
        except KeyboardInterrupt:
            time.sleep(1)
            Path(f"{path}.report").write_text("written")
            raise
    return what, torch.get_num_threads()


def test_a_jobs_outcome_is_taken_before_its_process_has_ended():
    """A job's process takes a while to end after it has sent its outcome (its interpreter's exit): an
    interrupt then lost an outcome already received, and compare left that finished run out of its
    tables. The outcome is kept, and on_outcome called, first."""
    from streamer.jobs import run_jobs

    alive = []

    def seen(index, outcome):
        alive.extend(process.is_alive() for process in multiprocessing.active_children()
                     if process.name == "streamer-job-0")
    outcomes = run_jobs(job_for_the_test, [("slow exit",)], jobs=1, on_outcome=seen)
    assert outcomes[0].value == ("slow exit", 1) and alive == [True]
    assert not [process for process in multiprocessing.active_children() if process.name == "streamer-job-0"]


def test_an_interrupt_keeps_the_outcomes_sent_while_a_job_was_ending(tmp_path):
    """Job 0 sends its outcome and takes 6 s to exit; job 1 sends its own just after. An interrupt while
    the parent waited for job 0 to end lost job 1's outcome, which it never read: the parent waits for
    no job that has sent its outcome until the end, and takes what was sent when it is stopped."""
    from streamer.jobs import run_jobs

    go, seen = tmp_path / "go", {}

    def interrupt_once_job_1_has_returned():
        while not Path(f"{go}.done").exists():
            time.sleep(0.02)
        time.sleep(1.5)  # its outcome sent
        os.kill(os.getpid(), signal.SIGALRM)

    def taken(index, outcome):
        seen[index] = outcome.value
        if index == 0:
            go.touch()  # job 1 returns now, while job 0 is still ending
            threading.Thread(target=interrupt_once_job_1_has_returned, daemon=True).start()

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_jobs(job_for_the_test, [("slow exit", "6"), ("after", str(go))], jobs=2, on_outcome=taken)
    finally:
        signal.signal(signal.SIGALRM, before)
    assert seen == {0: ("slow exit", 1), 1: ("after", 1)}
    assert not [process for process in multiprocessing.active_children() if process.name.startswith("streamer-job")]


def test_a_job_stopped_by_sigterm_writes_what_it_can_through_a_second_one_and_says_so(tmp_path):
    """A process group's SIGTERM (`timeout`, systemd) reaches every job and the command, which then sends
    its own: that second one ended a job halfway through its report. And a job stopped by anyone but the
    command (a user's kill) came back as 'exit status 0'."""
    from streamer.jobs import run_jobs

    pid_file = tmp_path / "job.pid"

    def twice():
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.02)
        job = int(pid_file.read_text())
        os.kill(job, signal.SIGTERM)
        time.sleep(0.3)
        os.kill(job, signal.SIGTERM)
    threading.Thread(target=twice, daemon=True).start()
    outcomes = run_jobs(job_for_the_test, [("report", str(pid_file))], jobs=1)
    assert outcomes[0].error == "stopped by SIGTERM"
    assert (tmp_path / "job.pid.report").read_text() == "written"


def test_an_interrupt_while_a_large_task_is_sent_stops_that_job_too(capfd):
    """A job's task (multitask's carries its whole stream) went with the process's start, which waits
    until the child has read it, after its imports: an interrupt then left a child the parent did not
    hold, blocked on a task that never came, and a traceback once the parent exited."""
    from streamer.jobs import run_jobs

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_jobs(job_for_the_test, [("ok", "x" * 5_000_000)], jobs=1)
        deadline = time.monotonic() + 10
        while spawned_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not spawned_children()
        assert "Traceback" not in capfd.readouterr().err  # (UnpicklingError: pickle data was truncated)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        for pid in spawned_children():
            os.kill(pid, signal.SIGKILL)


def spawned_children(parent: int | None = None) -> list[int]:
    """The children of `parent` (this process) that multiprocessing spawned (not its resource tracker)."""
    found, parent = [], parent or os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_fields(stat)
            if fields and int(fields[1]) == parent and running(int(stat.parent.name)):
                if b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                    found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_ctrl_c_as_the_jobs_start_is_the_parents_alone_and_no_job_prints_a_traceback(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group. A job in its first few tenths of a second (a
    fresh interpreter importing multiprocessing's bootstrap and this package, before it could ignore
    SIGINT) raised KeyboardInterrupt there and printed its traceback. The jobs now start with SIGINT
    blocked (the parent's own is held for the few milliseconds of a start, then taken): the parent
    stops them, one line."""
    tasks = [("sleep", str(tmp_path / "a")), ("sleep", str(tmp_path / "b"))]
    script = ("import sys\nfrom streamer.jobs import run_jobs\nfrom tests.test_compare_cmd import job_for_the_test\n"
              "try:\n"
              f"    run_jobs(job_for_the_test, {tasks!r}, jobs=2)\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted', file=sys.stderr)\n"
              "    sys.exit(130)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (starting := [job for job in spawned_children(parent.pid) if catches(job, signal.SIGINT)]):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
        # the job's interpreter has begun (its handler is set) and is importing: the Ctrl-C's signal reaches
        # it first (the parent's answer, SIGTERM, could end it before its handler ran), then the parent's
        os.kill(starting[0], signal.SIGINT)
        time.sleep(1)
        os.killpg(parent.pid, signal.SIGINT)
        _, err = parent.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
    assert (parent.returncode, err) == (130, "interrupted\n")


def test_a_job_killed_before_it_has_read_its_task_is_its_one_line_error():
    """The task goes through the job's pipe once it runs; a job killed before it has read a large one
    (out of memory as it starts) broke that pipe, and the BrokenPipeError stopped every job and left
    compare without a word (the command takes it for a reader of its output that went away)."""
    from streamer.jobs import run_jobs

    def kill_the_job_once_it_exists():
        deadline = time.monotonic() + 30
        while not (children := spawned_children()) and time.monotonic() < deadline:
            time.sleep(0.002)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
    threading.Thread(target=kill_the_job_once_it_exists, daemon=True).start()
    outcomes = run_jobs(job_for_the_test, [("ok", "x" * 20_000_000)], jobs=1)
    assert outcomes[0].error == "the job's process ended without a result (killed by SIGKILL: out of memory?)"


def test_a_job_whose_function_cannot_be_loaded_there_is_one_line(tmp_path, monkeypatch, capfd):
    """The job's function is loaded by name in its process: a module that is not there (gone since the
    command started) was a traceback from the job and 'exit status 1'."""
    from streamer.jobs import run_jobs

    (tmp_path / "gone_since.py").write_text("def job():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_since

    (tmp_path / "gone_since.py").unlink()
    outcomes = run_jobs(gone_since.job, [()], jobs=1)
    assert outcomes[0].error == "ModuleNotFoundError: No module named 'gone_since'"
    assert "Traceback" not in capfd.readouterr().err
    sys.modules.pop("gone_since")


def test_a_job_logs_as_its_parent_does():
    """A spawned job is a fresh interpreter: without the parent's levels, aiokafka's warnings reached the
    terminal from every job while the command's own one-line messages were meant to stand alone."""
    from streamer.jobs import run_jobs

    root, quiet = logging.getLogger(), logging.getLogger("aiokafka")
    before, handlers = quiet.level, root.handlers[:]
    quiet.setLevel(logging.CRITICAL + 1)
    braces = logging.StreamHandler()
    braces.setFormatter(logging.Formatter("{name}: {message}", style="{"))  # a format of another style
    root.handlers[:0] = [braces]
    try:
        outcomes = run_jobs(job_for_the_test, [("levels",)], jobs=1)
    finally:
        quiet.setLevel(before)
        root.handlers[:] = handlers
    assert outcomes[0].value == (logging.getLogger().level, logging.CRITICAL + 1), outcomes


def test_a_kill_9_of_the_parent_leaves_no_job_running(tmp_path):
    """The jobs are the parent's daemons, which ends them only when it exits itself: killed with -9, they
    ran on (a compare's runs to their end, for hours), then failed to send. They get SIGTERM from the
    kernel when the parent dies (Linux), taken as Ctrl-C."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    pid_file = tmp_path / "job.pid"
    script = ("from streamer.jobs import run_jobs; from tests.test_compare_cmd import job_for_the_test; "
              f"run_jobs(job_for_the_test, [('sleep', {str(pid_file)!r})], jobs=1)")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
            time.sleep(0.05)
        job = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while running(job) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(job)
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid_file.exists() and pid_file.read_text() and running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert "Traceback" not in parent.stderr.read()


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (an interpreter's, once it has begun)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has)."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields is not None and fields[0] != "Z"


def test_strategies_all_skips_what_cannot_run_and_names_why(tmp_path, monkeypatch, capsys):
    class NeedsAnotherModel:
        def __init__(self, model, lr=1e-3, clip=1.0):
            raise ValueError("needs --model hf-causal")

    monkeypatch.setitem(STRATEGIES, "picky", NeedsAnotherModel)
    names, by_all = strategy_names("all")
    assert by_all and names[-1] == "multitask" and {"naive", "independent", "picky"} <= set(names)
    config = compare_config(parse_flags(["compare", "--hidden", "8", "--embedding", "4"]))
    by_all = dataclasses.replace(config, strategies=("naive", "picky", "multitask"), chosen_by_all=True)
    planned, skipped = plan(by_all, MANIFEST)
    assert [p.name for p in planned] == ["naive", "multitask"]
    assert skipped == {"picky": "needs --model hf-causal"}
    assert "skipping picky: needs --model hf-causal" in capsys.readouterr().out
    with pytest.raises(CompareError, match="strategy picky: needs --model hf-causal"):
        plan(dataclasses.replace(config, strategies=("naive", "picky"), chosen_by_all=False), MANIFEST)
    with pytest.raises(CompareError, match="unknown nope"):
        strategy_names("naive,nope")
    with pytest.raises(CompareError, match="'all' stands alone"):
        strategy_names("all,naive")


def test_params_budget_applies_per_strategy_in_the_plan(capsys):
    config = compare_config(parse_flags(["compare", "--params", "60000", "--embedding", "8", "--set", "n_experts=3",
                                          "--strategies", "naive,poe,multitask"]))
    planned, _ = plan(config, MANIFEST)
    hidden = {p.name: p.hidden for p in planned}
    assert hidden["poe"] < hidden["naive"] == hidden["multitask"]
    assert dict(planned[1].options) == {"n_experts": 3} and planned[0].options == ()
    out = capsys.readouterr().out
    assert out.count("--params 60,000:") == 3
    assert out.count("--params 60,000: naive with") == 1 and "--params 60,000: multitask (a naive learner) with" in out


def test_learn_points_multitask_to_compare(capsys):
    with pytest.raises(SystemExit):
        parse_flags(["learn", "--strategy", "multitask"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "streamer compare --strategies naive,multitask" in err


def stopped(command: list[str], cwd, ready, stop) -> tuple[int, str]:
    """Start `command` (in a session of its own), call stop(process) once ready() holds; its exit status
    and stderr."""
    compare = subprocess.Popen(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert compare.poll() is None and time.monotonic() < deadline, compare.communicate()
            time.sleep(0.05)
        stop(compare)
        _, err = compare.communicate(timeout=60)
    finally:
        if compare.poll() is None:
            compare.kill()
    return compare.returncode, err


def test_sigterm_stops_the_parallel_runs_each_with_the_report_of_what_it_learned(broker, tmp_path):
    """SIGTERM (or Ctrl-C) stops a parallel compare as it stops one run alone: every run writes the report
    of the batches it learned and names its directory in one line (a job was ended by the signal's default
    action, with no report), and the command ends 130. The SIGTERM goes to the process group, as `timeout`
    and systemd send it: each job gets it, and then the command's own, which must not end it mid-report."""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "streamer", "compare", "--corpus", str(corpus), "--strategies", "naive,replay",
               "--bootstrap-servers", broker.bootstrap_servers, "--jobs", "2", "--out", str(out), "--no-probe",
               *TINY[:TINY.index("--probe-tokens")], "--fragments", "30", "--lambda", "2000", "--from-fragment", "all",
               "-k", "4"]
    logs = [out / f"{name}-seed0" / "losses.jsonl" for name in ("naive", "replay")]
    returncode, err = stopped(command, tmp_path, lambda: all(log.exists() and log.stat().st_size for log in logs),
                              lambda compare: os.killpg(compare.pid, signal.SIGTERM))
    assert returncode == 130, err
    total = json.loads((out / "streams" / "seed0" / "manifest.json").read_text())["total_batches"]
    for log in logs:
        learned = len(log.read_text().splitlines())
        assert 0 < learned < total and f"report of the batches learned so far in {log.parent}" in err, err
        results = json.loads((log.parent / "results.json").read_text())
        assert results["run"] == str(log.parent)
        # the comparison's span and k (the report of an interrupted run took the defaults: fragments >= 15)
        assert results["span"]["from_fragment"] == 0 and results["metrics"]["k"] == 4
    assert "Traceback" not in err and "Unclosed" not in err and len(err.strip().splitlines()) == 3, err


def test_the_default_jobs_share_the_cpus_among_each_runs_threads(monkeypatch):
    """Each job has --threads N torch threads (or a user's OMP_NUM_THREADS, as the thread policy takes it),
    so the default is the CPUs divided by N: --threads 4 on 2 CPUs ran 2 jobs of 4 threads each."""
    from streamer.threads import available_cpus

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = available_cpus()
    default = compare_config(parse_flags(["compare"]))
    assert (default.jobs, default.job_threads) == (cpus, 1)
    threaded = compare_config(parse_flags(["compare", "--threads", "2"]))
    assert (threaded.jobs, threaded.job_threads) == (max(1, cpus // 2), 2)
    monkeypatch.setenv("OMP_NUM_THREADS", str(cpus + 1))
    crowded = compare_config(parse_flags(["compare"]))
    assert (crowded.jobs, crowded.job_threads) == (1, cpus + 1)
    assert compare_config(parse_flags(["compare", "--jobs", "3", "--threads", "1"])).jobs == 3


def test_an_interrupted_multitask_run_says_what_it_had_learned_and_exits_cleanly(tmp_path):
    """The i.i.d. reference learns the stream shuffled, so its losses are whole only at the end: a Ctrl-C
    writes no report but says how far it got, in one line. (Its thread was still in a backward pass as
    the command exited, which aborted it: 'terminate called without an active exception', status 134.)"""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "streamer", "compare", "--corpus", str(corpus), "--strategies", "multitask",
               "--out", str(out), "--no-probe", *TINY[:TINY.index("--probe-tokens")], "--fragments", "100",
               "--lambda", "2000"]
    returncode, err = stopped(command, tmp_path, (out / "multitask-seed0" / "config.json").exists,  # as it learns
                              lambda compare: (time.sleep(0.5), compare.send_signal(signal.SIGINT)))
    assert returncode == 130, err
    total = json.loads((out / "streams" / "seed0" / "manifest.json").read_text())["total_batches"]
    (line,) = [line for line in err.splitlines() if "multitask seed 0 had learned" in line]
    learned = int(line.split("had learned ")[1].split(" batches")[0].replace(",", ""))
    assert 0 < learned < total and "writes its report only once it has learned them all" in line
    assert "terminate called" not in err and "Traceback" not in err, err
    assert not (out / "multitask-seed0" / "losses.jsonl").exists()


def test_minutes_bound_the_iid_reference_too_and_its_run_is_noted_not_reported(broker, tmp_path, capfd):
    """--minutes ends every run: the shuffled i.i.d. reference, whose losses are whole only at the end,
    stops at it with a line and a note under the table, and the comparison goes on (before, it learned
    its whole stream whatever --minutes said). The stream's topic is this comparison's own."""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    assert run_compare_command(parse_flags([
        "compare", "--corpus", str(corpus), "--strategies", "naive,multitask", "--bootstrap-servers",
        broker.bootstrap_servers, "--out", str(out), "--jobs", "1", "--minutes", "0.0005", *TINY])) == 0
    printed = capfd.readouterr().out
    assert re.search(r"records in topic compare-\d+-[0-9a-f]{6}-seed0", printed), printed
    (note,) = [line for line in (out / "table1.md").read_text().splitlines() if "multitask" in line]
    assert re.match(r"- skipped multitask \(seed 0\): --minutes 0.0005 ended it after \d+ of its \d+ batches", note)
    assert "the i.i.d. reference reports only a whole stream" in note
    assert not (out / "multitask-seed0" / "losses.jsonl").exists() and (out / "naive-seed0" / "results.json").exists()


def test_an_out_in_use_is_one_line_and_an_interrupted_final_report_keeps_the_checkpoint(
        broker, tmp_path, monkeypatch, capfd):
    """Two comparisons writing one --out wrote one loss log at once: the second is refused in one line.
    A run learned whole whose report a Ctrl-C or SIGTERM interrupts keeps its checkpoint, and a line says
    how to write the report (before, the checkpoint was deleted first and the run was lost)."""
    from streamer.resume import RunDirLock

    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    common = ["--corpus", str(corpus), "--strategies", "naive", "--bootstrap-servers", broker.bootstrap_servers,
              "--out", str(out), *TINY]
    with RunDirLock(out):
        busy = subprocess.run([sys.executable, "-m", "streamer", "compare", *common], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
    assert busy.returncode == 2 and f"{out} is in use by a running comparison (pid {os.getpid()})" in busy.stderr
    assert "another --out" in busy.stderr and "Traceback" not in busy.stderr and not (out / "naive-seed0").exists()

    import monitor.report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(monitor.report, "write_report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_compare_command(parse_flags(["compare", *common]))
    run_dir = out / "naive-seed0"
    said = f"interrupted while writing the report of {run_dir}, learned whole: `streamer report {run_dir}` writes it"
    assert said in capfd.readouterr().err
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "losses.jsonl").stat().st_size


def test_a_failed_run_is_one_line_at_any_jobs_and_the_tables_of_those_before_say_they_are_incomplete(
        broker, tmp_path):
    """--jobs 1 printed a failed run's traceback (exit 1) where --jobs 2 said one line; and the tables of
    the runs that finished before read as a whole comparison: nothing said which planned runs are not in
    them. The thread policy's line is said once the flags hold, by a command whose runs are its own."""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    out.mkdir()
    (out / "replay-seed0").write_text("a file where the run's directory goes")
    command = [sys.executable, "-m", "streamer", "compare", "--corpus", str(corpus), "--strategies", "naive,replay",
               "--seeds", "0,1", "--bootstrap-servers", broker.bootstrap_servers, "--out", str(out), "--jobs", "1",
               "--no-probe", *TINY[:TINY.index("--probe-tokens")]]
    failed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1, failed.stderr
    assert failed.stderr.startswith("streamer compare: error: replay seed 0: FileExistsError: "), failed.stderr
    assert failed.stdout.count("torch threads: 1 ") == 1
    why = f"the comparison ended at an error ({failed.stderr.split('error: ')[1].strip()})"
    table = (out / "table1.md").read_text()
    assert table.startswith(f"**Incomplete: {why}; 3 planned run(s) are not in this table.**")
    assert "| naive | 1 | " in table
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["incomplete"] == why and comparison["left_out"] == {
        name: f"not run to its end: {why}" for name in ("replay (seed 0)", "naive (seed 1)", "replay (seed 1)")}
    written = re.search(r"written to \S+: (.*), plan.json and one directory per run", failed.stdout).group(1)
    assert written.split(", ") == comparison["files"] and all((out / name).is_file() for name in comparison["files"])

    wrong = subprocess.run([*command[:5], "naive,nope"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stdout == "" and wrong.stderr.count("\n") == 1, wrong


def test_compare_takes_the_broker_timeout_its_runs_errors_name():
    """A lost broker's line says --broker-timeout; compare refused that flag (unrecognized arguments)."""
    assert compare_config(parse_flags(["compare", "--broker-timeout", "5"])).learn.broker_timeout_s == 5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_job_that_has_ended_is_reaped_while_the_others_run(tmp_path):
    """A job that had sent its outcome stayed a zombie (`[python] <defunct>` in ps) until another job's
    outcome woke the parent: its end is waited for too."""
    from streamer.jobs import run_jobs

    release, seen = tmp_path / "release", {}

    def state_later(pid: int) -> None:
        deadline = time.monotonic() + 60  # job 0 ends 0.3 s after its outcome (seconds on a loaded machine)
        while (fields := stat_fields(f"/proc/{pid}/stat")) and time.monotonic() < deadline:
            time.sleep(0.1)  # running, ending, or a zombie (which stays one until job 1 ends)
        seen["state"] = fields[0] if fields else "reaped"
        release.touch()  # job 1 ends now

    def on_outcome(index, outcome):
        if index == 0:
            (job,) = [p for p in multiprocessing.active_children() if p.name == "streamer-job-0"]
            threading.Thread(target=state_later, args=(job.pid,), daemon=True).start()
    outcomes = run_jobs(job_for_the_test, [("slow exit", "0.3"), ("after", str(release))], jobs=2,
                        on_outcome=on_outcome)
    assert [o.value[0] for o in outcomes] == ["slow exit", "after"] and seen == {"state": "reaped"}


def test_a_from_fragment_past_the_streams_last_is_one_line_before_any_run(tmp_path):
    """--from-fragment 99 on a 4-fragment stream learned every run to write an all-n/a Table 1."""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    args = parse_flags(["compare", "--corpus", str(corpus), "--strategies", "naive", "--out", str(out), *TINY,
                        "--from-fragment", "99"])
    with pytest.raises(CompareError, match=r"^--from-fragment 99 is past the stream's last fragment: its manifest "
                                           r"has 4 \(0 to 3\); give one of those, 'half' or 'all'$"):
        run_compare_command(args)
    assert not (out / "naive-seed0").exists()


def test_an_out_that_holds_files_is_one_line_before_any_run(tmp_path):
    """A second comparison into one --out wrote over the runs it shared with the first and left the
    others (their folders, their figures) beside its new tables."""
    corpus = write_corpus(tmp_path / "corpus", lines=200)
    out = tmp_path / "out"
    (out / "replay-seed0").mkdir(parents=True)
    (out / "replay-seed0" / "losses.jsonl").write_text("")
    (out / "table1.md").write_text("an earlier comparison's")
    (out / "notes.txt").write_text("the user's")
    args = parse_flags(["compare", "--corpus", str(corpus), "--strategies", "naive", "--out", str(out), *TINY])
    with pytest.raises(CompareError, match=rf"^--out {re.escape(str(out))} holds an earlier comparison \(replay-seed0, "
                                           r"table1.md\): the new tables would sit among its runs; give a new --out"):
        run_compare_command(args)
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt", "replay-seed0", "table1.md"]


def test_each_run_of_a_comparison_has_its_own_group_seed_size_and_strategy():
    """Two strategies on one topic share no consumer group (a second would find the first's committed
    offsets); each seed's run has that seed; the fitted size, the run's name, the idle bound; multitask runs as
    itself, though sized as naive."""
    from streamer.compare_plan import IDLE_TIMEOUT_S, run_config

    config = compare_config(parse_flags(["compare", "--hidden", "8", "--embedding", "4", "--set", "memory_size=30",
                                         "--strategies", "naive,replay,multitask", "--from-fragment", "half"]))
    runs = {name: run_config(config, name, 3, 24, MANIFEST, topic="cmp-seed3", run_dir=Path("out") / f"{name}-seed3")
            for name in ("naive", "replay", "multitask")}
    assert [run.group_id for run in runs.values()] == ["cmp-seed3-naive", "cmp-seed3-replay", "cmp-seed3-multitask"]
    assert {(run.seed, run.model.hidden, run.idle_timeout_s) for run in runs.values()} == {(3, 24, IDLE_TIMEOUT_S)}
    assert [(run.strategy, run.run_name) for run in runs.values()] == [
        ("naive", "naive-seed3"), ("replay", "replay-seed3"), ("multitask", "multitask-seed3")]
    assert dict(runs["replay"].strategy_options)["memory_size"] == 30 and runs["replay"].from_fragment == 2


def test_strategies_are_named_once_each_and_at_least_one():
    with pytest.raises(CompareError, match="names a strategy twice"):
        strategy_names("naive,replay,naive")
    with pytest.raises(CompareError, match=r"unknown \(none given\)"):
        strategy_names(" , ")


def test_all_whose_every_strategy_is_skipped_is_one_line_not_an_empty_comparison(monkeypatch):
    class NeedsAnotherModel:
        def __init__(self, model, lr=1e-3, clip=1.0):
            raise ValueError("needs --model hf-causal")

    monkeypatch.setitem(STRATEGIES, "picky", NeedsAnotherModel)
    config = compare_config(parse_flags(["compare", "--hidden", "8", "--embedding", "4"]))
    with pytest.raises(CompareError, match="no strategy can run on this model: picky: needs --model hf-causal"):
        plan(dataclasses.replace(config, strategies=("picky",), chosen_by_all=True), MANIFEST, log=lambda line: None)
