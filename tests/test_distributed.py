"""N ranks learn as one model (streamer.distributed): 2 gloo ranks x 5 streams give, batch for batch, the
losses of 1 process x 10 streams on the same topic (produced with one partition per stream) and seed,
to 1e-4 nats, for naive (started by torchrun itself, and by the README's two-host commands with
both nodes on this machine) and poe (by `streamer learn --nproc 2`); a SIGTERM stops every rank at
the same step with rank 0's checkpoint of all ranks' offsets, and the same command continues to
the same losses, as it does after a rank is killed (-9) and after the launcher is (its ranks then
stop with a checkpoint); the errors a user can make are one line (among them a group's offsets without their
checkpoint: rank 0 on another host), and a learner of ranks and a one-process learner never share a
consumer group. Real processes through the embedded broker, a tiny LSTM, one torch thread per rank."""

import asyncio
import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from producers.kafka import ensure_topic, produce as kafka_produce
from streamer import checkpoint
from streamer.batching import Batcher
from streamer.broker import free_port, wait_for_port
from streamer.distributed import Ranks
from streamer.threads import available_cpus, rank_threads
from producers.wire import Record
from tests.conftest import WORDS, write_corpus
from tests.helpers import small_stream
from tests.learners import finish, kill_leftovers, line_count, start, wait_for_lines

STREAMER = [sys.executable, "-m", "streamer"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TOPIC = "distributed"
BATCHES = 40
POE = ["--strategy", "poe", "--set", "n_experts=3", "--set", "gate_steps=5", "--set", "warmup_batches=5"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def produce(broker, root: Path, topic: str, manifest: Path, *extra: str) -> list[str]:
    """`streamer produce` of the stream: 10 streams, one partition each (stream i -> partition i)."""
    return [*STREAMER, "produce", "--corpus", str(root / "corpus"), "--bootstrap-servers", broker.bootstrap_servers,
            "--topic", topic, "--fragments", "4", "--lambda", "2000", "--streams", "10", "--window", "10",
            "--seed", "0", "--partitions", "10", "--manifest", str(manifest), "--probe-tokens", "0", *extra]


@pytest.fixture(scope="module")
def stream(broker, tmp_path_factory):
    """The topic TOPIC, written at once."""
    root = tmp_path_factory.mktemp("distributed")
    write_corpus(root / "corpus")
    manifest = root / "manifest.json"
    result = subprocess.run(produce(broker, root, TOPIC, manifest), capture_output=True, text=True, timeout=120,
                            env=ENV)
    assert result.returncode == 0, result.stderr
    return root, manifest


@contextlib.contextmanager
def paced(broker, root: Path, topic: str, run_dir: Path, rate: int = 100):
    """The same stream as `topic`, written at `rate` records a second (40 batches are about 410 of its
    947 records: 4 s) from the moment the learner is up (rank 0 writes `run_dir`'s status.json once every
    rank joined; until the topic exists the learner waits for it), so that a fault lands mid-run however
    fast this host learns: the topic written beforehand, the 40 batches took 0.5 s and ended before the
    fault. Yields the flags that point `learn` at it."""
    producer = []

    def start_when_up() -> None:
        deadline = time.monotonic() + 180
        while not (run_dir / "status.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        producer.append(subprocess.Popen(produce(broker, root, topic, root / f"{topic}.manifest.json", "--rate",
                                                 str(rate)), env=ENV, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL))

    starter = threading.Thread(target=start_when_up, daemon=True)
    starter.start()
    try:
        yield ("--topic", topic)
    finally:
        starter.join(timeout=180)
        for process in producer:
            process.kill()
            process.wait()


def learn_flags(broker, manifest, run_dir: Path, *extra) -> list[str]:
    return ["learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", TOPIC, "--manifest", str(manifest),
            "--streams", "10", "--window", "10", "--hidden", "24", "--embedding", "8", "--no-view", "--no-probe",
            "--max-batches", str(BATCHES), "--group", run_dir.name, "--run-dir", str(run_dir), *extra]


def without(flags: list[str], flag: str) -> list[str]:
    """`flags` less `flag` and its value."""
    at = flags.index(flag)
    return flags[:at] + flags[at + 2:]


def run(command, cwd: Path, timeout: float = 240, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


def worst_difference(got: list[dict], expected: list[dict]) -> float:
    assert [line["batch"] for line in got] == list(range(len(expected)))  # each batch once, in order
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(got, expected))


@pytest.fixture(scope="module")
def one_process_naive(broker, stream):
    root, manifest = stream
    run_dir = root / "one-naive"
    result = run([*STREAMER, *learn_flags(broker, manifest, run_dir)], root)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = losses(run_dir)
    assert len(expected) == BATCHES
    return expected


