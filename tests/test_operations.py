"""Operations of a long-lived learner: the broker child dies with its parent, the loss log rotates
and trims across files, /healthz and /readyz answer, the torch thread policy is decided once, and
the step's memory is reused from batch to batch."""

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from monitor.exporter import create_metrics, serve
from monitor.losslog import LossLogWriter, iter_loss_log, loss_log_files, read_loss_log, trim_loss_log
from monitor.report import build_report
from streamer.broker import BrokerError, EmbeddedBroker
from streamer.settings import omp_num_threads, choose_openmp_spin, torch_openmp_is_gnu
from streamer.threads import ThreadPolicy, default_threads, rank_cpu_share, rank_threads


def gone(pid: int) -> bool:
    """No such process, or a zombie waiting for init to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_streamer_broker_takes_tansu_with_it(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "streamer.cli", "broker"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        tansu = int(line.split("(pid ")[1].split(")")[0])
        assert not gone(tansu)
        process.kill()  # SIGKILL: no handler, no finally, no atexit in the parent
        process.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while not gone(tansu) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(tansu), f"tansu {tansu} outlived its parent"
    finally:
        if process.poll() is None:
            process.kill()


def test_a_taken_broker_port_is_one_error_naming_it():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} .* in use"):
            EmbeddedBroker(port=port).start()


def line(batch, fragment=0, loss=1.0):
    return {"loss": loss, "domain": fragment % 2, "domain_name": "ab"[fragment % 2], "sequence": fragment,
            "batch": batch, "padding": "x" * 40}


def write_lines(path, batches, append=False, **caps):
    with LossLogWriter(path, append=append, **caps) as log:
        for batch in batches:
            log.write(line(batch, fragment=batch // 10, loss=float(batch % 7)))


def test_rotation_keeps_the_order_and_drops_the_oldest(tmp_path, caplog):
    path = tmp_path / "losses.jsonl"
    size = len(json.dumps(line(0)).encode()) + 1
    write_lines(path, range(30), max_bytes=5 * size, max_total_bytes=100 * size)  # ~6 files, none dropped
    files = loss_log_files(path)
    assert [f.name for f in files] == [f"losses.{n}.jsonl" for n in range(1, len(files))] + ["losses.jsonl"]
    assert all(f.stat().st_size <= 5 * size + 10 for f in files)
    assert [r["batch"] for r in iter_loss_log(path)] == list(range(30))
    with caplog.at_level(logging.WARNING, logger="monitor.losslog"):
        write_lines(path, range(30, 60), append=True, max_bytes=5 * size, max_total_bytes=12 * size)
    dropped = [r.getMessage() for r in caplog.records if "dropped the oldest" in r.getMessage()]
    assert dropped and all("losses." in m for m in dropped)
    batches = [r["batch"] for r in read_loss_log(path)]
    assert batches == list(range(batches[0], 60)) and batches[0] > 0  # the oldest went, the rest in order
    rotated = sum(f.stat().st_size for f in loss_log_files(path)[:-1])
    assert rotated <= 12 * size + 20
    write_lines(path, range(3), max_bytes=5 * size)  # a new log (append=False) removes the rotated files
    assert loss_log_files(path) == [path] and len(read_loss_log(path)) == 3


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_error_naming_the_loss_log():
    """A write the disk refused raised an OSError without a file name, and the with-block's close tried
    the line again and raised a second one over it."""
    import errno

    with pytest.raises(OSError) as raised, LossLogWriter("/dev/full", append=True) as log:
        log.write({"batch": 0, "loss": 1.0, "domain": 0, "domain_name": "en", "sequence": 0})
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, "/dev/full")
    from streamer.cli.errors import storage_error
    assert storage_error(raised.value) == "/dev/full: No space left on device (errno ENOSPC)"
    assert storage_error(OSError(errno.ENOENT, "No such file or directory", "x")) is None  # (a bug's: traceback)


def test_trim_across_rotated_files(tmp_path):
    path = tmp_path / "losses.jsonl"
    size = len(json.dumps(line(0)).encode()) + 1
    write_lines(path, range(23), max_bytes=5 * size)
    before = len(loss_log_files(path))
    assert before >= 5
    assert trim_loss_log(path, 23) == 23 and len(read_loss_log(path)) == 23
    assert trim_loss_log(path, 12) == 12
    assert [r["batch"] for r in read_loss_log(path)] == list(range(12))
    assert loss_log_files(path)[-1] == path and 2 <= len(loss_log_files(path)) < before
    write_lines(path, range(12, 20), append=True, max_bytes=5 * size)  # a resume appends from there
    assert [r["batch"] for r in read_loss_log(path)] == list(range(20))
    with open(path, "a", encoding="utf-8") as file:  # a line torn by a kill -9
        file.write('{"loss": 1.0, "dom')
    assert trim_loss_log(path, 100) == 20 and len(read_loss_log(path)) == 20
    assert trim_loss_log(path, 0) == 0 and read_loss_log(path) == []


def test_trim_parses_only_the_file_that_holds_the_cut(tmp_path, monkeypatch):
    """A resume cut a daemon's log (rotated files up to 2 GB) by parsing every line of every file, on the event
    loop: 15 s for 280 MB at each start. A rotated file whose last line lies before the cut stays whole and is
    counted, not parsed; the lines kept and the log left are those of the line-by-line cut."""
    import monitor.losslog as losslog

    path = tmp_path / "losses.jsonl"
    size = len(json.dumps(line(0)).encode()) + 1
    write_lines(path, range(60), max_bytes=10 * size)
    assert len(loss_log_files(path)) >= 6
    parsed, loads = [], json.loads
    monkeypatch.setattr(losslog.json, "loads", lambda text, *a, **kw: parsed.append(text) or loads(text, *a, **kw))
    assert trim_loss_log(path, 55) == 55
    monkeypatch.undo()
    assert [r["batch"] for r in read_loss_log(path)] == list(range(55))
    assert len(parsed) <= 10 + 2 * len(loss_log_files(path))  # the cut's file, and two lines of each other
    write_lines(path, range(55, 60), append=True, max_bytes=10 * size)
    assert trim_loss_log(path, 100) == 60 and trim_loss_log(path, 31) == 31
    assert [r["batch"] for r in read_loss_log(path)] == list(range(31))


def test_trim_by_position_without_batch_indices(tmp_path):
    path = tmp_path / "losses.jsonl"
    path.write_text("".join(json.dumps({"loss": 1.0, "domain": 0, "domain_name": "a", "sequence": 0}) + "\n"
                            for _ in range(5)))
    assert trim_loss_log(path, 3) == 3 and len(read_loss_log(path)) == 3


def test_report_of_a_rotated_log_equals_the_unrotated_one(tmp_path):
    whole, rotated = tmp_path / "whole", tmp_path / "rotated"
    write_lines(whole / "losses.jsonl", range(60))
    write_lines(rotated / "losses.jsonl", range(60), max_bytes=700)
    assert len(loss_log_files(rotated / "losses.jsonl")) > 3
    a, b = build_report(whole, k=3), build_report(rotated, k=3)
    assert {k: v for k, v in a.items() if k != "run"} == {k: v for k, v in b.items() if k != "run"}


def get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_healthz_and_readyz_on_the_metrics_port():
    metrics, state = create_metrics(), {"ready": False}
    server, _ = serve(metrics, 0, ready=lambda: state["ready"], labels=("r", "naive"))
    port = server.server_address[1]
    try:
        assert get(port, "/healthz")[0] == 200
        assert get(port, "/readyz")[0] == 503
        assert 'streamer_ready{run="r",strategy="naive"} 0.0' in get(port, "/metrics")[1]
        state["ready"] = True
        assert get(port, "/readyz") == (200, "ok\n")
        assert 'streamer_ready{run="r",strategy="naive"} 1.0' in get(port, "/metrics")[1]
        state["ready"] = None  # a readiness check that fails is "not ready", never a 500
        assert get(port, "/readyz")[0] == 503
    finally:
        server.shutdown()
        server.server_close()
    default, _ = serve(create_metrics(), 0)  # without a readiness check: ready while it serves
    try:
        assert get(default.server_address[1], "/readyz")[0] == 200
    finally:
        default.shutdown()
        default.server_close()


def test_thread_policy_defaults():
    assert default_threads(1) == ThreadPolicy(1, 1, "all of them")
    assert default_threads(2).threads == 2
    assert default_threads(8).threads == 7
    assert default_threads(8, omp_threads=1) == ThreadPolicy(1, 8, "OMP_NUM_THREADS=1")
    assert default_threads(2, omp_threads=1).describe().startswith("torch threads: 1 (2 CPUs")
    # learn --nproc N: each rank the rule on its share of the CPUs (its own event loop beside it)
    shares = ((2, 2), (3, 2), (4, 2), (16, 2), (16, 4), (16, 16), (2, 4))  # (CPUs, ranks)
    assert [rank_threads(cpus, ranks) for cpus, ranks in shares] == [1, 1, 2, 7, 3, 1, 1]


def test_each_rank_of_a_machine_gets_its_own_equal_share_of_the_cpus():
    sixteen = list(range(16))
    assert [rank_cpu_share(sixteen, rank, 2) for rank in range(2)] == [list(range(8)), list(range(8, 16))]
    # 3 ranks on 16: 5 each (they step together: the slowest sets the pace), CPU 15 left to the rest
    assert [rank_cpu_share(sixteen, rank, 3) for rank in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9],
                                                                       [10, 11, 12, 13, 14]]
    assert [rank_cpu_share([2, 3, 6, 7], rank, 2) for rank in range(2)] == [[2, 3], [6, 7]]  # the mask's CPUs
    assert rank_cpu_share([0, 1], 0, 4) is None and rank_cpu_share([0, 1], 2, 2) is None  # fewer CPUs than ranks


def test_pin_cpus_says_in_one_line_why_it_pins_nothing(monkeypatch):
    from types import SimpleNamespace

    from streamer.cli.ranks import pin_rank

    before = os.sched_getaffinity(0)
    monkeypatch.delenv("RANK", raising=False)
    assert pin_rank(SimpleNamespace(pin_cpus=True)) is None  # not under torchrun (learn refuses it then)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert pin_rank(SimpleNamespace(pin_cpus=True)) == (
        "CPUs not pinned: LOCAL_WORLD_SIZE is not set (torchrun sets it in every rank; --pin-cpus)")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two hosts of one rank each, but LOCAL_RANK says 1
    assert pin_rank(SimpleNamespace(pin_cpus=True)) == (
        "CPUs not pinned: local rank 1 is not below LOCAL_WORLD_SIZE 1 (--pin-cpus)")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(before) + 1))
    assert pin_rank(SimpleNamespace(pin_cpus=True)) == (
        f"CPUs not pinned: {len(before)} CPUs for {len(before) + 1} ranks on this machine, fewer than one each "
        "(--pin-cpus)")
    assert pin_rank(SimpleNamespace(pin_cpus=False)) is None
    assert os.sched_getaffinity(0) == before  # none of these pinned this process


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="sched_setaffinity is Linux only")
def test_a_pinned_rank_and_the_threads_it_starts_run_on_its_share_alone():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs to give 2 ranks a share each")
    code = ("import json, os, threading\n"
            "from streamer.threads import pin_to_rank_share\n"
            "go, seen = threading.Event(), []\n"
            "def read():\n"
            "    go.wait()\n"
            "    seen.append(sorted(os.sched_getaffinity(0)))\n"
            "before = threading.Thread(target=read)\n"  # a thread that already runs (as OpenBLAS's pool)
            "before.start()\n"
            "share = pin_to_rank_share(1, 2)\n"
            "after = threading.Thread(target=read)\n"  # one started later (as OpenMP's team)
            "after.start()\n"
            "go.set(); before.join(); after.join()\n"
            "print(json.dumps([share, sorted(os.sched_getaffinity(0)), *seen]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    share = allowed[len(allowed) // 2:2 * (len(allowed) // 2)]  # local rank 1 of 2
    assert done.returncode == 0 and json.loads(done.stdout) == [share] * 4, done.stderr


def test_the_cli_says_the_policy_before_the_command_runs_and_compare_once_its_flags_hold(tmp_path):
    """learn says its threads first; compare only once its flags are checked (a bad --strategies was two
    lines) and only where its runs are its own (--jobs 1: each job says its own, side by side)."""
    done = subprocess.run([sys.executable, "-m", "streamer.cli", "learn", "--topic", "t", "--threads", "1", "--no-view",
                           "--bootstrap-servers", "127.0.0.1:1", "--broker-timeout", "0.5", "--run-dir", "r"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[0].startswith("torch threads: 1 (") and "--threads" in done.stdout
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = subprocess.run([sys.executable, "-m", "streamer.cli", "compare", "--strategies", "nosuch", "--threads", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout == "" and done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_openmp_spins_long_and_governed_or_briefly_unless_the_user_chose(monkeypatch):
    def fresh(**environment):
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "STREAMER_OPENMP_SPIN"):
            monkeypatch.delenv(name, raising=False)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)

    gnu = torch_openmp_is_gnu()
    import torch  # here: the pip wheel, which ships libgomp on Linux
    assert gnu == (sys.platform.startswith("linux") and any((Path(torch.__file__).parent / "lib").glob("libgomp*")))
    fresh()  # the default policy on 2 CPUs: libgomp's 300,000 spins, governed (streamer.spin), OMP_WAIT_POLICY unset so
    assert choose_openmp_spin(2, 2, True) == gnu  # that libgomp's throttled spin is its 100 turns
    if gnu:
        assert os.environ["GOMP_SPINCOUNT"] == "300000" and "OMP_WAIT_POLICY" not in os.environ
        assert os.environ["STREAMER_OPENMP_SPIN"] == "governed"
        assert choose_openmp_spin(2, 2, True)  # a process it starts inherits the count: still the command's, governed
        for threads, cpus in ((15, 16), (3, 4)):  # the default policy on 16 and 4 CPUs: the same
            fresh()
            assert choose_openmp_spin(threads, cpus, True)
            assert os.environ["GOMP_SPINCOUNT"] == "300000" and "OMP_WAIT_POLICY" not in os.environ
    # one thread; too few for a second team to take libgomp over the CPU count (it counts 2 x threads - 1 for
    # two teams: the default policy on 3 CPUs, 2 threads, is not enough); no /proc/stat to watch the CPUs by:
    for threads, cpus, watchable in ((1, 2, True), (2, 3, True), (4, 16, True), (2, 2, False)):
        fresh()  # a fixed 500, with ACTIVE beside it on libgomp (the 500 hold where libgomp would throttle them)
        assert not choose_openmp_spin(threads, cpus, watchable) and os.environ["GOMP_SPINCOUNT"] == "500"
        assert os.environ.get("OMP_WAIT_POLICY") == ("ACTIVE" if gnu else None)
        assert "STREAMER_OPENMP_SPIN" not in os.environ
    fresh(GOMP_SPINCOUNT="20")  # the user's spin count is kept, fixed, with ACTIVE beside it
    assert not choose_openmp_spin(2, 2, True) and os.environ["GOMP_SPINCOUNT"] == "20"
    assert os.environ.get("OMP_WAIT_POLICY") == ("ACTIVE" if gnu else None)
    fresh(OMP_WAIT_POLICY="PASSIVE")  # so is the user's wait policy, without a spin count beside it
    assert not choose_openmp_spin(2, 2, True) and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert omp_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert omp_num_threads() is None


STEPS_IN_A_WORKER = """
import sys
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, {root!r})
from streamer.allocator import keep_freed_memory
assert keep_freed_memory()
import torch
from streamer.models import LSTMLanguageModel
from streamer.models.catalog import LSTMConfig
from streamer.strategies import STRATEGIES
from streamer.strategies.base import Batch
torch.set_num_threads(1)
torch.manual_seed(0)
strategy = STRATEGIES["naive"](LSTMLanguageModel(LSTMConfig()), lr=2e-3)
tokens = torch.randint(0, 256, (10, 21))
batch = Batch(tokens[:, :-1], tokens[:, 1:], None)

