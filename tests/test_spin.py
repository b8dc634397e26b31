"""streamer.spin: OpenMP's spins follow whether other work shares the learner's CPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamer.spin import Reader, SpinGovernor, busy_ticks, in_passing, watchable

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")


def stat_text(cpu0: int, cpu1: int) -> str:
    """A /proc/stat with two CPUs whose busy ticks (user + system here) are `cpu0` and `cpu1`."""
    return (f"cpu  {cpu0 + cpu1} 0 0 900 0 0 0 0 0 0\n"
            f"cpu0 {cpu0 - 5} 0 5 400 7 0 0 3 0 0\n"  # iowait and steal are not busy
            f"cpu1 {cpu1} 0 0 500 0 0 0 0 0 0\n"
            "intr 1 2 3\n")


def test_busy_ticks_add_the_busy_fields_of_the_cpus_asked_for(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(stat_text(120, 300))
    assert busy_ticks({0}, str(stat)) == 120
    assert busy_ticks({0, 1}, str(stat)) == 420
    assert busy_ticks({0}, str(tmp_path / "none")) is None


def test_a_read_is_kept_only_when_it_came_on_time(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(stat_text(100, 0))
    tick = os.sysconf("SC_CLK_TCK")
    reader = Reader({0}, every_s=0.6, stat=str(stat))  # reads kept 0.3-0.9 s apart: a loaded CI host oversleeps
    stat.write_text(stat_text(100 + tick // 4, 0))  # a quarter CPU second on cpu0, none of it this (sleeping) process's
    time.sleep(0.6)
    others, seconds = reader.read()
    assert others == pytest.approx(0.25, abs=0.02) and seconds == pytest.approx(0.6, abs=0.3)
    stat.write_text(stat_text(100 + 3 * tick, 0))  # three CPU seconds in a gap three reads long (the process was
    time.sleep(1.8)  # stopped, say): not a read of what shares the CPUs while this process runs
    assert reader.read() is None
    stat.write_text(stat_text(100 + 3 * tick, 0))  # and the next read starts from the end of the gap
    time.sleep(0.6)
    others, _ = reader.read()
    assert others == pytest.approx(0.0, abs=0.02)


def test_the_spins_go_short_on_a_shared_window_and_long_after_calm_reads():
    governor = SpinGovernor(window=3, shared_above=0.75, alone_below=0.5, calm_reads=2)
    try:
        assert not governor.decide(0.05, 0.1) and not governor.decide(0.05, 0.1)  # the window is not full yet
        assert not governor.decide(0.05, 0.1) and not governor.shared  # 0.15 / 0.3 = 0.5 CPUs: ours
        assert governor.decide(0.2, 0.1) and governor.shared  # (0.05 + 0.05 + 0.2) / 0.3 = 1.0 CPUs: shared
        assert not governor.decide(0.0, 0.1)  # (0.05 + 0.2 + 0) / 0.3 = 0.83: still shared
        assert not governor.decide(0.0, 0.1)  # (0.2 + 0 + 0) / 0.3 = 0.67: not under 0.5, no calm read
        assert not governor.decide(0.0, 0.1)  # 0.0: one calm read
        assert not governor.decide(0.18, 0.1)  # 0.6: the calm reads start again
        assert not governor.decide(0.0, 0.1) and not governor.decide(0.0, 0.1)  # 0.6, 0.6
        assert not governor.decide(0.0, 0.1) and governor.shared  # 0.0: one calm read
        assert governor.decide(0.0, 0.1) and not governor.shared  # two in a row: the long spins are back
        assert governor.switches == 2
    finally:
        governor.stop()


def test_stopping_the_governor_ends_its_parked_thread():
    import threading

    def spin_threads() -> set[threading.Thread]:
        return {thread for thread in threading.enumerate() if thread.name.startswith("streamer-spin")}

    before = spin_threads()  # an in-process command run earlier in this worker keeps its own governor
    governor = SpinGovernor(window=1)
    assert governor.decide(2.0, 0.1) and governor.shared  # 20 CPUs of others: short, a thread parks a team
    assert any(thread.name == "streamer-spin-team" for thread in spin_threads() - before)
    governor.stop()
    assert not governor.shared and spin_threads() - before == set()
    governor.stop()  # again: nothing


AT_EXIT = """
import atexit, sys, threading
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(2)
# registered first, so it runs after the governor's own handler (atexit runs them last in, first out)
atexit.register(lambda: print(sorted(t.name for t in threading.enumerate() if t.name.startswith("streamer-spin"))))
from streamer.spin import govern
governor = govern()
for _ in range(governor.window):
    governor.decide(2.0, 0.1)  # others take 20 CPUs: the spins go short and a thread parks a team
