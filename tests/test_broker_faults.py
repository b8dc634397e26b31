"""The broker goes away: `streamer learn` and `streamer produce` as real processes, against an embedded
Tansu broker of each test's own (frozen with SIGSTOP, killed with SIGKILL), never the session's.

- Frozen for some seconds and thawed: the learner says once that the broker is lost and once that it
  is back, /readyz answers 503 meanwhile, and the run finishes with the losses of an uninterrupted
  run of the same stream and seed (1e-4 nats). It was started before its topic existed: it said so
  and waited.
- Killed for good: the learner exits 2 within --broker-timeout (plus the time to stop), with one line
  on stderr and a checkpoint of every batch it learned; a paced producer exits 2 with one line.
- Unreachable at start: learner and producer exit 2 with one line naming the address."""

import asyncio
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streamer import checkpoint
from streamer.broker import EmbeddedBroker, free_port
from tests.conftest import write_corpus
from tests.learners import (ENV, assert_equal_losses, error_lines, finish, kill_leftovers, learn_command, line_count,
                            losses, produce, produce_command, start, wait_for_lines, wait_for_output)

FRAGMENTS, LAMBDA = 4, 1500  # about 200 batches of 3 x 10 bytes


@pytest.fixture
def own_broker():
    broker = EmbeddedBroker().start()
    try:
        yield broker
    finally:
        if broker.running:
            os.kill(broker.pid, signal.SIGCONT)
        broker.stop()


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    kill_leftovers()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("faults") / "corpus")


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return answer.status == 200
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
        return False
    except OSError:
        return True  # the server is busy or not up yet: not an answer


@pytest.mark.slow  # a 10 s freeze between a paced producer and two learners: about a minute
def test_a_frozen_broker_thawed_leaves_the_run_finishing_equal(own_broker, corpus, tmp_path):
    bootstrap = own_broker.bootstrap_servers
    manifest = tmp_path / "manifest.json"
    produce(bootstrap, corpus, "faults-whole", manifest, FRAGMENTS, LAMBDA)  # the same stream, for the reference
    whole = start(learn_command(bootstrap, "faults-whole", "--manifest", str(manifest), "--run-dir", "whole"), tmp_path)
    port = free_port()
    learner = start(learn_command(bootstrap, "faults", "--manifest", str(manifest), "--run-dir", "frozen",
                                  "--broker-timeout", "60", "--metrics-port", str(port)), tmp_path)
    said = wait_for_output(learner, "topic faults does not exist")  # it waits for its topic
    producer = start(produce_command(bootstrap, corpus, "faults", tmp_path / "paced.json", FRAGMENTS, LAMBDA,
                                     "--rate", "100", "--broker-timeout", "60"), tmp_path)
    wait_for_lines(tmp_path / "frozen" / "losses.jsonl", learner, 20)
    os.kill(own_broker.pid, signal.SIGSTOP)
    frozen_at, seen_not_ready = time.monotonic(), False
    while time.monotonic() - frozen_at < 10:
        seen_not_ready = seen_not_ready or not ready(port)
        time.sleep(0.5)
    os.kill(own_broker.pid, signal.SIGCONT)
    output = finish(learner)
    assert learner.returncode == 0, output[-3000:]
    assert producer.wait(timeout=120) == 0, finish(producer)[-3000:]
    assert finish(whole) and whole.returncode == 0
    said = said + output.splitlines()
    lost, back = sum(" is lost " in line for line in said), sum(" is back " in line for line in said)
    assert lost >= 1 and back == lost, output[-3000:]  # one line each way per outage (a busy broker may add one)
    assert seen_not_ready, "/readyz never answered 503 while the broker was frozen"
    assert_equal_losses(tmp_path / "frozen", [line["loss"] for line in losses(tmp_path / "whole")])


