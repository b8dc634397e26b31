"""The compose stack validates with Debian's docker-compose, offers what the README promises, and is
safe by default (issue 18): loopback ports, no Kafka on the host, Grafana behind a generated password,
unprivileged read-only streamer containers. The resolved config is parsed as YAML (no Docker here)."""

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KAFKA_HOST = ROOT / "deploy/compose.kafka-host.yml"


@pytest.fixture(scope="module")
def compose(docker_compose):
    def run(*args, files=("docker-compose.yml",), env=None):
        command = [docker_compose]
        for name in files:
            command += ["-f", str(ROOT / name)]
        environment = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")} | (env or {})
        result = subprocess.run([*command, *args], capture_output=True, text=True, cwd=ROOT, timeout=60,
                                env=environment)
        assert result.returncode == 0, result.stderr
        return result.stdout
    return run


@pytest.fixture(scope="module")
def stack(compose):
    """The resolved config of both profiles, as data (docker-compose validates it on the way)."""
    return yaml.safe_load(compose("--profile", "cpu", "--profile", "gpu", "config"))


def published(service: dict) -> list[str]:
    return [str(port) for port in service.get("ports", [])]


def test_services_ports_and_volumes_are_the_promised_ones(compose, stack):
    assert set(stack["services"]) == {"kafka", "producer", "learner", "learner-gpu", "prometheus", "grafana"}
    assert set(stack["volumes"]) == {"runs", "prometheus", "grafana"}
    ports = {port.split(":")[-1].split("/")[0] for service in stack["services"].values() for port in published(service)}
    assert ports == {"9464", "9090", "3000"}
    readme = (ROOT / "README.md").read_text()
    for url in ("localhost:9090", "localhost:3000", "localhost:9464/metrics"):
        assert url in readme, url


def test_every_published_port_binds_loopback_unless_streamer_bind_says_otherwise(compose, stack):
    for name, service in stack["services"].items():
        for port in published(service):
            assert port.startswith("127.0.0.1:"), (name, port)
    opened = yaml.safe_load(compose("--profile", "cpu", "config", env={"STREAMER_BIND": "0.0.0.0"}))
    assert published(opened["services"]["grafana"]) == ["0.0.0.0:3000:3000/tcp"]
    assert "STREAMER_BIND" in (ROOT / "docker-compose.yml").read_text().split("services:")[0]  # documented


def test_kafka_is_published_only_when_asked(compose, stack):
    assert not published(stack["services"]["kafka"])
    asked = yaml.safe_load(compose("--profile", "cpu", "config", files=("docker-compose.yml", str(KAFKA_HOST))))
    kafka = asked["services"]["kafka"]
    assert published(kafka) == ["127.0.0.1:9094:9094/tcp"]
    assert "HOST://localhost:9094" in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert "PLAINTEXT://kafka:9092" in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]


def test_grafana_has_no_anonymous_access_no_sign_up_and_a_secret_password(stack):
    grafana = stack["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env  # never a value in the compose file
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert [s["source"] if isinstance(s, dict) else s for s in grafana["secrets"]] == ["grafana_admin_password"]
    secret = Path(stack["secrets"]["grafana_admin_password"]["file"])
    assert secret == ROOT / "deploy/secrets/grafana_admin_password"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(secret)], cwd=ROOT)
    assert ignored.returncode == 0, "the Grafana password file must be gitignored"
    tracked = subprocess.run(["git", "ls-files", "deploy/secrets"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout.split() in ([], ["deploy/secrets/.gitignore"])


def test_streamer_containers_are_unprivileged_read_only_with_only_the_runs_volume(stack):
    for name in ("producer", "learner", "learner-gpu"):
        service = stack["services"][name]
        user = str(service["user"]).split(":")[0]
        assert user not in ("0", "root") and int(user) >= 1000, name
        assert service["read_only"] is True, name
        assert "/tmp" in service["tmpfs"], name
        assert [v.split(":")[0] if isinstance(v, str) else v["source"] for v in service["volumes"]] == ["runs"], name
        assert "ALL" in service["cap_drop"], name
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_dev_generates_the_grafana_password_once(tmp_path):
    shutil.copy(ROOT / "dev", tmp_path / "dev")
    first = subprocess.run(["bash", str(tmp_path / "dev"), "grafana-secret"], capture_output=True, text=True,
                           timeout=30)
    assert first.returncode == 0, first.stderr
    secret = tmp_path / "deploy/secrets/grafana_admin_password"
    password = secret.read_text().strip()
    assert len(password) >= 24 and password in first.stderr  # printed once, at generation
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    again = subprocess.run(["bash", str(tmp_path / "dev"), "grafana-secret"], capture_output=True, text=True,
                           timeout=30)
    assert again.returncode == 0 and password not in again.stderr + again.stdout
    assert secret.read_text().strip() == password
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(ROOT / "dev", other / "dev")
    subprocess.run(["bash", str(other / "dev"), "grafana-secret"], capture_output=True, text=True, timeout=30)
    assert (other / "deploy/secrets/grafana_admin_password").read_text().strip() != password  # random


def test_gpu_learner_reserves_a_gpu_and_answers_as_learner(stack):
    gpu = stack["services"]["learner-gpu"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["networks"]["default"]["aliases"] == ["learner"]


def test_mounted_configuration_exists_and_points_at_the_learner():
    prometheus = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    assert "learner:9464" in prometheus and "rules.yml" in prometheus
    assert (ROOT / "deploy/prometheus/rules.yml").is_file()
    assert (ROOT / "deploy/grafana/dashboards/streamer.json").is_file()
    assert any((ROOT / "deploy/grafana/provisioning/datasources").glob("*.yml"))
    assert any((ROOT / "deploy/grafana/provisioning/dashboards").glob("*.yml"))
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    assert "torch==2.13.0" in dockerfile and "streamer data build calm-multilingual" in dockerfile


def test_the_learner_reads_the_producers_manifest(stack):
    producer = " ".join(stack["services"]["producer"]["command"]) if isinstance(
        stack["services"]["producer"]["command"], list) else stack["services"]["producer"]["command"]
    learner = " ".join(" ".join(stack["services"]["learner"]["command"]).split())
    written = re.search(r"--manifest (\S+)", producer).group(1)
    assert f"--manifest {written}" in learner, learner
    assert f"-s {written}" in learner  # it waits until the producer has written it
    assert "--metrics-host 0.0.0.0" in learner  # inside the container: the compose network, where Prometheus is


def test_the_stacks_stream_never_ends_and_each_fragment_spans_several_scrapes(stack):
    """The producer sent 500 records a second (--rate 500): 99 of its 100 fragments were shorter than one
    5 s scrape, so most switch spikes never showed; and the stream ended, the learner's container exited at
    its end and StreamerExporterDown fired for good. It is looped now (the manifest says so: the learner
    goes on) and paced in bytes (--token-rate): a fragment of --lambda bytes lasts lambda / rate seconds on
    average, several scrapes, as benchmarks/spikes.py measured it; the README says the same."""
    command = stack["services"]["producer"]["command"]
    producer = " ".join(command) if isinstance(command, list) else command
    flags = dict(re.findall(r"--([\w-]+)(?: +([^-\s]\S*))?", producer))
    assert "loop" in flags and "rate" not in flags, producer
    scrape = re.search(r"scrape_interval: (\d+)s", (ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert float(flags["lambda"]) / float(flags["token-rate"]) >= 3 * int(scrape.group(1)), producer
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| producer |"))
    assert f"`--token-rate {flags['token-rate']}`" in row and "`--loop`" in row and "records/s" not in row, row