print(governor.shared, flush=True)
sys.exit(2)  # as a learner's one-line error does, with the team parked
"""


def test_the_governor_is_stopped_at_the_interpreters_exit(tmp_path):
    """A thread left inside torch's C++ at exit aborts the process ("terminate called without an
    active exception"): the governor's atexit handler ends its watcher and its parked thread first."""
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT.format(root=str(ROOT)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.split()) == (2, ["True", "[]"]), done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_in_passing_returns_or_raises_in_the_callers_thread():
    assert in_passing(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        in_passing(lambda: 1 / 0)


def test_watchable_only_where_proc_stat_lists_every_cpu(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(stat_text(1, 1))
    assert watchable({0, 1}, str(stat)) and watchable({1}, str(stat))
    assert not watchable({0, 2}, str(stat))  # renumbered, say, inside a container
    assert not watchable({0}, str(tmp_path / "none"))


INTERRUPTED = """
import signal, sys, threading, time
# as the streamer command does (streamer.cli.runs): a test run started as a script's background job
# passes SIGINT on ignored, and Python then keeps it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
import torch
from streamer.spin import in_passing
stop, ended = threading.Event(), threading.Event()

def work():  # torch's C++ most of the time, as a model's build or a multitask run
    started = time.monotonic()
    while time.monotonic() - started < 3 and not ({stoppable} and stop.is_set()):
        torch.randn(256, 256) @ torch.randn(256, 256)
    time.sleep(0.5)  # winding down, after the stop
    ended.set()
    return time.monotonic() - started

# to the main thread, waiting in in_passing, as a terminal's Ctrl-C comes (raise_signal, from the timer's
# thread, went to that thread, and the main thread saw it only once its wait had ended)
for at in (0.3, 0.4)[:{interrupts}]:
    threading.Timer(at, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
try:
    in_passing(work, on_interrupt=stop.set)
except KeyboardInterrupt:
    print("interrupted", "after the work" if ended.is_set() else "while the work ran", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("stoppable", [False, True])
def test_a_ctrl_c_while_in_passing_waits_for_the_work_and_exits_cleanly(tmp_path, stoppable):
    """Exiting while the passing thread is inside torch's C++ would abort the process ("terminate
    called without an active exception", status -6; a multitask run in `compare` did, where its thread
    was in a backward pass): the interrupt is raised once the work ended, early where on_interrupt can
    stop it. (Python 3.11's Thread.join, interrupted, marks a running thread as ended: bpo-45274's
    mend, and a second join then returned at once.)"""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED.format(root=str(ROOT), stoppable=stoppable, interrupts=1))
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stdout.strip() == "interrupted after the work", (done, done.stderr[-2000:])
    assert "terminate called" not in done.stderr
    if stoppable:
        assert time.monotonic() - started < 60  # not asserting a speed: only that it did not hang


def test_a_second_ctrl_c_while_in_passing_waits_exits_at_once_without_aborting(tmp_path):
    """Two quick Ctrl-Cs: the second exits now (the work goes on for 3 s more), with status 130 and one
    line; raised as an exception, it ended the interpreter while the thread was inside torch (status -6)."""
    script = tmp_path / "twice.py"
    script.write_text(INTERRUPTED.format(root=str(ROOT), stoppable=False, interrupts=2))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (130, ""), (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stderr.strip().splitlines() == ["streamer: interrupted again: exiting now"], done.stderr[-2000:]


TEAMS = """
import os, sys, threading, time
sys.path.insert(0, {root!r})
import torch
from streamer.spin import in_passing
torch.set_num_threads(2)

def threads(at_most=None):  # this process's threads; given at_most, waits up to 5 s for no more than that
    waited = time.monotonic()
    while at_most is not None and len(os.listdir("/proc/self/task")) > at_most and time.monotonic() - waited < 5:
        time.sleep(0.05)
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    torch.ones(1 << 20).mul_(2)

parallel_op()  # the main thread's own team (its helper stays: the main thread lives on)
time.sleep(0.3)
before = threads()
in_passing(parallel_op)
after_passing = threads(at_most=before)
ran, parked = threading.Event(), threading.Event()
kept = threading.Thread(target=lambda: (parallel_op(), ran.set(), parked.wait()))
kept.start()
ran.wait()
print(before, after_passing, threads() - 1)  # less the kept thread itself
parked.set()
"""


@linux_only
def test_torch_work_in_passing_leaves_no_openmp_team_behind(tmp_path):
    """A thread that ran a parallel torch op keeps an OpenMP team (its helper threads) while it lives,
    which takes libgomp over the CPU count and throttles every spin (streamer.spin); in_passing's
    thread ends and its team with it."""
    script = tmp_path / "teams.py"
    script.write_text(TEAMS.format(root=str(ROOT)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after_passing, beside_kept = (int(word) for word in done.stdout.split())
    assert after_passing == before
    assert beside_kept > before  # the long-lived thread's helper stays


GOVERNED = """
import sys, time
sys.path.insert(0, {root!r})
from streamer.settings import choose_openmp_spin
from streamer.spin import watchable
assert choose_openmp_spin(2, 2, watchable()), "not governed"
from streamer.threads import apply_thread_policy
assert apply_thread_policy(2, govern_spin=True).governed
import torch
from streamer.spin import govern
from streamer.models import LSTMLanguageModel
from streamer.models.catalog import LSTMConfig
from streamer.strategies import STRATEGIES
from streamer.strategies.base import Batch
strategy = STRATEGIES["naive"](LSTMLanguageModel(LSTMConfig()), lr=2e-3)
tokens = torch.randint(0, 256, (10, 21))
batch = Batch(tokens[:, :-1], tokens[:, 1:], None)
print("learning", flush=True)
started = time.monotonic()
while time.monotonic() - started < 60 and not govern().shared:
    strategy.predict(batch); strategy.learn(batch)
print("shared" if govern().shared else "never shared", round(time.monotonic() - started, 1), flush=True)
"""

HOG = "import time\nwhile True:\n    pass\n"


def end(*processes: subprocess.Popen) -> None:
    for process in processes:
        process.kill()
        process.wait()


def on_two_cpus() -> list[str]:
    """`taskset -c` to the first two CPUs this process may use (these tests need two: skipped with fewer)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    return ["taskset", "-c", ",".join(map(str, cpus))]


def spin_free_environment() -> dict[str, str]:
    """This environment less the variables the command's thread and spin policy reads (its own defaults apply)."""
    return {name: value for name, value in os.environ.items()
            if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "STREAMER_OPENMP_SPIN", "OMP_NUM_THREADS")}


