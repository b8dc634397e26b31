"""The benchmarks stay runnable: a short run of each through the real broker prints its figures and
headline lines; a bad option is one line; a signal ends a benchmark with its processes. Speed is the
benchmarks' to judge, never a test's. The long runs are marked slow (-m slow)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_throughput_runs_each_path_in_two_processes_and_prints_its_headlines():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--rounds", "2",
                             "--processes", "2", "--hidden", "32", "--experts", "2", "--gate-steps", "2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for model in ("lstm", "poe"):
        # each path's two processes, each with its own tokens/s, and the pooled ratios
        rates = re.findall(r"each process's own tokens/s: memory ([\d,]+) / ([\d,]+); kafka ([\d,]+) / ([\d,]+); "
                           r"baseline ([\d,]+) / ([\d,]+)", out)
        assert len(rates) == 2 and all(int(rate.replace(",", "")) > 0 for line in rates for rate in line), out
        assert re.search(rf"  {model}: kafka/memory \d+\.\d{{3}} .*memory/baseline \d+\.\d{{3}}", out), out
    assert re.search(r"^ratio kafka/memory: \d\.\d{3} \(lower of lstm \d\.\d{3}, poe \d\.\d{3}; target >= 0\.95\)$",
                     out, re.M), out
    assert re.search(r"^memory/baseline: \d+\.\d{3} \(lower of lstm", out, re.M), out


@pytest.mark.parametrize("script, flags, said", [
    ("throughput.py", ["--processes", "0"], "argument --processes: expected a positive integer, got 0"),
    ("throughput.py", ["--slice", "nan"], "argument --slice: expected a positive number, got nan"),
    ("experts.py", ["--experts", "5,x"], "argument --experts: expected a positive integer, got 'x'"),
    ("experts.py", ["--strategies", "poe,lstm"], "argument --strategies: takes poe, moe, ensemble, comma-separated; "
                                                  "got 'poe,lstm'"),
    ("step_cost.py", ["--dropouts", "0,1.5"], "argument --dropouts: expected at least 0 and below 1, got 1.5"),
    ("scaling.py", ["--batches", "1"], "--batches 1: at least 10 (a rate is taken over the span between batches)"),
    ("throughput.py", ["--device", "foo"], "argument --device: invalid choice: 'foo' (choose from 'cpu', 'cuda', "
                                           "'auto')"),
    ("experts.py", ["--min-seconds", "inf"], "--min-seconds must be finite, got inf"),
    ("experts.py", ["--json", "/nonexistent/rows.json"], "--json /nonexistent/rows.json: not a file in a writable "
                                                         "directory"),
    ("contention.py", ["--seconds", "0"], "argument --seconds: expected a positive number, got 0.0"),
    ("contention.py", ["--threads", "-1"], "argument --threads: expected a positive integer, got -1"),
    ("spikes.py", ["--scrape", "0"], "argument --scrape: expected a positive number, got 0.0"),
    ("producer.py", ["--fragments", "0"], "argument --fragments: expected a positive integer, got 0"),
    ("producer.py", ["--lambda", "0"], "argument --lambda: expected a positive integer, got 0"),
    ("soak.py", ["--poison-every", "1"], "argument --poison-every: expected an integer >= 2 (one poison record in "
                                         "this many), got '1'"),
])
def test_a_bad_value_for_a_benchmark_is_one_line(script, flags, said):
    """Each was a traceback from deep inside the run (a ZeroDivisionError, torch's ValueError, time.sleep's);
    then argparse's usage (up to four lines) came before the error, where a streamer command says one line."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *flags],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, f"{script}: error: {said}\n"), result.stderr
    assert "Traceback" not in result.stderr


