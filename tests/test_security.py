"""Issue 18: Kafka security options reach every aiokafka client and never hold the secret; a broker
that refuses the credentials is one line and exit 2; state files cannot run code; the model hub is
never asked; product code has no pickle and no torch.load without weights_only=True.

The embedded Tansu 0.6.0 cannot run TLS or hold a SCRAM user (SECURITY.md says why), so the SASL
path is tested against it with authentication required: every password is refused there, which is
the wrong-password path the clients take against any broker."""

import ast
import asyncio
import dataclasses
import json
import os
import ssl
import subprocess
from pathlib import Path

import pytest

from producers.security import KafkaSecurity
from streamer.broker import EmbeddedBroker
from streamer.cli.main import main
from streamer.settings import forbid_model_hub, kafka_client_options
from tests.conftest import write_corpus

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("streamer", "producers", "monitor")
SECRET = "correct-horse-battery-staple"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed CA and a client certificate made here with the openssl CLI (no downloads)."""
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
                    "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.pem")],
                   check=True, capture_output=True)
    return folder


@pytest.fixture(scope="module")
def auth_broker():
    with EmbeddedBroker(authentication=True) as running:
        yield running


def test_kafka_security_holds_where_the_password_is_never_the_password(monkeypatch, tmp_path):
    security = KafkaSecurity(protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256", username="learner",
                             password_env="KAFKA_PW")
    monkeypatch.setenv("KAFKA_PW", SECRET)
    assert SECRET not in json.dumps(dataclasses.asdict(security)) + repr(security) + security.describe()
    options = kafka_client_options(security)
    assert options == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                       "sasl_plain_username": "learner", "sasl_plain_password": SECRET}
    (tmp_path / "pw").write_text(SECRET + "\n")
    from_file = dataclasses.replace(security, password_env=None, password_file=str(tmp_path / "pw"))
    assert kafka_client_options(from_file)["sasl_plain_password"] == SECRET
    monkeypatch.delenv("KAFKA_PW")
    with pytest.raises(ValueError, match="variable KAFKA_PW is not set"):
        kafka_client_options(security)
    for bad, message in ((dict(protocol="SASL_SSL"), "needs a username"),
                         (dict(protocol="SASL_SSL", username="u"), "exactly one of"),
                         (dict(protocol="PLAINTEXT", username="u"), "SASL options need"),
                         (dict(protocol="PLAINTEXT", ca_file="ca.pem"), "TLS files need"),
                         (dict(protocol="SSL", cert_file="c.pem"), "both --ssl-cert and --ssl-key"),
                         (dict(protocol="TLS"), "is not one of")):
        with pytest.raises(ValueError, match=message):
            KafkaSecurity(**bad)


def test_tls_and_sasl_options_reach_every_aiokafka_client(tls_files, monkeypatch):
    from aiokafka import AIOKafkaProducer

    from streamer.kafka.consumer import KafkaSource

    monkeypatch.setenv("STREAMER_KAFKA_PASSWORD", SECRET)
    security = KafkaSecurity(protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", username="u",
                             password_env="STREAMER_KAFKA_PASSWORD", ca_file=str(tls_files / "ca.pem"))
    options = kafka_client_options(security)
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname and len(context.get_ca_certs()) == 1  # our CA, not the system's

    async def client():  # aiokafka takes them as they are
        return AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **options).client

    made = asyncio.run(client())
    assert made._security_protocol == "SASL_SSL" and made._sasl_mechanism == "SCRAM-SHA-512"
    assert made._ssl_context is context
    source = KafkaSource("127.0.0.1:1", "t", "g", security=security,  # consumer and dead-letter producer
                         client_options=options)
    assert source._client_options["sasl_plain_password"] == SECRET
    with pytest.raises(TypeError, match="client_options"):  # never plaintext for a source told of credentials
        KafkaSource("127.0.0.1:1", "t", "g", security=security)
    with pytest.raises(ValueError, match="TLS files cannot be loaded"):
        kafka_client_options(dataclasses.replace(security, ca_file=str(tls_files / "ca.key")))


def test_the_password_is_never_a_flag(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["produce", "--sasl-password", SECRET, "--corpus", str(tmp_path)])
    assert exited.value.code == 2 and SECRET not in capsys.readouterr().err
    monkeypatch.delenv("STREAMER_KAFKA_PASSWORD", raising=False)
    assert main(["produce", "--security-protocol", "SASL_PLAINTEXT", "--sasl-username", "u",
                 "--corpus", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("streamer produce: error: the Kafka SASL password variable "
                                       "STREAMER_KAFKA_PASSWORD is not set\n")


def test_a_refused_password_is_one_line_and_exit_2_for_producer_and_learner(auth_broker, tmp_path, monkeypatch,
                                                                            capsys):
    corpus = write_corpus(tmp_path / "corpus")
    sasl = ("--bootstrap-servers", auth_broker.bootstrap_servers, "--topic", "secure",
            "--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "SCRAM-SHA-512", "--sasl-username", "alice")
    monkeypatch.setenv("STREAMER_KAFKA_PASSWORD", SECRET)
    assert main(["produce", *sasl, "--corpus", str(corpus), "--fragments", "2", "--probe-tokens", "0",
                 "--manifest", str(tmp_path / "m.json")]) == 2
    produced = capsys.readouterr()
    assert produced.err.count("\n") == 1 and "refused the connection as alice (SCRAM-SHA-512)" in produced.err
    run_dir = tmp_path / "run"
    assert main(["learn", *sasl, "--run-dir", str(run_dir), "--no-view", "--hidden", "8", "--embedding", "4",
                 "--max-batches", "1"]) == 2
    learned = capsys.readouterr()
    assert learned.err.count("\n") == 1 and "SCRAM authentication failed" in learned.err
    assert "STREAMER_KAFKA_PASSWORD" in learned.err
    written = (run_dir / "config.json").read_text()
    assert json.loads(written)["kafka_security"]["password_env"] == "STREAMER_KAFKA_PASSWORD"
    assert SECRET not in written + produced.out + learned.out + produced.err + learned.err


def test_sasl_to_a_plaintext_listener_is_one_line_that_names_the_security_to_check(broker, tmp_path, monkeypatch,
                                                                                    capsys):
    """A listener that does not take SASL (the plaintext broker answers UnsupportedSaslMechanism, which aiokafka
    takes for no answer) was 'cannot reach Kafka ... (no answer for 10 s)': nothing pointed at the protocol."""
    corpus = write_corpus(tmp_path / "corpus")
    sasl = ("--bootstrap-servers", broker.bootstrap_servers, "--topic", "sasl-to-plaintext", "--broker-timeout", "2",
            "--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "SCRAM-SHA-512", "--sasl-username", "alice")
    monkeypatch.setenv("STREAMER_KAFKA_PASSWORD", SECRET)
    hint = ("(no answer for 2 s; --broker-timeout); or its listener there does not take SASL_PLAINTEXT: check "
            "--security-protocol, --sasl-mechanism and the port\n")
    assert main(["produce", *sasl, "--corpus", str(corpus), "--fragments", "2", "--probe-tokens", "0",
                 "--manifest", str(tmp_path / "m.json")]) == 2
    produced = capsys.readouterr().err.splitlines(keepends=True)
    assert produced[-1].endswith(f"cannot reach Kafka at {broker.bootstrap_servers} {hint}")
    assert main(["learn", *sasl, "--run-dir", str(tmp_path / "run"), "--no-view", "--hidden", "8", "--embedding", "4",
                 "--max-batches", "1"]) == 2
    learned = capsys.readouterr().err.splitlines(keepends=True)
    assert learned[-1].endswith(f"cannot reach Kafka at {broker.bootstrap_servers} {hint}")
    assert SECRET not in "".join(produced + learned)


class Payload:
    """Unpickling this would create the marker file: the code a crafted state file would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_checkpoint_with_a_pickled_object_is_refused_and_runs_nothing(tmp_path, capsys):
    import torch

    from streamer import checkpoint

    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save({"format_version": 1, "config": {}, "strategy": {"memory": Payload(marker)}},
               run_dir / "checkpoint.pt")
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load it"):
        checkpoint.load(run_dir / "checkpoint.pt")
    assert main(["learn", "--bootstrap-servers", "127.0.0.1:9", "--topic", "t", "--run-dir", str(run_dir),
                 "--no-view", "--hidden", "8", "--embedding", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds Python objects" in err and "--fresh" in err
    assert not marker.exists()


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def test_product_code_has_no_pickle_and_no_unsafe_torch_load():
    found = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                if any(name.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "shelve", "marshal")
                       for name in names):
                    found.append(f"{path}: imports {names}")
            for call in _calls(tree):
                if ast.unparse(call.func) in ("torch.load", "load") and "torch" in ast.unparse(call.func):
                    safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in call.keywords)
                    if not safe:
                        found.append(f"{path}:{call.lineno}: torch.load without weights_only=True")
                if ast.unparse(call.func) in ("eval", "exec", "yaml.load"):
                    found.append(f"{path}:{call.lineno}: {ast.unparse(call.func)}")
    assert found == []


