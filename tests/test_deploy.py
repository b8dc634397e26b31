"""The compose stack validates with Debian's docker-compose and offers what the README promises."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ensure_docker_compose() -> str:
    """Debian's docker-compose (1.29) validates compose files without a Docker engine."""
    path = shutil.which("docker-compose")
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("docker-compose is missing: install Debian's docker-compose (sudo apt-get install docker-compose)")
    command = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker-compose"]
    if subprocess.run(command, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        subprocess.run(command, check=True, capture_output=True)
    return shutil.which("docker-compose")


@pytest.fixture(scope="module")
def compose():
    binary = ensure_docker_compose()

    def run(*args):
        result = subprocess.run([binary, "-f", str(ROOT / "docker-compose.yml"), *args],
                                capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout
    return run


def test_compose_file_validates(compose):
    compose("config", "-q")
    compose("--profile", "gpu", "config", "-q")


def test_services_ports_and_volumes_are_the_promised_ones(compose):
    assert set(compose("config", "--services").split()) == {
        "kafka", "producer", "learner", "learner-gpu", "prometheus", "grafana"}
    assert set(compose("config", "--volumes").split()) == {"cache", "runs", "prometheus", "grafana"}
    text = compose("--profile", "cpu", "config")
    published = set(re.findall(r"published: (\d+)", text)) or set(re.findall(r'- "?(\d+):\d+"?', text))
    assert {"9092", "9464", "9090", "3000"} <= published
    readme = (ROOT / "README.md").read_text()
    for url in ("localhost:9090", "localhost:3000", "localhost:9464/metrics"):
        assert url in readme, url


def test_gpu_learner_reserves_a_gpu_and_answers_as_learner(compose):
    text = compose("--profile", "gpu", "config")
    gpu = text.split("learner-gpu:")[1].split("\n  prometheus:")[0]
    assert "capabilities:" in gpu and "gpu" in gpu and "driver: nvidia" in gpu
    assert "aliases:" in gpu and "- learner" in gpu


def test_mounted_configuration_exists_and_points_at_the_learner():
    prometheus = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    assert "learner:9464" in prometheus and "rules.yml" in prometheus
    assert (ROOT / "deploy/prometheus/rules.yml").is_file()
    assert (ROOT / "deploy/grafana/dashboards/streamer.json").is_file()
    assert any((ROOT / "deploy/grafana/provisioning/datasources").glob("*.yml"))
    assert any((ROOT / "deploy/grafana/provisioning/dashboards").glob("*.yml"))
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    assert "torch==2.13.0" in dockerfile and "streamer data build calm-multilingual" in dockerfile
