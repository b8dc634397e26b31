"""The throughput and rereading benchmarks stay runnable: a short run of each through the real broker
prints its figures and headline lines. Speed is the benchmarks' to judge, never a test's. Run with -m slow."""

import os
import re
import subprocess
import sys
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
        assert re.search(rf"  {model}: kafka/memory \d\.\d{{3}} .*memory/baseline \d\.\d{{3}}", out), out
    assert re.search(r"^ratio kafka/memory: \d\.\d{3} \(lower of lstm \d\.\d{3}, poe \d\.\d{3}; target >= 0\.95\)$",
                     out, re.M), out
    assert re.search(r"^memory/baseline: \d\.\d{3} \(lower of lstm", out, re.M), out


def test_throughput_refuses_no_processes():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--processes", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--processes must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr


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