def test_a_broker_killed_for_good_ends_learner_and_producer_with_one_line(own_broker, corpus, tmp_path):
    bootstrap = own_broker.bootstrap_servers
    produce(bootstrap, corpus, "killed", tmp_path / "manifest.json", FRAGMENTS, LAMBDA)
    run_dir = tmp_path / "killed-run"
    learner = start(learn_command(bootstrap, "killed", "--run-dir", str(run_dir), "--broker-timeout", "4",
                                  "--checkpoint-every", "1"),  # no manifest: a daemon, it waits for more
                    tmp_path, stderr_apart=True)
    producer = start(produce_command(bootstrap, corpus, "killed-paced", tmp_path / "paced.json", FRAGMENTS, LAMBDA,
                                     "--rate", "20", "--broker-timeout", "3"), tmp_path, stderr_apart=True)
    wait_for_lines(run_dir / "losses.jsonl", learner, 10)
    os.kill(own_broker.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    out, err = learner.communicate(timeout=120)
    seconds = time.monotonic() - killed_at
    assert learner.returncode == 2, out[-3000:] + err[-3000:]
    errors = error_lines(err)
    assert len(errors) == 1 and bootstrap in errors[0] and "--broker-timeout" in errors[0], err
    assert seconds < 4 + 30, f"exit {seconds:.1f}s after the kill"
    assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == line_count(run_dir / "losses.jsonl") > 0
    assert " is lost " in out
    p_out, p_err = producer.communicate(timeout=120)
    assert producer.returncode == 2, p_out[-2000:] + p_err[-2000:]
    assert len(error_lines(p_err)) == 1 and bootstrap in p_err, p_err
    print(f"broker killed: the learner exited 2 after {seconds:.1f}s (--broker-timeout 4)")


@pytest.mark.slow  # two ranks, a paced producer and a broker lost for 4 s: about 40 s
def test_a_broker_killed_under_ranks_ends_with_rank_0s_line_and_report(own_broker, corpus, tmp_path):
    """Under --nproc 2 the ranks stop at the same step with status 2. Rank 1 used to end at once while
    rank 0 still wrote its report; torchrun's agent then killed rank 0 (SIGTERM) and the launcher named
    rank 1, which had said nothing, as the failed rank. Now rank 0 ends first, its report whole."""
    bootstrap, streams = own_broker.bootstrap_servers, ("--streams", "4")
    start(produce_command(bootstrap, corpus, "ranks-killed", tmp_path / "paced.json", FRAGMENTS, LAMBDA, *streams,
                          "--partitions", "4", "--rate", "60", "--broker-timeout", "600"), tmp_path)
    run_dir = tmp_path / "ranks-killed-run"
    learner = start(learn_command(bootstrap, "ranks-killed", *streams, "--run-dir", str(run_dir), "--broker-timeout",
                                  "4", "--nproc", "2"), tmp_path, stderr_apart=True)  # no manifest: a daemon
    wait_for_lines(run_dir / "losses.jsonl", learner, 20)
    os.kill(own_broker.pid, signal.SIGKILL)
    out, err = learner.communicate(timeout=120)
    assert learner.returncode == 2, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    assert error_lines(err)[-2:] == [
        f"streamer learn: error: Kafka at {bootstrap} was lost for 4 s (--broker-timeout); the checkpoint at batch "
        f"{line_count(run_dir / 'losses.jsonl')} is in {run_dir}: the same command continues the run",
        "streamer learn: error: rank(s) 0 failed (exit status 2); their own lines are above; torchrun's agent then "
        "stopped rank(s) 1"], err
    assert (run_dir / "results.json").exists() and (run_dir / "loss_curve.png").exists()


def test_an_unreachable_broker_at_start_is_one_line_and_exit_2(corpus, tmp_path):
    nowhere = f"127.0.0.1:{free_port()}"
    learner = start(learn_command(nowhere, "t", "--run-dir", str(tmp_path / "run"), "--broker-timeout", "2",
                                  "--minutes", "0.01"),  # (a run shorter than the broker's timeout: still an error)
                    tmp_path, stderr_apart=True)
    producer = subprocess.run(produce_command(nowhere, corpus, "t", tmp_path / "m.json", 2, 300, "--broker-timeout", "2"),
                              cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    out, err = learner.communicate(timeout=120)
    for process, stderr in ((learner, err), (producer, producer.stderr)):
        errors = error_lines(stderr)
        assert process.returncode == 2 and len(errors) == 1, stderr
        assert f"cannot reach Kafka at {nowhere}" in errors[0] and "--broker-timeout" in errors[0]
    assert not (tmp_path / "m.json").exists()  # no manifest of a topic never written (`learn` would find it)


def test_a_missing_topic_ends_a_bounded_run_at_its_idle_timeout_or_its_minutes(broker, tmp_path):
    """A mistyped topic: the learner says it waits for it, and --idle-timeout (counted from then: no record
    can come before the topic exists; a group's join is not idle time) and --minutes still end the run,
    exit 0 with the stop's reason and a checkpoint at step 0, as they end a run whose records stop coming.
    Before, both waited for the topic (a bounded run hung for ever)."""
    cases = {reason: start(learn_command(broker.bootstrap_servers, f"no-such-topic-{reason}", "--run-dir",
                                        str(tmp_path / reason), *flags), tmp_path)  # both at once
             for flags, reason in ((["--idle-timeout", "2"], "idle"), (["--minutes", "0.05"], "time_limit"))}
    for reason, learner in cases.items():
        output, run_dir = finish(learner, timeout_s=120), tmp_path / reason
        assert learner.returncode == 0, output[-3000:]
        assert "does not exist" in output and f"[stopped: {reason}]" in output, output[-3000:]
        assert "Traceback" not in output
        assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == 0


def recreate_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Delete `topic` and create it anew, empty (an operator's re-creation; Tansu has no DeleteRecords)."""
    async def recreate():
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([topic])
            for _ in range(100):
                if topic not in await admin.list_topics():
                    break
                await asyncio.sleep(0.1)
            await admin.create_topics([NewTopic(topic, partitions, 1)])
        finally:
            await admin.close()

    asyncio.run(recreate())


def test_a_topic_recreated_under_a_learner_and_before_its_restart_is_refused_in_one_line(broker, corpus, tmp_path):
    """The topic re-created (empty) under a running learner: its offsets are past the new log's end. It stops
    with exit 2, one line naming the partition, and a checkpoint of what it learned; the same command then
    refuses at its start with the same line and learns nothing. Before, it said 'caught up' with lag 0 and,
    restarted, learned nothing of the new log's records below the checkpoint's offset, silently."""
    bootstrap, run_dir = broker.bootstrap_servers, tmp_path / "recreated-run"
    produce(bootstrap, corpus, "recreated", tmp_path / "manifest.json", 2, 600)
    command = learn_command(bootstrap, "recreated", "--run-dir", str(run_dir), "--checkpoint-every", "1")
    learner = start(command, tmp_path, stderr_apart=True)  # no manifest, no idle timeout: a daemon
    wait_for_lines(run_dir / "losses.jsonl", learner, 5)
    recreate_topic(bootstrap, "recreated")
    out, err = learner.communicate(timeout=60)
    assert learner.returncode == 2, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    errors = error_lines(err)
    assert len(errors) == 1 and "recreated:0 ends at offset 0, before this learner's offset" in errors[0], err
    assert "re-created or truncated" in errors[0] and "--fresh" in errors[0], err
    learned = line_count(run_dir / "losses.jsonl")
    state = checkpoint.load(run_dir / "checkpoint.pt")
    assert state["step"] == learned > 0
    restarted = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 2, restarted.stdout[-3000:] + restarted.stderr[-3000:]
    own = state["offsets"]["recreated:0"]
    assert error_lines(restarted.stderr) == [
        f"streamer learn: error: recreated:0 ends at offset 0, before this learner's offset {own} there (its "
        "checkpoint's, or read so far): the topic was re-created or truncated, so the checkpoint's offsets are not "
        "this log's; start a new model with --fresh (from the topic's beginning), or give another --run-dir or "
        "--group"], restarted.stderr
    assert line_count(run_dir / "losses.jsonl") == learned


def delete_topic(bootstrap: str, topic: str) -> None:
    async def delete():
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()

    asyncio.run(delete())


@pytest.mark.slow  # (24 s; a re-created topic, the stop's other outcome, is the default suite's)
def test_a_topic_deleted_under_a_learner_is_said_and_it_stops_in_one_line_with_its_checkpoint(broker, corpus,
                                                                                              tmp_path):
    """The learner said nothing and showed caught up, lag 0, ready, for minutes, until the Kafka client's
    metadata refresh created the topic again, empty. Now one line says it is gone, and the learner stops
    with its checkpoint, exit 2 and one line: after --broker-timeout, as for a lost broker, or at once when
    the topic comes back empty (the client's own refresh creates it again on a broker that auto-creates
    topics, as Tansu does: then it is a re-created log)."""
    bootstrap, run_dir = broker.bootstrap_servers, tmp_path / "deleted-run"
    produce(bootstrap, corpus, "deleted", tmp_path / "manifest.json", 2, 600)
    command = learn_command(bootstrap, "deleted", "--run-dir", str(run_dir), "--broker-timeout", "6")
    learner = start(command, tmp_path, stderr_apart=True)  # no manifest, no idle timeout: a daemon
    wait_for_lines(run_dir / "losses.jsonl", learner, 5)
    delete_topic(bootstrap, "deleted")
    out, err = learner.communicate(timeout=90)
    assert learner.returncode == 2 and "Traceback" not in out + err, out[-3000:] + err[-3000:]
    assert f"topic deleted is gone from {bootstrap} (deleted" in out, out[-3000:] + err
    learned = line_count(run_dir / "losses.jsonl")
    assert checkpoint.load(run_dir / "checkpoint.pt")["step"] == learned > 0
    errors = error_lines(err)
    assert len(errors) == 1 and (
        errors[0] == f"streamer learn: error: topic deleted was gone from {bootstrap} (deleted) for 6 s "
                     f"(--broker-timeout); the checkpoint at batch {learned} is in {run_dir}: the same command "
                     "continues the run"
        or errors[0].startswith("streamer learn: error: deleted:0 ends at offset 0, before this learner's offset")), err