@linux_only
def test_a_learner_beside_busy_processes_shortens_its_spins(tmp_path):
    """Two busy processes on the learner's 2 CPUs: the governor reads their CPU time in /proc/stat and
    turns the short spins on within seconds."""
    script = tmp_path / "governed.py"
    script.write_text(GOVERNED.format(root=str(ROOT)))
    environment = spin_free_environment()
    pin = on_two_cpus()
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        learner = subprocess.Popen(pin + [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=stderr,
                                   text=True, env=environment)
    hogs = []
    try:
        assert learner.stdout.readline().strip() == "learning", errors.read_text()[-2000:]
        hogs = [subprocess.Popen(pin + [sys.executable, "-c", HOG]) for _ in range(2)]
        verdict = learner.stdout.readline().split()  # the learner stops by itself within 60 s
        assert learner.wait(timeout=30) == 0, errors.read_text()[-2000:]
    finally:
        end(*hogs, learner)
    assert verdict[0] == "shared", verdict


THROTTLE = """
import os, sys, threading, time
sys.path.insert(0, {root!r})
import torch
from streamer.spin import SpinGovernor
torch.set_num_threads(2)
go, done = threading.Event(), threading.Event()

def worker():  # the step's thread: one parallel region whenever asked
    while True:
        go.wait(); go.clear(); torch.ones(1 << 20).mul_(2); done.set()

threading.Thread(target=worker, daemon=True).start()

def idle_cpu():  # CPU seconds this process takes in 0.5 s after a region, while nothing runs but OpenMP's wait
    go.set(); done.wait(); done.clear()
    started = time.process_time(); time.sleep(0.5)
    return time.process_time() - started

governor = SpinGovernor()
long_ = idle_cpu()
governor._short(True); short = idle_cpu()
governor._short(False); time.sleep(0.2); long_again = idle_cpu()
print(long_, short, long_again)
"""


@linux_only
def test_the_parked_team_throttles_openmp_and_its_end_lifts_it(tmp_path):
    """With a spin count too long to end within the test (GOMP_SPINCOUNT=10^10, OMP_WAIT_POLICY unset),
    the step's idle helper thread spins, taking CPU time while the process sleeps; the governor's
    short spins (a parked thread's team taking libgomp over the CPU count) make it sleep after 100
    turns, and ending the parked thread brings the spinning back."""
    pin = on_two_cpus()  # two teams of 2 threads take libgomp over 2 CPUs' count
    script = tmp_path / "throttle.py"
    script.write_text(THROTTLE.format(root=str(ROOT)))
    environment = {name: value for name, value in os.environ.items() if name not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    environment["GOMP_SPINCOUNT"] = str(10 ** 10)
    done = subprocess.run([*pin, sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr[-2000:]
    long_, short, long_again = (float(word) for word in done.stdout.split())
    assert long_ > 0.1 and long_again > 0.1  # a helper spinning (a share of a CPU, however loaded the machine)
    assert short < 0.05  # asleep


def _short_spins(address: str) -> float | None:
    """streamer_openmp_short_spins as the learner's /metrics says it (None: not exported)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "streamer_openmp_short_spins" and family.samples:
            return family.samples[0].value
    return None


@linux_only
def test_a_learners_short_spins_show_in_its_metrics(broker, tmp_path):
    """A governed learner (the default policy on its 2 CPUs) waits for records and exports
    streamer_openmp_short_spins; two busy processes on its CPUs turn its short spins on, and the gauge
    says 1. (Whether it goes back to 0 once they stop depends on the rest of the machine, busy with
    the suite's other tests: the gauge's 0 is checked against the governor itself below.)"""
    import json

    from tests.conftest import write_corpus
    from tests.learners import learn_command, produce

    pin = on_two_cpus()
    produce(broker.bootstrap_servers, write_corpus(tmp_path / "corpus", lines=50), "spins", tmp_path / "manifest.json",
            2, 300, "--probe-tokens", "0")
    environment = spin_free_environment()
    run_dir = tmp_path / "run"
    learner = subprocess.Popen(pin + learn_command(broker.bootstrap_servers, "spins", "--metrics-port", "0",
                                                   "--run-dir", str(run_dir)),
                               cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    hogs = []

    def until(value: float, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while _short_spins(address) != value:
            assert learner.poll() is None, learner.stdout.read()[-3000:]
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    try:
        deadline = time.monotonic() + 120
        while "metrics_address" not in (json.loads((run_dir / "config.json").read_text())
                                         if (run_dir / "config.json").exists() else {}):
            assert learner.poll() is None, learner.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no metrics endpoint"
            time.sleep(0.2)
        address = json.loads((run_dir / "config.json").read_text())["metrics_address"]
        deadline = time.monotonic() + 60
        while _short_spins(address) not in (0, 1):
            assert time.monotonic() < deadline, "streamer_openmp_short_spins is not exported"
            time.sleep(0.2)
        hogs = [subprocess.Popen(pin + [sys.executable, "-c", HOG]) for _ in range(2)]
        until(1, "the spins did not go short beside two busy processes")
        learner.send_signal(signal.SIGTERM)
        output = learner.communicate(timeout=60)[0]
        assert learner.returncode == 0, output[-3000:]
        assert "OpenMP spins shortened while other work shares them" in output  # the policy line
    finally:
        end(*hogs, learner)


def test_the_spins_gauge_follows_the_governor(monkeypatch):
    """streamer_openmp_short_spins reads the governor's state as it is at each scrape, 0 and 1; with
    no governor (the spin not governed) nothing is set, and no series appears."""
    from types import SimpleNamespace

    from monitor.exporter import create_metrics
    from streamer import learner

    def value(metrics) -> float | None:
        return metrics.registry.get_sample_value("streamer_openmp_short_spins", {"run": "r", "strategy": "naive"})

    watched = SimpleNamespace(shared=False)
    monkeypatch.setattr(learner, "governor", lambda: watched)
    metrics = create_metrics()
    learner._spins_gauge(metrics, ("r", "naive"))
    assert value(metrics) == 0
    watched.shared = True
    assert value(metrics) == 1
    watched.shared = False
    assert value(metrics) == 0
    monkeypatch.setattr(learner, "governor", lambda: None)
    ungoverned = create_metrics()
    learner._spins_gauge(ungoverned, ("r", "naive"))
    assert value(ungoverned) is None