def test_throughput_refuses_a_cuda_device_the_machine_lacks_before_it_starts_anything():
    """It was a child's traceback, after the broker had started and the stream was written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--device", "cuda"],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (
        2, "throughput.py: error: --device cuda, but torch sees no CUDA device here"), result.stderr
    assert not result.stdout  # (its first line comes once the broker is started)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_throughput_whose_slices_hold_no_batch_says_so_in_one_line(tmp_path):
    """Slices too short for a busy machine: a path with no batch inside its slices divided its tokens by zero,
    a traceback (the scratch test below, at 0.2 s slices under the slow suite's load)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--models", "lstm",
                             "--processes", "1", "--rounds", "1", "--slice", "0.001", "--hidden", "32"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.fullmatch(r"throughput: no lstm \w+ batch finished inside its 1 slices of 0.001 s \(a machine this "
                        r"busy needs a longer --slice\)", result.stderr.strip()), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_throughput_leaves_no_scratch_directory_with_a_synthetic_corpus(tmp_path):
    """Without calm-multilingual built, the parent and every child wrote a synthetic corpus into a mkdtemp of
    its own and never removed it (9 a default run). Now the parent writes it once, in a directory it removes."""
    scratch, cache = tmp_path / "tmp", tmp_path / "empty-cache"
    scratch.mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--models", "lstm",
                             "--processes", "1", "--rounds", "2", "--slice", "0.5", "--hidden", "32"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(scratch), "STREAMER_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "corpus synthetic" in result.stdout
    assert not [path for path in scratch.iterdir() if not path.name.startswith("torchinductor_")]  # (torch's cache)


TINY_EXPERTS = ["--strategies", "poe,ensemble", "--experts", "2", "--hidden", "8,16", "--embedding", "8",
                "--gate-steps", "2", "--iterations", "3", "--min-seconds", "0", "--no-memory"]


def test_experts_compares_the_fused_and_loop_kernels_losses_and_names_the_worst_sizes(tmp_path):
    """The kernels' equal losses were checked only by a unit test at hidden 12, never at the swept sizes; and
    the headline's wall ratio (the minimum over the sweep) named no size. The rows are written after the
    table."""
    rows = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "experts.py"), *TINY_EXPERTS,
                             "--json", str(rows)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    size = r"(poe|ensemble), 2 experts, hidden (8|16)"
    assert re.search(rf"^fused / loop kernels: largest training loss difference \d\.\de-\d\d \({size}; bound 1e-05\)$",
                     result.stdout, re.M), result.stdout
    assert re.search(rf"^  loop / batched step time: \d+\.\d\dx wall, \d+\.\d\dx CPU "
                     rf"\(worst of the sweep; wall: {size}; CPU: {size}\)$", result.stdout, re.M), result.stdout
    assert len(json.loads(rows.read_text())) == 4