def test_the_command_line_forbids_the_model_hub_before_transformers_loads(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    assert main(["weights", "list"]) == 0
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    forbid_model_hub()  # idempotent
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    main_source = (ROOT / "streamer/cli/main.py").read_text()
    assert main_source.index("forbid_model_hub()") < main_source.index("args = parse(argv)")


@pytest.fixture(scope="module")
def server_cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (openssl CLI), its own CA."""
    folder = tmp_path_factory.mktemp("server-tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem")], check=True, capture_output=True)
    return folder


def _get(url: str, context=None, auth: str | None = None) -> tuple[int, bytes]:
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_exporter_serves_https_with_basic_auth_and_stays_on_loopback(server_cert, tmp_path):
    from monitor.exporter import create_metrics, serve
    from monitor.web_security import MetricsSecurity

    (tmp_path / "auth").write_text("prometheus:" + SECRET + "\n")
    security = MetricsSecurity(cert_file=str(server_cert / "cert.pem"), key_file=str(server_cert / "key.pem"),
                               auth_file=str(tmp_path / "auth"))
    server, _ = serve(create_metrics(), 0, security=security)
    try:
        assert server.server_address[0] == "127.0.0.1"  # the default host: this machine only
        port = server.server_address[1]
        trusted = ssl.create_default_context(cafile=str(server_cert / "cert.pem"))
        base = f"https://127.0.0.1:{port}"
        status, body = _get(f"{base}/metrics", trusted, auth=f"prometheus:{SECRET}")
        assert status == 200 and b"streamer_" in body
        assert _get(f"{base}/metrics", trusted)[0] == 401
        assert _get(f"{base}/metrics", trusted, auth="prometheus:wrong")[0] == 401
        assert _get(f"{base}/healthz", trusted) == (200, b"ok\n")  # probes need no secret
        with pytest.raises(OSError):  # plain HTTP is not answered, and an unknown CA is refused
            _get(f"http://127.0.0.1:{port}/healthz")
        with pytest.raises(OSError):
            _get(f"{base}/healthz", ssl.create_default_context())
        assert _get(f"{base}/readyz", trusted) == (200, b"ok\n")  # a failed handshake does not stop it
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="needs both --metrics-tls-cert and --metrics-tls-key"):
        MetricsSecurity(cert_file="cert.pem")
    (tmp_path / "bad").write_text("no colon here\n")
    with pytest.raises(ValueError, match="one line USER:PASSWORD"):
        serve(create_metrics(), 0, security=MetricsSecurity(auth_file=str(tmp_path / "bad")))


def test_status_reads_an_endpoint_served_over_https_with_basic_auth(server_cert, tmp_path):
    """`streamer status` of a learner whose metrics need its certificate and credentials: it uses the
    files config.json names (before: 'unreachable (Unauthorized)', and plain HTTP to an HTTPS endpoint)."""
    import json
    from dataclasses import asdict

    from monitor.exporter import create_metrics, serve
    from monitor.web_security import MetricsSecurity
    from streamer.cli.status import run_status

    (tmp_path / "auth").write_text("prometheus:" + SECRET + "\n")
    security = MetricsSecurity(cert_file=str(server_cert / "cert.pem"), key_file=str(server_cert / "key.pem"),
                               auth_file=str(tmp_path / "auth"))
    metrics = create_metrics()
    metrics.batches_learned_total.labels("run", "naive").inc(7)
    server, _ = serve(metrics, 0, security=security)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"topic": "t", "metrics_address": f"127.0.0.1:{server.server_address[1]}",
              "metrics_security": asdict(security)}
    try:
        (run_dir / "config.json").write_text(json.dumps(config))
        shown = run_status(run_dir)["metrics"]
        assert shown["url"].startswith("https://") and shown["values"]["batches"] == 7, shown
        (tmp_path / "auth").chmod(0)  # a credentials file this user cannot read: said, not a traceback
        if os.geteuid() != 0:
            assert run_status(run_dir)["metrics"]["error"].startswith("not read: cannot read the metrics auth file")
        (tmp_path / "auth").chmod(0o600)
        (run_dir / "config.json").write_text(json.dumps({**config, "metrics_security": {**asdict(security),
                                                                                        "auth_file": None}}))
        assert "Unauthorized" in run_status(run_dir)["metrics"]["error"]
        (run_dir / "config.json").write_text(json.dumps({**config, "metrics_security": {**asdict(security),
                                                                                        "client_ca_file": "ca.pem"}}))
        assert "asks scrapers for a client certificate" in run_status(run_dir)["metrics"]["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_security_settings_come_from_the_toml_config_and_reach_learn_config(tmp_path, server_cert, monkeypatch):
    from streamer.cli.configs import model_config
    from streamer.cli.main import parse

    monkeypatch.setenv("LEARNER_PW", SECRET)
    (tmp_path / "auth").write_text(f"prometheus:{SECRET}\n")
    (tmp_path / "run.toml").write_text(
        'security_protocol = "SASL_PLAINTEXT"\nsasl_mechanism = "SCRAM-SHA-256"\nsasl_username = "learner"\n'
        'sasl_password_env = "LEARNER_PW"\n'
        f'metrics_tls_cert = "{server_cert / "cert.pem"}"\nmetrics_tls_key = "{server_cert / "key.pem"}"\n'
        f'metrics_auth_file = "{tmp_path / "auth"}"\n')
    args = parse(["learn", "--config", str(tmp_path / "run.toml"), "--sasl-username", "other"])
    config = model_config(args, bootstrap_servers="b:9092", topic="t", run_dir=tmp_path / "run")
    assert config.kafka_security == KafkaSecurity(protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
                                                  username="other", password_env="LEARNER_PW")  # the flag wins
    assert config.metrics_security.tls and config.metrics_security.auth_file == str(tmp_path / "auth")
    from streamer import checkpoint

    assert SECRET not in json.dumps(checkpoint.plain(config), default=str)  # what config.json and checkpoints hold
