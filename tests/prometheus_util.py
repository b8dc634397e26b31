"""A real Prometheus for tests: find Debian's package (./dev setup installs it), start it, query it.

Nothing here knows about streamer's rules or metrics, so the rule tests and a
live-scrape test share it. Nothing here installs anything: without the
prometheus and promtool commands the tests fail with one line naming `./dev setup`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from streamer.broker import die_with_parent
from tests.conftest import missing

__all__ = ["require_prometheus", "start_prometheus", "stop", "query", "query_range"]

READY_TIMEOUT_S = 30


def require_prometheus() -> tuple[str, str]:
    """Paths of the `prometheus` and `promtool` commands (Debian's prometheus package); the
    calling test fails with one line naming `./dev setup` when either is missing."""
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        missing("prometheus/promtool (Debian's prometheus package)")
    return prometheus, promtool


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_prometheus(config_text: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """Write `config_text` to tmp_path/prometheus.yml, start Prometheus on a free loopback port.

    Returns (process, base_url) once /-/ready answers; the log is tmp_path/prometheus.log.
    Rule files named relatively in the config resolve against tmp_path.
    """
    prometheus, _ = require_prometheus()
    tmp_path = Path(tmp_path)
    config = tmp_path / "prometheus.yml"
    config.write_text(config_text, encoding="utf-8")
    storage = tmp_path / "tsdb"
    storage.mkdir(exist_ok=True)
    address = f"127.0.0.1:{_free_port()}"
    log = open(tmp_path / "prometheus.log", "wb")
    process = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={storage}",
            f"--web.listen-address={address}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent(os.getpid()),  # killed with the process that started it
    )
    log.close()  # the child holds its own descriptor
    base_url = f"http://{address}"
    try:
        _wait_ready(process, base_url, tmp_path / "prometheus.log")
    except BaseException:
        stop(process)
        raise
    return process, base_url


def _wait_ready(process: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"prometheus at {base_url} not ready after {READY_TIMEOUT_S}s:\n{log.read_text(errors='replace')[-3000:]}")


def stop(process: subprocess.Popen, timeout_s: float = 10) -> None:
    """Terminate a Prometheus from start_prometheus (kill it if it lingers) and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def query(base_url: str, expr: str, timeout_s: float = 5, at: float | None = None) -> list[dict]:
    """Instant query (at Unix time `at`, default now); returns the API's `data.result` list (each with
    `metric` and `value`, or `values` for a range vector)."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    url = f"{base_url}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:  # a bad expression answers 400 with a JSON error
        body = {"status": "error", "error": error.read().decode(errors="replace")}
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {body}")
    return body["data"]["result"]


def query_range(base_url: str, expr: str, start: float, end: float, step: float, timeout_s: float = 10) -> list[dict]:
    """Range query; returns the API's `data.result` list (each with `metric` and `values`)."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    url = f"{base_url}/api/v1/query_range?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        body = {"status": "error", "error": error.read().decode(errors="replace")}
    if body.get("status") != "success":
        raise RuntimeError(f"query_range {expr!r} failed: {body}")
    return body["data"]["result"]
