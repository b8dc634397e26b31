"""The compose stack validates with Debian's docker-compose and offers what the README promises."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose(docker_compose):
    def run(*args):
        result = subprocess.run([docker_compose, "-f", str(ROOT / "docker-compose.yml"), *args],
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


def test_the_learner_reads_the_producers_manifest(compose):
    text = compose("--profile", "cpu", "config")
    producer = text.split("\n  producer:")[1].split("\n  prometheus:")[0]
    learner = text.split("\n  learner:")[1].split("\n  producer:")[0] if "\n  learner:" in text else ""
    written = re.search(r"--manifest (\S+)", producer).group(1)
    assert f"--manifest {written}" in " ".join(learner.split()), learner
    assert f"-s {written}" in " ".join(learner.split())  # it waits until the producer has written it
