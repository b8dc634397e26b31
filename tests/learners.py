"""Real `streamer` processes for the fault tests (signals, broker faults, groups): the commands, a
small stream, and waiting on their loss logs. Each process runs with one torch thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

STREAMER = [sys.executable, "-m", "streamer.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SMALL = ("--streams", "3", "--window", "10")


def produce_command(bootstrap: str, corpus: Path, topic: str, manifest: Path, fragments: int = 6,
                    mean_tokens: int = 2500, *extra) -> list[str]:
    return [*STREAMER, "produce", "--corpus", str(corpus), "--bootstrap-servers", bootstrap, "--topic", topic,
            "--fragments", str(fragments), "--lambda", str(mean_tokens), *SMALL, "--seed", "0",
            "--manifest", str(manifest), *extra]


def produce(bootstrap: str, corpus: Path, topic: str, manifest: Path, fragments: int = 6, mean_tokens: int = 2500,
            *extra):
    result = subprocess.run(produce_command(bootstrap, corpus, topic, manifest, fragments, mean_tokens, *extra),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def learn_command(bootstrap: str, topic: str, *extra) -> list[str]:
    return [*STREAMER, "learn", "--bootstrap-servers", bootstrap, "--topic", topic, *SMALL,
            "--hidden", "24", "--embedding", "8", "--no-view", "--no-probe", *extra]


STARTED: list[subprocess.Popen] = []  # by start(); kill_leftovers() ends those a failed test left running


def start(command, cwd: Path, stderr_apart: bool = False) -> subprocess.Popen:
    """A process with its output in one text pipe (`stderr_apart`: standard error in a second one)."""
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT, text=True)
    STARTED.append(process)
    return process


def kill_leftovers() -> None:
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.communicate()


def finish(process: subprocess.Popen, timeout_s: float = 180) -> str:
    """Wait for `process`; its output."""
    output, _ = process.communicate(timeout=timeout_s)
    return output


def wait_for_output(process: subprocess.Popen, text: str, timeout_s: float = 120) -> list[str]:
    """Read `process`'s output (start()'s single pipe) line by line until a line holds `text`; the lines read."""
    deadline, lines = time.monotonic() + timeout_s, []
    while not lines or text not in lines[-1]:
        assert time.monotonic() < deadline, f"no line with {text!r} after {timeout_s}s: {lines[-20:]}"
        line = process.stdout.readline()
        assert line, f"the process ended before saying {text!r}: {lines[-20:]}"
        lines.append(line)
    return lines


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_lines(path: Path, process, at_least: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while (count := line_count(path)) < at_least:
        assert process.poll() is None, f"the learner exited early: {process.stdout.read()[-2000:]}"
        assert time.monotonic() < deadline, f"{count} lines after {timeout_s}s, waiting for {at_least}"
        time.sleep(0.05)
    return count


def losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


def assert_equal_losses(run_dir: Path, expected: list[float], tolerance: float = 1e-4) -> None:
    """Every batch once, in order, with the losses of an uninterrupted run."""
    got = losses(run_dir)
    assert [line["batch"] for line in got] == list(range(len(expected)))
    worst = max(abs(line["loss"] - loss) for line, loss in zip(got, expected))
    assert worst <= tolerance, f"largest loss difference {worst:.3g} nats"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]
