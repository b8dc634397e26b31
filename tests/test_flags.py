"""Bad flags and files: one line on stderr, exit 2, before any work (no run directory is created)."""

import socket
import subprocess
import sys

import pytest

from streamer.cli.checks import check_bootstrap, check_hyperparameters
from streamer.cli.errors import UserError


def streamer(*args, cwd):
    return subprocess.run([sys.executable, "-m", "streamer.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(done, *expected):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


CASES = {
    "set-not-a-number": (["learn", "--strategy", "replay", "--set", "p_write=abc"], ["p_write", "number"]),
    "set-out-of-range": (["learn", "--strategy", "replay", "--set", "p_write=-1"], ["p_write", "[0, 1]"]),
    "set-unknown-key-lists-keys": (["learn", "--strategy", "replay", "--set", "pwrite=0.2"],
                                   ["pwrite", "p_write, r_interval"]),
    "set-count": (["learn", "--strategy", "poe", "--set", "n_experts=0"], ["n_experts", ">= 1"]),
    "set-integer": (["learn", "--strategy", "replay", "--set", "memory_size=2.5"], ["memory_size", "integer"]),
    "metrics-port-range": (["learn", "--metrics-port", "99999"], ["--metrics-port", "99999"]),
    "bootstrap": (["learn", "--bootstrap-servers", "no port here"], ["--bootstrap-servers"]),
    "bootstrap-port": (["learn", "--bootstrap-servers", "localhost:99999"], ["--bootstrap-servers"]),
    "model-name": (["learn", "--model", "hf-causal", "--model-opt", "name=nobody/no-such-model-xyz"],
                   ["name=nobody/no-such-model-xyz", "path=DIR"]),
    "broker-port-range": (["broker", "--port", "70000"], ["--port"]),
    "compare-set": (["compare", "--strategies", "naive,replay", "--set", "p_write=7"], ["p_write"]),
    "compare-unknown": (["compare", "--strategies", "naive,replay", "--set", "nothing=1"], ["nothing", "p_write"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_flag_is_one_line_and_exit_2_before_any_work(tmp_path, case):
    args, expected = CASES[case]
    done = streamer(*args, cwd=tmp_path)
    assert_one_line_error(done, *expected)
    assert list(tmp_path.iterdir()) == []  # no runs/, no report/, nothing


def test_taken_ports_are_named(tmp_path, taken_port):
    assert_one_line_error(streamer("learn", "--metrics-port", str(taken_port), cwd=tmp_path),
                          f"port {taken_port}", "in use")
    assert_one_line_error(streamer("broker", "--port", str(taken_port), cwd=tmp_path), f"port {taken_port}", "in use")
    assert list(tmp_path.iterdir()) == []


def test_files_that_cannot_be_used(tmp_path):
    binary = tmp_path / "config.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(streamer("learn", "--config", str(binary), cwd=tmp_path), "config.toml", "not a TOML file")
    not_toml = tmp_path / "bad.toml"
    not_toml.write_text("fragments = = 3\n")
    assert_one_line_error(streamer("learn", "--config", str(not_toml), cwd=tmp_path), "not valid TOML")
    table = tmp_path / "table.toml"
    table.write_text("[strategy.replay]\np_write = 3.0\n")
    assert_one_line_error(streamer("learn", "--strategy", "replay", "--config", str(table), cwd=tmp_path),
                          "p_write", "[0, 1]")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert_one_line_error(streamer("learn", "--run-dir", str(a_file), cwd=tmp_path), "is a file")
    assert_one_line_error(streamer("learn", "--run-dir", str(a_file / "run"), cwd=tmp_path), "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bad.toml", "config.toml", "table.toml"]


def test_hyperparameters_are_typed_from_their_defaults():
    assert check_hyperparameters("replay", [("p_write", 1), ("memory_size", 5.0), ("selection", "herding")]) == [
        ("p_write", 1.0), ("memory_size", 5), ("selection", "herding")]
    assert check_hyperparameters("ewc", [("ewc_lambda", 0), ("gamma", 0.5)]) == [("ewc_lambda", 0.0), ("gamma", 0.5)]
    with pytest.raises(UserError, match="fisher_decay=1.5"):
        check_hyperparameters("ewc", [("fisher_decay", 1.5)])


@pytest.mark.parametrize("servers", ["127.0.0.1:9092", "kafka-0.svc:9092,kafka-1.svc:9093", "[::1]:9092"])
def test_bootstrap_addresses_that_parse(servers):
    check_bootstrap(servers)


@pytest.mark.parametrize("servers", ["", "host", ":9092", "host:", "host:0", "a b:1", "host:9092,"])
def test_bootstrap_addresses_that_do_not(servers):
    with pytest.raises(UserError):
        check_bootstrap(servers)