def test_experts_fails_in_one_line_when_the_kernels_losses_differ(monkeypatch, capsys):
    """Past 1e-5 the run fails (status 1, one line), after its table."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("experts_benchmark", ROOT / "benchmarks" / "experts.py")
    experts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experts)
    swept = experts.sweep

    def apart(args):
        rows = swept(args)
        rows[-1]["loop"]["losses"][-1] += 1e-3
        return rows

    monkeypatch.setattr(experts, "sweep", apart)
    monkeypatch.setattr(sys, "argv", ["experts.py", *TINY_EXPERTS])
    threads = experts.torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exited:
            experts.main()
    finally:
        experts.torch.set_num_threads(threads)  # (main sets --threads for this process)
    assert str(exited.value).startswith("experts: the fused and loop kernels' training losses differ by 1.0e-03 at "
                                        "ensemble, 2 experts, hidden 16, past 1e-05")
    assert "loop / batched step time:" in capsys.readouterr().out


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            fields = (Path("/proc") / entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.isdigit() else []
            if fields and int(fields[1]) == pid:
                found.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, flags, started", [
    ("throughput.py", ["--models", "lstm", "--hidden", "32", "--rounds", "400"], 7),  # the broker, 3 paths x 2
    ("scaling.py", ["--parts", "length", "--batches", "200"], 4),  # the broker, 2 producers, the 1x learner
    ("experts.py", ["--separate", "--experts", "30", "--hidden", "550", "--min-seconds", "60"], 1),  # a variant
    ("soak.py", ["--records", "20000", "--kills", "1"], 2),  # the broker, a learner
    ("contention.py", ["--seconds", "30"], 1),  # the learner timed alone
    ("rereading.py", ["--pause", "300", "--keep", "4"], 2),  # the broker, a learner
    # the broker, Prometheus, produce and learn
    ("spikes.py", ["--scrape", "1", "--fragments", "6", "--lambda", "4000", "--token-rate", "500"], 4),
])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_benchmark_with_its_processes_in_one_line(script, flags, started, signum, tmp_path):
    """SIGTERM (`timeout`, as gpu_host.sh runs them) ended the parent alone: throughput's six children stayed,
    frozen or learning on, and scaling's learner ran on orphaned and left its run directory in /tmp; Ctrl-C
    printed a traceback. Now both end as Ctrl-C should: children stopped and reaped, their scratch files
    removed (throughput's SIGKILLed children left theirs), then one line."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    benchmark = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *flags],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "TMPDIR": str(scratch)})
    deadline, children = time.monotonic() + 240, set()
    while len(children) < started and time.monotonic() < deadline and benchmark.poll() is None:
        children |= _children(benchmark.pid)
        time.sleep(0.2)
    assert len(children) >= started, (children, benchmark.poll())
    time.sleep(2)
    benchmark.send_signal(signum)
    out, err = benchmark.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert (benchmark.returncode, err.splitlines()[-1]) == (
        128 + signum, f"{script[:-3]}: stopped by {name}; its processes are ended and its scratch files removed"), err
    assert "Traceback" not in err
    assert not [pid for pid in children if _alive(pid)], children
    assert not [path for path in scratch.iterdir() if not path.name.startswith("torchinductor_")]  # (torch's cache)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaling_reports_every_block_of_the_long_run():
    """The 10x run's rates by blocks of 1x batches: ten of them (the last block was left out: nine)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--parts", "length",
                             "--batches", "20"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    one = int(re.search(r"^  1x +(\d+) batches", result.stdout, re.M).group(1))
    rates = re.search(r"by 1x blocks: ([\d, ]+) tokens/s", result.stdout).group(1).split()
    assert len(rates) == 10 and one > 1, result.stdout
    assert re.search(r"^10x stream: \d+\.\d\dx the time, \d\.\d\dx the peak RSS", result.stdout, re.M), result.stdout


def test_scaling_takes_the_1x_runs_mean_as_the_reference_of_time_and_memory_alike(monkeypatch):
    """The time's reference was the 1x runs' mean but the peak RSS's their larger, which made the RSS ratio
    look lower."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scaling_benchmark", ROOT / "benchmarks" / "scaling.py")
    scaling = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, scaling)  # (dataclasses look their module up)
    spec.loader.exec_module(scaling)
    before, after = (scaling.Measured(101, 0.0, span, 0.0, rss) for span, rss in ((10.0, 400.0), (12.0, 440.0)))
    time_ratio, rss_ratio = scaling.length_headline(before, scaling.Measured(1001, 0.0, 110.0, 0.0, 441.0), after)
    assert (time_ratio, rss_ratio) == (pytest.approx(10.0), pytest.approx(1.05))


@pytest.mark.parametrize("script", ["throughput.py", "scaling.py"])
def test_more_cpus_than_the_benchmark_may_use_is_one_line(script):
    """`--cpus N` past the CPUs this process may use, or under 1, is refused in one line, not a traceback
    (a 16-core figure asked of a smaller host)."""
    allowed = len(os.sched_getaffinity(0))
    for cpus in (allowed + 1, 0):
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--cpus", str(cpus)],
                                capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stderr.splitlines()[-1]) == (
            2, f"{script}: error: --cpus {cpus}, but this process may use 1 to {allowed} CPUs"), result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rereading_runs_each_bound_beside_an_unbounded_run_and_prints_its_headlines():
    """benchmarks/rereading.py through the real broker: each --keep-windows run learns the unbounded run's
    batches with its losses, and the headlines are printed."""
    command = [sys.executable, str(ROOT / "benchmarks" / "rereading.py"), "--keep", "4,16", "--pause", "300"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    lines = re.findall(r"^  --keep-windows (\d+): ([\d,]+) batches, read again ([\d,]+) .* losses equal ", out, re.M)
    assert [keep for keep, _, _ in lines] == ["4", "16"] and all(int(again.replace(",", "")) > 0
                                                                  for _, _, again in lines), out
    assert re.search(r"^records read again per record: \d+\.\d\d$", out, re.M), out
    assert re.search(r"^cpu keep/unbounded: \d+\.\d{3}$", out, re.M), out