def committed(broker, group: str) -> dict[str, int]:
    """Kafka's committed offsets of `group` on the topic's 10 partitions, as the checkpoint names them."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def read():
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap_servers, group_id=group,
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            return {f"{TOPIC}:{p}": await consumer.committed(TopicPartition(TOPIC, p)) for p in range(10)}
        finally:
            await consumer.stop()

    return asyncio.run(read())


def test_two_torchrun_ranks_give_the_losses_of_one_process_naive_and_their_checkpoint_is_theirs(
        broker, stream, one_process_naive):
    """`torchrun --standalone --nproc-per-node 2 -m streamer learn ...` learns one process's losses, and
    rank 0's checkpoint holds both ranks' state and offsets, committed to the group after it was written.
    That checkpoint is refused to one process, and the group's offsets to a run directory without it
    (rank 0 on another host), each in one line. (One test: a 2-rank run costs 15 CPU s, a module
    fixture was computed again on each xdist worker.)"""
    root, manifest = stream
    run_dir = root / "two-naive"
    result = run([*TORCHRUN, "--log-dir", str(root / "torchrun-logs"), "-m", "streamer",
                  *learn_flags(broker, manifest, run_dir)], root)
    assert result.returncode == 0, result.stderr[-3000:]
    worst = worst_difference(losses(run_dir), one_process_naive)
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"
    saved = checkpoint.load(run_dir / "checkpoint.pt")  # rank 0's, with both ranks' state and offsets
    assert saved["world_size"] == 2 and [part["loop"]["step"] for part in saved["ranks"]] == [BATCHES, BATCHES]
    assert sorted(saved["offsets"]) == sorted(f"{TOPIC}:{p}" for p in range(10))
    assert [sorted(part["loop"]["offsets"]) for part in saved["ranks"]] == [
        [(TOPIC, p) for p in range(5)], [(TOPIC, p) for p in range(5, 10)]]
    assert [part["loop"]["dead_letters"] for part in saved["ranks"]] == [{}, {}]  # each record reached its rank
    assert committed(broker, run_dir.name) == saved["offsets"]  # each rank committed its own, after the write
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == sorted(
        ["checkpoint.pt", "config.json", "losses.jsonl", "manifest.json", "results.json", "loss_curve.png",
         "status.json"])
    assert json.loads((run_dir / "config.json").read_text())["ranks"] == 2  # (agem, ewc, replay differ per N)
    # a checkpoint of 2 ranks continued by one process (it would read 10 partitions with rank 0's carry-over)
    other_n = run([*STREAMER, *learn_flags(broker, manifest, run_dir, "--max-batches", str(BATCHES + 5))], root)
    assert (other_n.returncode, other_n.stderr.strip().splitlines()) == (2, [
        f"streamer learn: error: {run_dir} holds the checkpoint of a run of 2 rank(s); continue it with "
        "--nproc 2 (or torchrun --nproc-per-node 2), or start over with --fresh"])
    # its group from a run directory without the checkpoint (rank 0 on another host): every rank refuses,
    # rank 0 says why in one line, before anything is learned
    flags = learn_flags(broker, manifest, root / "elsewhere", "--nproc", "2")
    flags[flags.index("--group") + 1] = run_dir.name
    elsewhere = run([*STREAMER, *flags], root)
    said = [line for line in elsewhere.stderr.splitlines() if line.startswith("streamer learn: error:")]
    assert elsewhere.returncode == 2 and len(said) == 2, elsewhere.stderr[-3000:]
    assert said[0].startswith(f"streamer learn: error: group {run_dir.name} has committed offsets on topic "
                              f"{TOPIC} ({TOPIC}:0=") and "no checkpoint" in said[0]
    # the launcher's, naming rank 0, which said it (rank 1 ended first with 2 and was named: 2 of 5 tries)
    assert said[1].startswith("streamer learn: error: rank(s) 0 failed (exit status 2)"), said
    assert not (root / "elsewhere" / "losses.jsonl").exists()


def test_under_ranks_an_old_run_without_its_checkpoint_is_moved_aside_once_by_rank_0(
        broker, stream, one_process_naive):
    """A run dir holding an old run's history without its checkpoint.pt (removed or lost), learned into by
    `--nproc 2`: rank 0 alone decides and moves the old files aside, said in one line, and the two ranks
    learn the new run into the emptied directory (one process's losses); the old files are whole beside it."""
    root, manifest = stream
    old_dir, run_dir = root / "one-naive", root / "ranks-old-run"
    run_dir.mkdir()
    old = {name: (old_dir / name).read_bytes() for name in ("losses.jsonl", "config.json", "status.json",
                                                               "results.json")}
    for name, data in old.items():
        (run_dir / name).write_bytes(data)
    result = run([*STREAMER, *learn_flags(broker, manifest, run_dir, "--nproc", "2")], root)
    assert result.returncode == 0, result.stderr[-3000:]
    said = re.findall(rf"run dir {re.escape(str(run_dir))} holds a loss log of {BATCHES} batches but no "
                      r"checkpoint: its files moved to (\S+); a new run starts$", result.stdout, re.M)
    assert len(said) == 1, result.stdout[-3000:]
    aside = Path(said[0])
    assert aside.parent == root and aside.name.startswith("ranks-old-run.replaced-")
    assert {name: (aside / name).read_bytes() for name in old} == old
    worst = worst_difference(losses(run_dir), one_process_naive)
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"
    assert checkpoint.load(run_dir / "checkpoint.pt")["world_size"] == 2


def test_nproc_two_gives_the_losses_of_one_process_poe_and_rank_0_says_every_ranks_records(broker, stream):
    """`--nproc 2` poe learns the losses of one process, each rank pinned to its CPUs with its own thread
    policy, and leaves no temporary file. The learner's console, status file and metrics are rank 0's,
    and describe all the ranks: a record with a key that is no stream's, at the head of rank 1's partition
    7, is rank 1's dead letter, yet rank 0 counts it (the run's last line, status.json, hence
    streamer_dead_letter_total), and shows the lag of all 10 partitions and every rank's records: each
    rank reports them every second and at the stop. (One topic for both: two 2-rank runs cost 17 CPU s.)"""
    root, _ = stream
    topic = "distributed-poison"

    async def poison() -> None:  # the topic first, then the record, at the head of partition 7
        await ensure_topic(broker.bootstrap_servers, topic, partitions=10)
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
        await producer.start()
        try:
            await producer.send_and_wait(topic, key="²".encode(), value=b"no stream's", partition=7)
        finally:
            await producer.stop()

    asyncio.run(poison())
    manifest = root / "poison.manifest.json"
    produced = run(produce(broker, root, topic, manifest, "--append"), root)  # after the poison
    assert produced.returncode == 0, produced.stderr[-3000:]

    def flags(run_dir, *extra):
        return [*without(learn_flags(broker, manifest, run_dir, *POE, *extra), "--topic"), "--topic", topic]

    one = run([*STREAMER, *flags(root / "one-poe")], root)
    assert one.returncode == 0, one.stderr[-3000:]
    temporary = root / "tmp-poe"  # the launcher's temporary files: none may stay behind
    temporary.mkdir()
    unset = {name: value for name, value in ENV.items() if name != "OMP_NUM_THREADS"}  # the ranks split the CPUs
    run_dir = root / "two-poe"
    two = run([*STREAMER, *flags(run_dir, "--nproc", "2")], root, env={**unset, "TMPDIR": str(temporary)})
    assert two.returncode == 0, two.stderr[-3000:]
    cpus, share = sorted(os.sched_getaffinity(0)), available_cpus() // 2  # this machine: 2 CPUs, 1 each
    launched = two.stdout.splitlines()[0]  # the launcher's line (it applies no thread policy of its own)
    threads = rank_threads(len(cpus), 2)  # given as --threads: torchrun sets OMP_NUM_THREADS=1 in the ranks
    if share:
        assert launched.startswith("starting 2 ranks (") and launched.endswith(
            f" --threads {threads} --pin-cpus); each pinned to its {share} of the {len(cpus)} CPUs"), launched
        for rank in range(2):  # each rank on its own CPUs, its policy decided there as one learner's
            own = cpus[rank * share:(rank + 1) * share]
            shown = f"{own[0]}-{own[-1]}" if len(own) > 1 else str(own[0])
            assert f"CPUs {shown}: local rank {rank}'s share of 2 (--pin-cpus)" in two.stdout, two.stdout
    else:  # one CPU: nothing to share out
        assert launched.endswith(f" --threads {threads}); 1 CPUs for 2 ranks: not pinned"), launched
    said = two.stdout.splitlines()  # each rank says its own policy; rank 1's lines are labelled
    assert [line.split("(")[0] for line in said if "torch threads:" in line] in (
        [f"torch threads: {threads} ", f"rank 1: torch threads: {threads} "],
        [f"rank 1: torch threads: {threads} ", f"torch threads: {threads} "]), said
    assert two.stdout.count(f"torch threads: {threads} ({share or 1} CPUs, --threads") == 2, two.stdout
    # the launcher hands the ranks their OpenMP count itself: torchrun neither sets 1 nor warns about it
    assert "OMP_NUM_THREADS" not in two.stderr and "*****" not in two.stderr, two.stderr[-3000:]
    # torchrun's log folder: by default a new torchelastic_* each run; --nproc gives it one it removes.
    # (torch's inductor makes its one cache folder per user here too: that one is reused, not per run)
    assert [path.name for path in temporary.iterdir() if not path.name.startswith("torchinductor_")] == []
    worst = worst_difference(losses(run_dir), losses(root / "one-poe"))
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"
    assert "dead letters {'bad_key': 1}" in two.stdout, two.stdout[-3000:]
    saved = checkpoint.load(run_dir / "checkpoint.pt")
    assert [part["loop"]["dead_letters"] for part in saved["ranks"]] == [{}, {"bad_key": 1}]  # rank 1's
    status = json.loads((run_dir / "status.json").read_text())
    assert status["dead_letters"] == {"bad_key": 1}
    assert status["records"] == sum(part["loop"]["records"] for part in saved["ranks"])
    assert sorted(status["lag_by_partition"], key=int) == [str(partition) for partition in range(10)]
    assert status["lag"] == sum(status["lag_by_partition"].values())


def node_command(broker, manifest, run_dir: Path, port: int, node: int, *extra: str) -> list[str]:
    """The README's command for one of two machines (torchrun's c10d rendezvous, --nnodes 2), run on
    this one with the rendezvous on 127.0.0.1:`port`; --local-addr: the workers' master address, not
    this machine's host name."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "calm-run",
            "--local-addr", "127.0.0.1", "--log-dir", str(run_dir.parent / f"{run_dir.name}-node-{node}-logs"),
            "-m", "streamer", *learn_flags(broker, manifest, run_dir, *extra)]


def start_node(command: list[str], root: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_two_host_commands_give_the_losses_of_one_process(broker, stream, one_process_naive, tmp_path):
    """The README's two machines, both on this one: each node's only rank has local rank 0, and the
    global ranks still own their own streams and partitions. The same command on both, but only node
    0's host has this stream's manifest (produce ran there); node 1's cache holds a stale one of the same
    topic, which its --streams contradicts. Every rank learns by rank 0's manifest and stream, to the
    stream's end (node 1 refused its own, and node 0 waited on it; with none, it took its own defaults)."""
    root, manifest = stream
    run_dir = root / "two-nodes"
    port = free_port()  # for the rendezvous
    commands = [without(node_command(broker, manifest, run_dir, port, node), "--max-batches") for node in range(2)]
    commands[1] = without(commands[1], "--manifest")
    stale = tmp_path / "cache" / "streams" / f"{TOPIC}.manifest.json"  # where produce would have written it
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"streams": 4, "window": 20, "total_records": 80, "total_batches": 1,
                                 "classes": ["en"], "n_fragments": 1}))
    nodes = [start_node(commands[0], root),
             subprocess.Popen(commands[1], cwd=root, env={**ENV, "STREAMER_CACHE": str(tmp_path / "cache")},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    deadline = time.monotonic() + 240
    try:
        outputs = [node.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.terminate()  # the agent stops its workers (on a SIGKILL, the kernel's parent-death signal does)
        outputs = [node.communicate(timeout=60)[0] for node in nodes]
        pytest.fail("the two nodes did not finish in 240 s:\n" + "\n".join(output[-2000:] for output in outputs))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    learned = losses(run_dir)
    assert len(learned) == json.loads(manifest.read_text())["total_batches"]
    assert "stopped: end_of_stream" in outputs[0]
    worst = worst_difference(learned[:BATCHES], one_process_naive)
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"
    saved = checkpoint.load(run_dir / "checkpoint.pt")
    assert saved["world_size"] == 2 and sorted(saved["offsets"]) == sorted(f"{TOPIC}:{p}" for p in range(10))
    assert [sorted(part["loop"]["offsets"]) for part in saved["ranks"]] == [
        [(TOPIC, p) for p in range(5)], [(TOPIC, p) for p in range(5, 10)]]
    assert sum("run directory:" in output for output in outputs) == 1  # rank 0's node alone writes the run


def interrupted(command: list[str], root: Path, run_dir: Path, stop, checkpointed: bool = False,
                env=ENV) -> tuple[int, str]:
    """Start `command` (a --nproc run), call stop(process) once a third of the batches are logged (and,
    with `checkpointed`, a checkpoint written); its exit status and output."""
    process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    try:
        log, saved = run_dir / "losses.jsonl", run_dir / "checkpoint.pt"
        while (checkpointed and not saved.exists()) or not log.exists() or log.read_text().count("\n") < BATCHES // 3:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "not far enough in time"
            time.sleep(0.05)
        stop(process)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, output


def continued(command: list[str], root: Path, run_dir: Path, step: int, one_process: list[dict], env=ENV) -> None:
    """The same command continues from the checkpoint at `step` to the losses of one process."""
    again = run(command, root, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from the checkpoint at batch {step}" in again.stdout
    # the summary's batches, tokens and rate are this start's (before, the checkpoint's counted in a shorter time)
    assert f"\n{BATCHES - step} batches ({BATCHES} in all, resumed at {step}), " in again.stdout, again.stdout[-3000:]
    worst = worst_difference(losses(run_dir), one_process)  # each batch once, as in one process
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"


@pytest.mark.slow  # two hosts' agents, one killed, then both again: about 35 s of the default suite's 8 minutes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal")
def test_one_hosts_agent_killed_ends_the_other_host_at_once_and_the_two_commands_continue(
        broker, stream, one_process_naive):
    """Host B's torchrun killed (-9): its rank gets SIGTERM from the kernel, the per-step agreement stops
    host A's rank at the same step, rank 0 writes the checkpoint, and host A's torchrun ends at once
    (its rank exits 143, a stop by a signal: with 0, torchrun waited 5 minutes at its exit barrier for
    the dead agent, then ended with status 0). The same two commands continue to one process's losses."""
    root, manifest = stream
    run_dir = root / "host-b-killed"
    with paced(broker, root, "host-b-killed", run_dir) as topic:
        flags = ("--checkpoint-every", "0.3", *topic)
        port = free_port()
        host_a = start_node(node_command(broker, manifest, run_dir, port, 0, *flags), root)
        assert wait_for_port("127.0.0.1", port, 60), "host A's agent did not open the rendezvous"  # A hosts the store
        status, output = interrupted(node_command(broker, manifest, run_dir, port, 1, *flags), root, run_dir,
                                     lambda host_b: host_b.kill(), checkpointed=True)
        try:
            said_a, _ = host_a.communicate(timeout=60)  # not torchrun's 300 s exit barrier
        finally:
            host_a.kill()
        assert status == -signal.SIGKILL and host_a.returncode not in (0, None), said_a[-3000:]
        assert "stopped: signal" in said_a and "failed (exitcode: 143)" in said_a, said_a[-3000:]
        saved = checkpoint.load(run_dir / "checkpoint.pt")
        step = saved["step"]
        assert [part["loop"]["step"] for part in saved["ranks"]] == [step, step] and len(losses(run_dir)) == step
        assert step < BATCHES, step

        port = free_port()
        nodes = [start_node(node_command(broker, manifest, run_dir, port, node, *flags), root) for node in range(2)]
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    assert f"resuming from the checkpoint at batch {step}" in outputs[0], outputs[0][-3000:]
    worst = worst_difference(losses(run_dir), one_process_naive)
    assert worst <= 1e-4, f"largest difference {worst:.3g} nats"


# `streamer` that says which threads still run when its main returns, all left to the interpreter's exit;
# its flags reach main as its argv alone (sys.argv emptied): the ranks run the command main was given
STREAMER_SAYING_ITS_THREADS = [
    sys.executable, "-c", "import sys, threading; from streamer.cli.main import main; argv = sys.argv[1:]; "
    "del sys.argv[1:]; status = main(argv); "
    "print('threads left:', sorted(t.name for t in threading.enumerate()), flush=True); sys.exit(status)"]


def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_of_every_logged_batch(broker, stream):
    """The launcher ends 143 with no thread of torchrun's left to its interpreter's exit: there, the
    heartbeat thread of the rendezvous that the agent leaves unclosed on a signal, caught mid-call,
    aborted it once (SIGABRT). That the same command then continues to one process's losses is the
    launcher's kill -9 test's: its ranks meet the same SIGTERM (from the kernel) and stop by this path."""
    root, manifest = stream
    run_dir = root / "resumed"
    flags = learn_flags(broker, manifest, run_dir, "--checkpoint-every", "0.3", "--nproc", "2")
    status, output = interrupted([*STREAMER_SAYING_ITS_THREADS, *flags], root, run_dir,
                                 lambda process: process.send_signal(signal.SIGTERM))
    assert status == 128 + signal.SIGTERM, output[-3000:]  # the agent passed it to both ranks
    assert "threads left: ['MainThread']" in output, output[-3000:]
    saved = checkpoint.load(run_dir / "checkpoint.pt")
    step = saved["step"]
    assert BATCHES // 3 <= step < BATCHES, step
    assert [part["loop"]["step"] for part in saved["ranks"]] == [step, step]  # stopped at the same step
    assert len(losses(run_dir)) == step  # the final checkpoint covers every logged batch


@pytest.mark.slow  # a paced producer for one rank's partitions and --idle-timeout: about 30 s (the suite's budget)
def test_idle_timeout_is_the_learners_not_one_ranks_while_another_ranks_records_arrive(broker, stream):
    """`--idle-timeout` stops the ranks as it stops one process: once the learner as a whole has read no
    record for that long, not once one rank's partitions are quiet. Rank 1's streams 5-9 are written at
    once (stream 9 only its first records: the global batch soon waits for it), rank 0's streams 0-4 go
    on arriving for longer than the timeout, and rank 0's batches fill its queue meanwhile (it then reads
    none of them: the growing ends of its partitions count as records arriving). Before, rank 1 stopped
    every rank as idle a timeout after its last record, while rank 0's were still being written."""
    root, _ = stream
    topic, run_dir, idle_s = "distributed-idle", root / "two-idle", 4
    rng = random.Random(1)
    corpus = {name: "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(400))
              for name, words in WORDS.items()}
    records, _ = small_stream(corpus, fragments=6, mean_tokens=5000, streams=10, window=10, seed=3)
    count: dict[str, int] = {}
    at_once, later = [], []  # (stream 9's further records are never written)
    for record in records:
        count[record.stream] = count.get(record.stream, 0) + 1
        if count[record.stream] <= 20 or record.stream in "5678":
            at_once.append(record)
        elif record.stream != "9":
            later.append(record)
    asyncio.run(kafka_produce(at_once, broker.bootstrap_servers, topic, partitions=10))
    written = []

    def write_later() -> None:  # once the learner is up
        deadline = time.monotonic() + 180
        while not (run_dir / "status.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        asyncio.run(kafka_produce(later, broker.bootstrap_servers, topic, partitions=10, rate=80))
        written.append(time.monotonic())

    writer = threading.Thread(target=write_later, daemon=True)
    writer.start()
    flags = ["learn", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--streams", "10",
             "--window", "10", "--hidden", "24", "--embedding", "8", "--no-view", "--no-probe", "--group", run_dir.name,
             "--run-dir", str(run_dir), "--idle-timeout", str(idle_s), "--nproc", "2"]
    result = run([*STREAMER, *flags], root)
    ended = time.monotonic()
    writer.join(timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[stopped: idle]" in result.stdout, result.stdout[-3000:]
    assert written and ended > written[0] + idle_s / 2, result.stdout[-3000:]  # not before the writing ended
    assert len(losses(run_dir)) >= 10


def rank_1_of(launcher: subprocess.Popen) -> int:
    """The pid of rank 1 of a --nproc launcher."""
    found = rank_process(launcher.pid, 1)
    assert found is not None, "rank 1 not found among the launcher's children"
    return found


def rank_process(launcher: int, rank: int) -> int | None:
    """The pid of global rank `rank` among the launcher's children (torchrun's agent runs in the launcher)."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            if f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:  # gone meanwhile
            continue
    return None


@pytest.mark.slow  # a rank frozen for 7 s in a --nproc 2 run: about 40 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_frozen_a_while_is_said_and_its_wait_is_not_compute(broker, stream, one_process_naive):
    """A rank stopped (SIGSTOP) held the others in the step's agreement without a word, their console
    'consuming'; the wait was then counted as compute ('64.7s computing (3,726 tokens/s)' where the run
    computed 30.6 s). Now each waiting rank says so after 5 s and when the ranks meet again (in whichever
    collective rank 1 stopped before: an agreement, the gradients' all-reduce, a report), the wait is waiting,
    and the run ends with one process's losses."""
    root, manifest = stream
    run_dir = root / "rank-frozen"

    def freeze_rank_1(process: subprocess.Popen) -> None:
        frozen = rank_1_of(process)
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(7)
        os.kill(frozen, signal.SIGCONT)

    with paced(broker, root, "rank-frozen", run_dir) as topic:
        command = [*STREAMER, *learn_flags(broker, manifest, run_dir, "--nproc", "2", *topic)]
        status, output = interrupted(command, root, run_dir, freeze_rank_1)
    assert status == 0, output[-3000:]
    assert "the other ranks have not come to a collective for 5 s" in output, output[-3000:]
    assert "the ranks meet again after " in output, output[-3000:]
    waiting = re.search(r"computing \([0-9,]+ tokens/s\), ([0-9.]+)s waiting", output)
    assert waiting and float(waiting.group(1)) >= 5, output[-3000:]
    assert worst_difference(losses(run_dir), one_process_naive) <= 1e-4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_a_rank_is_one_line_and_the_same_command_continues(broker, stream, one_process_naive):
    """A rank killed (-9, the OOM killer's signal): torchrun's agent stops the other, the launcher says
    which rank failed, and the same command continues from the last checkpoint to the one-process losses."""
    root, manifest = stream
    run_dir = root / "rank-killed"

    def kill_rank_1(process: subprocess.Popen) -> None:
        os.kill(rank_1_of(process), signal.SIGKILL)

    with paced(broker, root, "rank-killed", run_dir) as topic:
        command = [*STREAMER, *learn_flags(broker, manifest, run_dir, "--checkpoint-every", "0.3", "--nproc", "2",
                                           *topic)]
        status, output = interrupted(command, root, run_dir, kill_rank_1, checkpointed=True)
        assert status == 2 and "Traceback" not in output, output[-3000:]
        last = output.strip().splitlines()[-1]  # rank 0, stopped by the agent, or failed in a collective with 1
        assert last.startswith("streamer learn: error: rank(s) ") and "-9 (SIGKILL)" in last, output[-3000:]
        assert "their own lines are above" in last, output[-3000:]
        step = checkpoint.load(run_dir / "checkpoint.pt")["step"]
        assert step < BATCHES, step
        continued(command, root, run_dir, step, one_process_naive)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the kernel's parent-death signal")
def test_kill_9_of_the_launcher_stops_its_ranks_with_a_checkpoint_and_the_same_command_continues(
        broker, stream, one_process_naive):
    """torchrun's agent (here `learn --nproc`'s launcher) killed (-9): its ranks, in sessions of their
    own, were left learning with nobody to stop them; now each gets SIGTERM from the kernel, they stop
    at the same step with rank 0's last checkpoint, and the same command continues. The dead launcher's
    log folder for torchrun stays behind; the next launcher removes it (nobody holds its lock)."""
    root, manifest = stream
    run_dir, temporary = root / "launcher-killed", root / "tmp-launcher-killed"
    temporary.mkdir()
    env = {**ENV, "TMPDIR": str(temporary)}
    ranks = []

    def kill_launcher(process: subprocess.Popen) -> None:
        ranks.extend(rank_process(process.pid, rank) for rank in range(2))
        process.kill()

    with paced(broker, root, "launcher-killed", run_dir) as topic:
        command = [*STREAMER, *learn_flags(broker, manifest, run_dir, "--checkpoint-every", "0.3", "--nproc", "2",
                                           *topic)]
        status, output = interrupted(command, root, run_dir, kill_launcher, env=env)  # once the ranks closed its pipe
        assert status == -signal.SIGKILL and None not in ranks, (ranks, output[-3000:])
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), output[-3000:]
        # each rank's line (the two may interleave on the shared pipe: PYTHONUNBUFFERED writes the newline apart)
        assert output.count("SIGTERM: stopping after the step in flight") == 2, output[-3000:]
        assert "rank 1: SIGTERM: stopping after the step in flight" in output, output[-3000:]
        saved = checkpoint.load(run_dir / "checkpoint.pt")
        step = saved["step"]
        assert [part["loop"]["step"] for part in saved["ranks"]] == [step, step] and len(losses(run_dir)) == step
        left = [path.name for path in temporary.iterdir() if not path.name.startswith("torchinductor_")]
        assert [name.startswith("streamer-ranks-") for name in left] == [True], left  # the dead launcher's
        continued(command, root, run_dir, step, one_process_naive, env=env)
        assert [path.name for path in temporary.iterdir() if not path.name.startswith("torchinductor_")] == []


def test_the_errors_a_user_can_make_are_one_line(broker, stream):
    root, manifest = stream
    flags = learn_flags(broker, manifest, root / "odd")
    flags[flags.index("--streams") + 1] = "9"
    flags = without(flags, "--manifest")  # the manifest's 10 would contradict 9
    odd = run([*STREAMER, *flags, "--nproc", "2"], root, timeout=60)
    assert (odd.returncode, odd.stderr.strip().splitlines()) == (2, [
        "streamer learn: error: --nproc 2: --streams 9 is not divisible by 2 ranks (each rank learns streams / ranks "
        "of them); use a multiple of 2"])
    assert not (root / "odd").exists()
    # under a plain torchrun, each rank refuses alike on its machine's files: rank 0 says it, once (each rank
    # said it; a rank ending first had the agent stop rank 0 before its line, and none was said)
    flags = learn_flags(broker, manifest, root / "contradicting")
    flags[flags.index("--streams") + 1] = "4"
    contradicting = run([*TORCHRUN, "-m", "streamer", *flags], root, timeout=60)
    said = [line for line in contradicting.stderr.splitlines() if "error:" in line]
    assert contradicting.returncode != 0 and said == [
        f"streamer learn: error: --streams 4 contradicts the manifest {manifest}'s streams 10 (leave --streams out: "
        "the manifest sets it)"], contradicting.stderr[-3000:]
    alone = run([*STREAMER, *learn_flags(broker, manifest, root / "alone", "--pin-cpus")], root, timeout=60)
    assert (alone.returncode, alone.stderr.strip().splitlines()) == (2, [
        "streamer learn: error: --pin-cpus pins a rank of torchrun (or of --nproc N) to its share of the CPUs; "
        "this is one process: leave it out, or use taskset"])
    # a fault each rank meets on its own (here a broker none can reach) is that rank's line, named; then
    # the launcher's line for the ranks, and none of torchrun's log records that say the same. What the
    # config chose (--params' size, produce's manifest of the topic found without --manifest) is said
    # once, by rank 0, not by every rank and the launcher
    flags = learn_flags(broker, manifest, root / "unreachable", "--nproc", "2", "--broker-timeout", "1",
                        "--params", "5000")
    flags[flags.index("--bootstrap-servers") + 1] = f"127.0.0.1:{free_port()}"
    flags = without(flags, "--manifest")
    cache = root / "cache-of-produce"
    (cache / "streams").mkdir(parents=True, exist_ok=True)
    (cache / "streams" / f"{TOPIC}.manifest.json").write_text(manifest.read_text())
    cached = {**ENV, "STREAMER_CACHE": str(cache)}
    unreachable = run([*STREAMER, *flags], root, env=cached)
    said = [line for line in unreachable.stderr.splitlines() if "Kafka at " not in line or "error:" in line]
    assert unreachable.returncode == 2 and 2 <= len(said) <= 3, unreachable.stderr[-3000:]  # less the retry notes
    line = f"streamer learn: error: cannot reach Kafka at {flags[flags.index('--bootstrap-servers') + 1]} (no answer " \
           "for 1 s; --broker-timeout)"
    assert set(said[:-1]) <= {line, f"rank 1: {line}"}, said  # the agent may stop one rank before it says it
    assert said[-1].startswith("streamer learn: error: rank(s) ") and "their own lines are above" in said[-1], said
    assert unreachable.stdout.count("--params 5,000: naive with hidden ") == 1, unreachable.stdout
    found = (f"manifest: {cache / 'streams' / f'{TOPIC}.manifest.json'} (produce's for topic {TOPIC}; --manifest "
             "to choose another)")
    assert [line for line in unreachable.stdout.splitlines() if "manifest: " in line] == [found], unreachable.stdout
    # a refusal by the launcher itself, before any rank starts, resting on that manifest's numbers (no
    # --streams given: the manifest's 10): it names the manifest
    flags[flags.index("--nproc") + 1] = "3"
    flags = without(flags, "--streams")
    thirds = run([*STREAMER, *flags], root, timeout=60, env=cached)  # (--params' line is the ranks', unsaid here)
    assert (thirds.returncode, thirds.stdout.splitlines(), thirds.stderr.splitlines()) == (2, [found], [
        "streamer learn: error: --nproc 3: --streams 10 is not divisible by 3 ranks (each rank learns streams / "
        "ranks of them); use a multiple of 3"]), thirds
    # (without --params here: with it the launcher imports torch to size the model before it refuses, 5 CPU s)
    given = run([*STREAMER, *without(flags, "--params"), "--streams", "10"], root, timeout=60, env=cached)
    assert (given.returncode, given.stdout, given.stderr.splitlines()) == (2, "", [
        "streamer learn: error: --nproc 3: --streams 10 is not divisible by 3 ranks (each rank learns streams / "
        "ranks of them); use a multiple of 3"]), given  # the user's own number: the manifest goes unsaid


@pytest.mark.slow  # two daemons and two refused learners, three of them of ranks: about 35 s (the suite's budget)
def test_a_learner_in_a_group_where_a_learner_of_the_other_kind_runs_is_refused(broker, stream):
    """One learner per consumer group, ranks included. Ranks take their partitions by assignment and are no
    members of the group; rank 0 stands for them in the learner group `<group>.learner`, which a one-process
    learner joins too. A one-process learner in a group where a learner of 2 ranks runs, and a learner of 2
    ranks in a group where a one-process learner runs, are refused before they learn anything: exit status
    2 and one line (under ranks rank 0's, then the launcher's naming rank 0; rank 1 says nothing, as for the
    refusals every rank makes). Before, each learned the whole topic and committed into the running one's
    group. The running ones go on. Both pairs run at once."""
    root, manifest = stream

    def in_group(group: str, run_dir: str, *extra: str) -> list[str]:
        flags = learn_flags(broker, manifest, root / run_dir, *extra)
        flags[flags.index("--group") + 1] = group
        return [*STREAMER, *flags]

    def refused(group: str, learner: str) -> str:
        return (f"streamer learn: error: group {group} on {broker.bootstrap_servers} has another running learner: "
                f"{learner} reads topic {TOPIC} in it (group {group}.learner lists it); stop that one, or give "
                "this one another --group")

    try:  # a daemon each (no manifest, no --max-batches): it learns the topic, then waits for more
        ranked = start(without(without(in_group("beside-ranks", "ranks-running", "--nproc", "2"), "--manifest"),
                               "--max-batches"), root)
        alone = start(without(without(in_group("beside-one", "one-running"), "--manifest"), "--max-batches"), root)
        wait_for_lines(root / "ranks-running" / "losses.jsonl", ranked, 1, timeout_s=180)
        wait_for_lines(root / "one-running" / "losses.jsonl", alone, 1, timeout_s=180)
        one = start(in_group("beside-ranks", "one-beside"), root, stderr_apart=True)
        ranks = start(in_group("beside-one", "ranks-beside", "--nproc", "2"), root, stderr_apart=True)
        _, err = one.communicate(timeout=180)
        assert (one.returncode, err.strip().splitlines()) == (2, [refused("beside-ranks", "a learner of 2 ranks")]), err
        _, err = ranks.communicate(timeout=180)
        said = err.strip().splitlines()
        assert ranks.returncode == 2 and len(said) == 2, err[-3000:]
        assert said[0] == refused("beside-one", "a learner of one process")
        assert said[1].startswith("streamer learn: error: rank(s) 0 failed (exit status 2)"), said
        assert [line_count(root / run_dir / "losses.jsonl") for run_dir in ("one-beside", "ranks-beside")] == [0, 0]
        assert ranked.poll() is None and alone.poll() is None  # they go on
        for running in (ranked, alone):
            running.send_signal(signal.SIGTERM)
            finish(running)
    finally:
        kill_leftovers()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_whose_agent_died_before_it_asked_for_the_agents_death_signal_stops_with_one_line():
    """The launcher (learn --nproc), whose process is torchrun's agent, tells its ranks its pid: a rank
    whose parent is another process by the time it asks the kernel for its agent's death signal (the
    agent killed in the fraction of a second before) stops at once with one labelled line and 143; a
    rank whose parent is its agent goes on. Each rank here is `streamer --help` run by this test."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that was an agent and is no more
    rank = {**os.environ, "TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    orphaned = subprocess.run([*STREAMER, "--help"], env={**rank, "STREAMER_AGENT_PID": str(gone.pid)},
                              capture_output=True, text=True, timeout=120)
    assert orphaned.returncode == 143 and orphaned.stdout == "", orphaned
    assert orphaned.stderr == (f"rank 1: torchrun's agent (pid {gone.pid}) ended before this rank began: stopping; "
                               "the same command continues the run\n")
    kept = subprocess.run([*STREAMER, "--help"], env={**rank, "STREAMER_AGENT_PID": str(os.getpid())},
                          capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0 and kept.stderr == "" and kept.stdout.startswith("rank 1: usage: streamer"), kept


def test_a_ranks_lines_are_labelled_at_each_line_start_across_writes():
    from streamer.cli.rank_process import Labelled

    out = io.StringIO()
    labelled = Labelled(out, "rank 1: ")
    assert labelled.write("a\nb") == 3
    labelled.write("c\n\nprogress\r")
    labelled.write("done\n")
    assert out.getvalue() == "rank 1: a\nrank 1: bc\nrank 1: \nrank 1: progress\rrank 1: done\n"
    assert labelled.getvalue() == out.getvalue()  # all else is the stream's


def test_a_ranks_lines_reach_the_shared_stream_whole_in_one_write():
    """print writes its text, then the newline: on the launcher's unbuffered stderr two ranks' lines ran
    into one. A line goes out in one write, once it ends (or at a flush)."""
    from streamer.cli.rank_process import Labelled

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, text):
            self.calls.append(text)
            return super().write(text)

    for label in ("rank 1: ", ""):  # rank 0's lines too, unlabelled
        out = Writes()
        labelled = Labelled(out, label)
        print("streamer learn: error: cannot reach Kafka", file=labelled)
        assert out.calls == [f"{label}streamer learn: error: cannot reach Kafka\n"]
        labelled.write("half a line")
        assert out.calls[1:] == []  # not yet
        labelled.flush()
        labelled.write(", the rest\n")
        assert out.calls[1:] == [f"{label}half a line", ", the rest\n"]  # one label a line


def test_what_several_threads_write_to_a_ranks_stream_is_written_once_each_with_a_label_at_each_line_start():
    """(print's text and its newline are two writes: threads' pieces may share a line, as on any stream.)"""
    from streamer.cli.rank_process import Labelled

    class Slow(io.StringIO):  # gives the other threads the GIL inside each write
        def write(self, text):
            time.sleep(0.0001)
            return super().write(text)

    out = Slow()
    labelled = Labelled(out, "rank 1: ")

    def say(who: str) -> None:
        for n in range(200):
            print(f"<{who}{n}>", file=labelled)
    threads = [threading.Thread(target=say, args=(who,)) for who in "abc"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 600 and all(line.startswith("rank 1: ") for line in lines)
    said = re.findall(r"<[abc]\d+>", out.getvalue())
    assert sorted(said) == sorted(f"<{who}{n}>" for who in "abc" for n in range(200))  # none twice, none lost


def test_a_rank_owns_its_streams_and_their_partitions():
    ranks = [Ranks(rank, 2, None) for rank in range(2)]
    assert [r.first_stream(10) for r in ranks] == [0, 5]
    assert [r.partitions(10)(10) for r in ranks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    # partitions no stream maps to: read (their records dead-lettered, as one process does), not left to no rank
    assert [r.partitions(10)(14) for r in ranks] == [[0, 1, 2, 3, 4, 10, 12], [5, 6, 7, 8, 9, 11, 13]]
    assert [r.partitions(2)(4) for r in ranks] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="produce it with --partitions 10"):
        ranks[0].partitions(10)(2)  # streams 0 and 5 of two ranks would share partition 0
    batcher = Batcher(5, 2, first_stream=5)
    assert [batcher.accepts(str(stream)) for stream in (4, 5, 9, 10)] == [False, True, True, False]
    batcher.add(Record(stream="7", text="abc"))
    assert batcher._rows == {"7": 2}  # noqa: SLF001 - stream 7 is this rank's row 2
    from types import SimpleNamespace

    from streamer.intake import rejected_record

    stray = SimpleNamespace(record=Record(stream="2", text="x"), tp=("t", 6))  # a hashed key's partition
    reason, detail = rejected_record(batcher, stray, ranks[1])
    assert reason == "extra_stream" and detail.startswith(
        "stream id '2' came on partition 6, which rank 1 reads for its streams 5 to 9 of 10: under ranks stream i "
        "must be on partition i % partitions")
    for beyond in ("11", "abc"):  # past --streams, or no stream id: as one process says it
        stray = SimpleNamespace(record=Record(stream=beyond, text="x"), tp=("t", 11))
        assert rejected_record(batcher, stray, ranks[1]) == ("extra_stream", "more than 10 stream ids")
    one_process = SimpleNamespace(record=Record(stream="7", text="x"), tp=("t", 0))
    assert rejected_record(Batcher(5, 2), one_process) == ("extra_stream", "more than 5 stream ids")


@pytest.mark.slow  # one process and two ranks of a word-level model: about 50 s
def test_a_word_level_model_under_ranks_ends_at_the_streams_end_with_the_losses_of_one_process(broker, stream):
    """A word model's streams hold different numbers of tokens: at the stream's end rank 0 still had a part
    of a batch cut and rank 1 could not cut one, and the ranks, agreeing on the end only once no rank had
    more, waited for ever (no --idle-timeout). One process never cuts that batch: the ranks end there too."""
    root, manifest = stream
    word = ["--model", "lstm-word", "--hidden", "16"]
    one = run([*STREAMER, *learn_flags(broker, manifest, root / "one-word", *word)], root, timeout=120)
    assert one.returncode == 0 and "end_of_stream" in one.stdout, one.stdout[-2000:] + one.stderr[-2000:]
    unset = {name: value for name, value in ENV.items() if name != "OMP_NUM_THREADS"}
    two = run([*STREAMER, *learn_flags(broker, manifest, root / "two-word", *word, "--nproc", "2")], root,
              timeout=120, env=unset)
    assert two.returncode == 0 and "end_of_stream" in two.stdout, two.stdout[-2000:] + two.stderr[-2000:]
    expected = losses(root / "one-word")
    assert 0 < len(expected) < BATCHES  # the stream ended before --max-batches
    assert worst_difference(losses(root / "two-word"), expected) <= 1e-4


@pytest.mark.slow  # a topic of its own, one process and two ranks of poe-lstm: about a minute
def test_under_ranks_the_class_fragment_and_gate_columns_are_the_global_batchs(broker, stream):
    """With streams that switch apart (the independent schedule) the loss log's class and fragment were
    rank 0's rows' majority, so the CALM metrics and the report differed from one process's; an LSTM
    gate's weights in the log were rank 0's rows' mean. Both are the global batch's now."""
    root, _ = stream
    manifest = root / "independent.manifest.json"
    result = subprocess.run(produce(broker, root, "distributed-independent", manifest, "--schedule", "independent"),
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr
    gated = ["--topic", "distributed-independent", "--strategy", "poe-lstm", "--set", "n_experts=3",
             "--set", "warmup_batches=5", "--set", "gate_hidden=8", "--max-batches", "60"]
    one = run([*STREAMER, *learn_flags(broker, manifest, root / "one-independent", *gated)], root)
    assert one.returncode == 0, one.stderr[-3000:]
    unset = {name: value for name, value in ENV.items() if name != "OMP_NUM_THREADS"}
    two = run([*STREAMER, *learn_flags(broker, manifest, root / "two-independent", *gated, "--nproc", "2")], root,
              env=unset)
    assert two.returncode == 0, two.stderr[-3000:]
    got, expected = losses(root / "two-independent"), losses(root / "one-independent")
    assert worst_difference(got, expected) <= 1e-4
    columns = ("domain_name", "sequence")
    assert [[line[column] for column in columns] for line in got] == [
        [line[column] for column in columns] for line in expected]
    assert len({line["domain_name"] for line in expected}) > 1  # the case: classes differ between rows
    gates = max(abs(a - b) for x, y in zip(got, expected) for a, b in zip(x["gates"], y["gates"]))
    assert gates <= 1e-5, f"gate weights differ by {gates:.3g}"
    results = [json.loads((root / name / "results.json").read_text())["metrics"]
               for name in ("two-independent", "one-independent")]
    assert results[0]["n_batches"] == results[1]["n_batches"]
    assert results[0]["ppl"] == pytest.approx(results[1]["ppl"], rel=1e-4)
