"""Consumer groups: learners started beside a running one never crash it nor move its offsets.

A running daemon learner with an explicit --group; then (1) a second learner with the same --group
and another run directory is refused with one line and exit 2 (its join and leave are two rebalances
for the first, which hands over and seeks back to its own offsets), (2) a short learner of another
strategy with the default group flags gets a group of its own and learns its batches from the start,
(3) the same command again is refused (the run directory is locked). The first learns the whole
stream to the losses of an uninterrupted run. Real processes through the session's embedded broker."""

import json
import signal
import time

import pytest

from tests.conftest import write_corpus
from tests.learners import (assert_equal_losses, error_lines, finish, kill_leftovers, learn_command, line_count,
                            losses, produce, start, wait_for_lines)

TOPIC = "grouped"


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    kill_leftovers()


@pytest.fixture(scope="module")
def stream(broker, tmp_path_factory):
    """(root, manifest, total batches, reference losses) of topic TOPIC learned without interruption."""
    root = tmp_path_factory.mktemp("group")
    manifest = root / "manifest.json"
    produce(broker.bootstrap_servers, write_corpus(root / "corpus"), TOPIC, manifest, fragments=4, mean_tokens=1500)
    return root, manifest, json.loads(manifest.read_text())["total_batches"]


def test_learners_beside_a_running_one_leave_it_alone(broker, stream):
    root, manifest, total = stream
    bootstrap = broker.bootstrap_servers
    whole = start(learn_command(bootstrap, TOPIC, "--manifest", str(manifest), "--group", "grouped-whole",
                                "--run-dir", "whole"), root)
    first_command = learn_command(bootstrap, TOPIC, "--group", "shared", "--run-dir", "first")  # a daemon
    first = start(first_command, root)
    wait_for_lines(root / "first" / "losses.jsonl", first, 10)

    second = start(learn_command(bootstrap, TOPIC, "--group", "shared", "--run-dir", "second"), root, stderr_apart=True)
    other = start(learn_command(bootstrap, TOPIC, "--manifest", str(manifest), "--strategy", "ewc", "--max-batches", "20"),
                  root, stderr_apart=True)
    twice = start(first_command, root, stderr_apart=True)  # all three at once

    out, err = second.communicate(timeout=240)
    errors = error_lines(err)
    assert second.returncode == 2 and len(errors) == 1, err[-3000:]
    assert "group shared" in errors[0] and "other running member" in errors[0]
    assert line_count(root / "second" / "losses.jsonl") == 0

    out, err = other.communicate(timeout=240)
    assert other.returncode == 0, err[-3000:]
    assert f"group streamer-{TOPIC}-ewc" in out
    assert [line["batch"] for line in losses(root / "runs" / f"{TOPIC}-streamer-{TOPIC}-ewc")] == list(range(20))

    out, err = twice.communicate(timeout=240)
    errors = error_lines(err)
    assert twice.returncode == 2 and len(errors) == 1 and "in use by a running learner" in errors[0], err

    wait_for_lines(root / "first" / "losses.jsonl", first, total, timeout_s=300)
    time.sleep(1)  # nothing more comes: the stream's closing bytes are less than a batch
    first.send_signal(signal.SIGTERM)
    output = finish(first)
    assert first.returncode == 0, output[-3000:]
    assert finish(whole) is not None and whole.returncode == 0
    assert line_count(root / "first" / "losses.jsonl") == total
    assert_equal_losses(root / "first", [line["loss"] for line in losses(root / "whole")])