def faults():  # this thread's minor page faults (field 10 of its stat)
    return int(open("/proc/thread-self/stat").read().rsplit(")", 1)[1].split()[7])

def per_step():
    for _ in range(5):
        strategy.predict(batch); strategy.learn(batch)
    before = faults()
    for _ in range(20):
        strategy.predict(batch); strategy.learn(batch)
    return (faults() - before) / 20

print(ThreadPoolExecutor(1, thread_name_prefix="streamer-step").submit(per_step).result())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_a_step_in_the_worker_thread_reuses_its_memory(tmp_path):
    """The learner's step runs in a worker thread; with glibc's default thresholds that thread's heap
    was trimmed and grown every step (about 1,700 page faults a step of the default LSTM, 18% of its
    CPU). Under the allocator policy the step's memory stays faulted in."""
    script = tmp_path / "steps.py"
    script.write_text(STEPS_IN_A_WORKER.format(root=str(Path(__file__).resolve().parents[1])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) < 100  # page faults per step after the first five


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_watchdog_fallback_kills_the_child_of_a_killed_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from streamer.broker import start_watchdog\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "start_watchdog(child.pid)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.3)
        assert not gone(child)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_threads_given_win_and_cpus_pin_the_first_ones_all_of_them_allowed():
    """--threads N is the policy whatever the CPUs; --cpus N pins the first N CPUs this process may use (all
    of them is allowed, one more is not); one thread has no spins to govern. In a process of its own (the
    pinning and torch's thread count are the process's)."""
    from streamer.threads import available_cpus, thread_policy

    assert thread_policy(3) == ThreadPolicy(3, available_cpus(), "--threads")
    script = ("import os\n"
              "from streamer.threads import apply_thread_policy, pin_to_first_cpus\n"
              "allowed = sorted(os.sched_getaffinity(0))\n"
              "assert pin_to_first_cpus(None) == allowed and pin_to_first_cpus(len(allowed)) == allowed\n"
              "try:\n"
              "    pin_to_first_cpus(len(allowed) + 1)\n"
              "except ValueError as exc:\n"
              "    assert str(exc) == f'--cpus {len(allowed) + 1}, but this process may use 1 to {len(allowed)} CPUs'\n"
              "else:\n"
              "    raise AssertionError('not refused')\n"
              "assert pin_to_first_cpus(1) == allowed[:1] == sorted(os.sched_getaffinity(0))\n"
              "assert not apply_thread_policy(1, govern_spin=True).governed\n"
              "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.stdout.strip() == "ok", result.stderr
