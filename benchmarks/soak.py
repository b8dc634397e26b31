"""Soak: a long stream with poison through the real embedded broker, and a learner SIGKILLed and restarted.

    nice -n 10 .venv/bin/python benchmarks/soak.py [--records 1000000] [--minutes 30] [--kills 3]
    .venv/bin/python benchmarks/soak.py --records 20000 --kills 1 --checkpoint-every 2 --compare   # a small one

What it does: builds a CALM stream of at least --records records (a synthetic corpus; --record-bytes of text
per record, default 10, plus its four truth headers: about 100 bytes of key, value and headers), writes it
into a fresh embedded broker (flushed every 5,000 records) with one poison record in
--poison-every (kinds cycling through POISON: bad keys, a stream beyond the rows, a tombstone, an empty
value, a NUL byte, invalid UTF-8, bad truth headers, an over-size value), then runs `streamer learn` as a
real process with the same command each time (an LSTM of one layer, hidden 32, embedding 8, one torch
thread, batches of 32 streams x 20 bytes): SIGKILL half a second after a checkpoint at or past
1/(kills+1), 2/(kills+1), ... of the stream's batches, restart, and let the last one end by itself (or
SIGTERM it when --minutes, counted from the start, are spent: that learner is then the last).

The topic is written in kills+1 parts, the k-th ending half a part's batches past the k-th kill's point,
and a part only once the learner before it was killed: no learner can reach the end of the stream before
its kill (a small stream was learned whole within one --checkpoint-every, and the soak passed with no
kill), and one caught up with what is written checkpoints while it waits, so each kill comes.

What it prints (one line each): records produced, learned, dead-lettered, lost (must be 0), batches
learned twice (must be 0), loss-log lines written before each kill and kept, the learner's RSS at start
and end (VmRSS from /proc), and the wall time; fewer kills than --kills asked is a line of its own (FAILED).
The exit status is 1 for any of those, or a last learner that failed, else 0. How they are counted:

- dead-lettered: distinct source offsets in <topic>.dlq (a copy sent again after a restart counts once;
  the extra copies are printed beside it);
- learned: the good records whose batches are all in the loss log (every batch 0..total-1 once: all of
  them; otherwise the share of the missing batches is taken off);
- lost: poison records the run read past but did not dead-letter, good records dead-lettered, the
  good records of missing batches, and (once the run ended by itself) good records never read;
- batches learned twice: batch indices that occur more than once in the final loss log (after the
  restarts trimmed it back to their checkpoints).

--compare also runs an uninterrupted learner on the same topic (another group and run directory) and
prints the largest loss difference; it doubles the learning time, so it is off by default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # noqa: E402

from monitor.losslog import iter_loss_log, loss_log_files  # noqa: E402
from producers.kafka import ensure_topic  # noqa: E402
from producers.schedule import Schedule  # noqa: E402
from producers.stream import prepare_stream  # noqa: E402
from producers.wire import encode  # noqa: E402
from benchmarks.command import ended_by_signals, seconds  # noqa: E402
from streamer.broker import EmbeddedBroker, die_with_parent  # noqa: E402
from streamer.cli.flags import Parser, non_negative_int, positive_int  # noqa: E402

TOPIC = "soak"
MAX_RECORD_BYTES = 4096  # the learner's --max-record-bytes here, so a too_large poison stays small
TRUTH = [("streamer.class", b"en"), ("streamer.fragment", b"0"), ("streamer.position", b"0"),
         ("streamer.produced", b"1.5")]
POISON = [  # (key, value, headers, reason): the kinds of tests/test_poison.py that a plain producer can send
    ("²".encode(), b"superscript two", [], "bad_key"),
    ("٣".encode(), b"arabic-indic three", [], "bad_key"),
    (None, b"no key", [], "missing_key"),
    (b"abc", b"a named stream", [], "bad_key"),
    (b"-1", b"negative", [], "bad_key"),
    (b"2147483648", b"too large an id", [], "bad_key"),
    (b"99", b"a stream beyond the rows", [], "extra_stream"),
    (b"0", None, [], "missing_value"),
    (b"1", b"", [], "empty_value"),
    (b"2", b"nul \x00 inside", [], "nul_byte"),
    (b"0", b"\xff\xfe not utf-8", [], "bad_utf8"),
    (b"1", b"x", [("streamer.class", b"\xff\xfe"), *TRUTH[1:]], "bad_headers"),
    (b"1", b"x", [TRUTH[0]], "bad_headers"),
    (b"2", b"y" * (MAX_RECORD_BYTES + 100), [], "too_large"),
]


@dataclass
class Produced:
    good: int = 0
    poison: dict[int, str] = field(default_factory=dict)  # offset -> reason
    end_offset: int = 0  # the topic's next offset after the last record


@dataclass
class Learner:
    """One `streamer learn` process and what was seen of it."""

    process: subprocess.Popen
    rss_mb: list[float] = field(default_factory=list)  # samples once it has logged a batch
    wall_started: float = field(default_factory=time.time)
    stopped: bool = False  # SIGTERMed at the deadline (--minutes)


def build(root: Path, records: int, streams: int, window: int, record_bytes: int, seed: int = 0):
    """(records, manifest path, manifest) of a CALM stream of at least `records` good records."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import write_corpus

    corpus = write_corpus(root / "corpus", lines=4000)
    fragments = max(4, min(200, records // 2000))
    mean_tokens = max(streams * window, records * record_bytes // fragments)
    for _ in range(4):
        schedule = Schedule(n_fragments=fragments, mean_tokens=mean_tokens, streams=streams, window=window,
                            record_tokens=record_bytes, seed=seed)
        built, manifest = prepare_stream(corpus, schedule, root / "soak.manifest.json")
        if len(built) >= records:
            return built, root / "soak.manifest.json", manifest
        mean_tokens = math.ceil(mean_tokens * records / max(1, len(built)) * 1.03)
    return built, root / "soak.manifest.json", manifest


async def produce(bootstrap: str, topic: str, records, poison_every: int, produced: Produced, start: int,
                  stop: int, chunk: int = 5000) -> None:
    """The good records[start:stop] in order, one poison record after every `poison_every - 1` of them
    (counted from the stream's first), and a closing poison record after the stream's last; flushed
    every `chunk` records (backpressure on a loaded machine), and any failed send ends the soak.
    Counted into `produced`."""
    await ensure_topic(bootstrap, topic, 1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks="all", request_timeout_ms=300_000,
                                max_request_size=4 * 1024 * 1024)
    await producer.start()
    futures, poison, last = [], [], None
    kinds = itertools.islice(itertools.cycle(POISON), start // (poison_every - 1) % len(POISON), None)
    try:
        for index in range(start, stop):
            key, value, headers = encode(records[index])
            futures.append(last := await producer.send(topic, key=key, value=value, headers=headers, partition=0))
            produced.good += 1
            if (index + 1) % (poison_every - 1) == 0:
                key, value, headers, reason = next(kinds)
                futures.append(last := await producer.send(topic, key=key, value=value, headers=headers,
                                                           partition=0))
                poison.append((futures[-1], reason))
            if len(futures) >= chunk:
                await _settle(producer, futures, poison, produced)
        if stop == len(records):  # nul_byte: poison
            futures.append(last := await producer.send(topic, key=b"0", value=b"\x00end", partition=0))
            poison.append((futures[-1], "nul_byte"))
        await _settle(producer, futures, poison, produced)
    finally:
        await producer.stop()
    if last is not None:
        produced.end_offset = last.result().offset + 1


def part_ends(records, streams: int, window: int, goals: list[int]) -> list[int]:
    """For each number of batches in `goals` (increasing), the number of records from the stream's start
    from which the learner cuts that many (its own streamer.batching.Batcher)."""
    from streamer.batching import Batcher

    batcher, ends, cut = Batcher(streams, window), [], 0
    for index, record in enumerate(records):
        if len(ends) == len(goals):
            break
        batcher.add(record)
        while batcher.ready():
            batcher.pop()
            cut += 1
        while len(ends) < len(goals) and cut >= goals[len(ends)]:
            ends.append(index + 1)
    return ends


async def _settle(producer, futures: list, poison: list, produced: Produced) -> None:
    await producer.flush()
    for future in futures:
        if future.exception() is not None:
            raise SystemExit(f"soak: a send failed ({future.exception()!r}); the machine is too loaded for this "
                             "run, try fewer --records")
    produced.poison.update({future.result().offset: reason for future, reason in poison})
    futures.clear()
    poison.clear()


async def dead_letters(bootstrap: str, topic: str, idle_s: float = 3.0) -> list[tuple[int, str]]:
    """(source offset, reason) of every copy in <topic>.dlq."""
    consumer = AIOKafkaConsumer(f"{topic}.dlq", bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=f"{topic}-soak-reader", enable_auto_commit=False)
    await consumer.start()
    found, empty = [], 0
    try:
        while empty < idle_s:
            batch = await consumer.getmany(timeout_ms=1000)
            empty = 0 if batch else empty + 1
            for messages in batch.values():
                for message in messages:
                    headers = dict(message.headers)
                    source = headers["streamer.source"].decode()
                    found.append((int(source.rsplit(":", 1)[1]), headers["streamer.reason"].decode()))
    finally:
        await consumer.stop()
    return found


def learn_command(bootstrap: str, manifest: Path, run_dir: Path, args, group: str | None = None) -> list[str]:
    command = [sys.executable, "-m", "streamer", "learn", "--bootstrap-servers", bootstrap, "--topic", TOPIC,
               "--manifest", str(manifest), "--streams", str(args.streams), "--window", str(args.window),
               "--hidden", str(args.hidden), "--embedding", str(args.embedding), "--layers", str(args.layers),
               "--threads", "1", "--no-view", "--no-probe", "--checkpoint-every", str(args.checkpoint_every),
               "--max-record-bytes", str(MAX_RECORD_BYTES), "--run-dir", str(run_dir)]
    return command + (["--group", group] if group else [])


def rss_mb(pid: int) -> float | None:
    """The process's resident set (VmRSS) in MB, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def checkpoint_step(path: Path, seen: dict) -> int:
    """The step of the checkpoint at `path` (0 when none), reloaded only when the file changed."""
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
    if seen.get("stamp") != stamp:
        from streamer import checkpoint

        try:
            seen["step"], seen["stamp"] = checkpoint.CheckpointView(checkpoint.load(path)).step, stamp
        except Exception:  # noqa: BLE001 - replaced while read: the next poll reads the new one
            return seen.get("step", 0)
    return seen.get("step", 0)


def prefix_digest(log: Path, lines: int) -> str:
    """sha256 of the first `lines` lines of the loss log (rotated files included), read as bytes."""
    digest, left = hashlib.sha256(), lines
    for file in loss_log_files(log):
        if left <= 0 or not file.exists():
            break
        with open(file, "rb") as handle:
            for line in handle:
                if left <= 0:
                    break
                if line.strip():
                    digest.update(line)
                    left -= 1
    return digest.hexdigest()


def watch(learner: Learner, log: Path) -> None:
    """One RSS sample, once the learner has logged a batch (the log changed after it started)."""
    if learner.rss_mb or log.exists() and log.stat().st_mtime > learner.wall_started + 0.5:
        value = rss_mb(learner.process.pid)
        if value is not None:
            learner.rss_mb.append(value)


@contextlib.contextmanager
def running(command, env, run_dir: Path):
    """A learner with its output appended to <run dir>.out (a pipe could fill and block it), killed with this
    process (its parent-death signal); a signal or an error here ends and reaps it before it goes on."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.with_suffix(".out"), "ab") as out:
        learner = Learner(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           preexec_fn=die_with_parent(os.getpid())))
    try:
        yield learner
    except BaseException:
        end(learner.process)
        raise


def end(process: subprocess.Popen, grace_s: float = 60) -> int:
    """SIGTERM (the learner's clean stop: a last checkpoint), SIGKILL after `grace_s`; reaped. Its exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def run_until_checkpoint(command, env, run_dir: Path, target: int, deadline: float, poll_s: float = 0.2):
    """Start a learner; SIGKILL it once it wrote a checkpoint at or past batch `target` (then a moment more,
    so batches past the checkpoint are learned again after the restart). Returns (learner, kept): kept =
    (checkpoint step, digest of the log's lines up to it) taken with the learner frozen; None when the
    learner ended first, by itself (an error: the topic holds less than the stream) or by SIGTERM at the
    deadline. Either way it was reaped."""
    checkpoint, seen = run_dir / "checkpoint.pt", {}
    with running(command, env, run_dir) as learner:
        start_step = checkpoint_step(checkpoint, seen)
        while learner.process.poll() is None:
            if time.monotonic() > deadline:
                learner.stopped = True
                end(learner.process)
                break
            watch(learner, run_dir / "losses.jsonl")
            step = checkpoint_step(checkpoint, seen)
            if step > start_step and step >= target:
                time.sleep(poll_s)
                if learner.process.poll() is not None:
                    break
                learner.process.send_signal(signal.SIGSTOP)
                step = checkpoint_step(checkpoint, {})
                kept = (step, prefix_digest(run_dir / "losses.jsonl", step))
                learner.process.kill()
                learner.process.wait()
                return learner, kept
            time.sleep(poll_s)
        learner.process.wait()
    return learner, None


def run_to_end(command, env, run_dir: Path, deadline: float, poll_s: float = 0.5) -> Learner:
    """The last learner: until it exits by itself, or SIGTERM at the deadline; reaped."""
    with running(command, env, run_dir) as learner:
        while learner.process.poll() is None:
            watch(learner, run_dir / "losses.jsonl")
            if time.monotonic() > deadline:
                learner.stopped = True
                end(learner.process)
                break
            time.sleep(poll_s)
        learner.process.wait()
    return learner


def audit_log(log: Path, total_batches: int) -> dict:
    """Each batch index's count in the final loss log: how many once, twice or more, missing."""
    seen = bytearray(total_batches)
    twice = beyond = 0
    lines = 0
    for record in iter_loss_log(log) if log.exists() else ():  # (none: stopped before its first batch)
        lines += 1
        batch = record.get("batch")
        if not isinstance(batch, int) or not 0 <= batch < total_batches:
            beyond += 1
            continue
        if seen[batch]:
            twice += 1
        seen[batch] = 1
    return {"lines": lines, "unique": sum(seen), "twice": twice, "out_of_range": beyond,
            "highest": max((i for i in range(total_batches - 1, -1, -1) if seen[i]), default=-1)}


def largest_difference(log: Path, other: Path) -> tuple[float, int]:
    """The largest |loss difference| of two loss logs, batch by batch, and the batches compared."""
    worst, compared = 0.0, 0
    for a, b in zip(iter_loss_log(log), iter_loss_log(other)):
        worst = max(worst, abs(a["loss"] - b["loss"]))
        compared += 1
    return worst, compared


def soak(args, root: Path, log=print) -> dict:
    """The whole soak; returns the figures (also printed through `log`)."""
    started = time.monotonic()
    deadline = started + args.minutes * 60
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    records, manifest_path, manifest = build(root, args.records - args.records // args.poison_every,
                                             args.streams, args.window, args.record_bytes)
    total, parts = manifest["total_batches"], args.kills + 1
    targets = [total * kill // parts for kill in range(1, parts)]  # each kill at a checkpoint at or past it
    if args.kills and total // parts < 2:
        raise SystemExit(f"soak: the stream holds {total} batches, too few for {args.kills} kills (at least 2 "
                         "batches a part); more --records or fewer --kills")
    ends = part_ends(records, args.streams, args.window, [target + total // (2 * parts) for target in targets])
    ends += [len(records)]
    log(f"stream: {len(records):,} good records of {args.record_bytes} bytes of text + 4 truth headers, "
        f"{total:,} batches of {args.streams}x{args.window} bytes"
        + (f", in {parts} parts (each written once the learner before it is killed)" if parts > 1 else "")
        + f"; built in {time.monotonic() - started:.0f}s")
    run_dir, produced, learners, kept, good = root / "run", Produced(), [], [], len(records)
    with EmbeddedBroker() as broker:
        command = learn_command(broker.bootstrap_servers, manifest_path, run_dir, args)
        for part, stop in enumerate(ends):
            asyncio.run(produce(broker.bootstrap_servers, TOPIC, records, args.poison_every, produced,
                                ends[part - 1] if part else 0, stop))
            if part == args.kills:
                learners.append(run_to_end(command, env, run_dir, deadline))
                break
            learner, frozen = run_until_checkpoint(command, env, run_dir, targets[part], deadline)
            learners.append(learner)
            if frozen is None:  # stopped at the deadline (or failed): the last learner
                break
            kept.append(frozen)
            log(f"kill {part + 1}: SIGKILL at checkpoint step {frozen[0]:,} of {total:,} "
                f"({time.monotonic() - started:.0f}s)")
        del records
        final = learners[-1]
        code, stopped = final.process.returncode, final.stopped
        stderr_tail = run_dir.with_suffix(".out").read_text(errors="replace")[-2000:]
        letters = asyncio.run(dead_letters(broker.bootstrap_servers, TOPIC))
        compare = None
        if args.compare and not stopped:
            other = root / "uninterrupted"
            subprocess.run(learn_command(broker.bootstrap_servers, manifest_path, other, args, group="soak-whole"),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                           preexec_fn=die_with_parent(os.getpid()))
            compare = largest_difference(run_dir / "losses.jsonl", other / "losses.jsonl")
    wall = time.monotonic() - started
    from streamer import checkpoint  # torch: only once the learners are done

    last = run_dir / "checkpoint.pt"  # (none when the deadline stopped the first learner before its first)
    read_to = checkpoint.CheckpointView(checkpoint.load(last)).offsets.get(f"{TOPIC}:0", 0) if last.exists() else 0
    figures = account(produced, letters, read_to, audit_log(run_dir / "losses.jsonl", total), total,
                      code == 0 and not stopped, good)
    figures.update(
        kills=len(kept), kills_asked=args.kills, kill_steps=[step for step, _ in kept],
        kept_before_kills=[prefix_digest(run_dir / "losses.jsonl", step) == digest for step, digest in kept],
        rss_start_mb=learners[0].rss_mb[0] if learners[0].rss_mb else None,
        rss_end_mb=final.rss_mb[-1] if final.rss_mb else None,
        rss_per_process_mb=[(one.rss_mb[0], one.rss_mb[-1]) if one.rss_mb else None for one in learners],
        exit_code=code, stopped_by_minutes=stopped, wall_s=wall, compare=compare,
        compare_asked=args.compare, stderr_tail=stderr_tail if code and not stopped else "")
    _print(figures, args, log)
    return figures


def passed(figures: dict) -> bool:
    """Nothing lost or learned twice, every kill asked done, and the last learner ended well (or by --minutes)."""
    return (figures["records_lost"] == 0 and figures["batches_learned_twice"] == 0
            and figures["kills"] == figures["kills_asked"]
            and (figures["exit_code"] == 0 or figures["stopped_by_minutes"]))


def account(produced: Produced, letters: list[tuple[int, str]], read_to: int, audit: dict, total: int,
            completed: bool, good: int | None = None) -> dict:
    """Records learned, dead-lettered and lost, from what was produced (poison offsets known), the
    dead-letter copies, the final checkpoint's next offset and the final loss log's batch counts; `good`:
    the stream's good records (default: those produced; a run stopped by --minutes may not have written
    every part)."""
    good = produced.good if good is None else good
    distinct = dict(letters)  # source offset -> reason
    poison_missed = len({o for o in produced.poison if o < read_to} - set(distinct))
    good_dead = len(set(distinct) - set(produced.poison))
    unread = produced.end_offset - read_to - sum(1 for o in produced.poison if o >= read_to)
    missing = total - audit["unique"] if completed else max(0, audit["highest"] + 1 - audit["unique"])
    learned = good if audit["unique"] >= total else good * audit["unique"] // total
    lost = poison_missed + good_dead + math.ceil(produced.good * missing / total) + (unread if completed else 0)
    return {
        "records_produced": produced.good + len(produced.poison), "records_learned": learned - good_dead,
        "records_dead_lettered": len(distinct), "dead_letter_copies": len(letters),
        "dead_letter_reasons": dict(Counter(distinct.values())), "records_lost": lost,
        "records_unread": unread, "topic_records": produced.end_offset,
        "batches_learned_twice": audit["twice"], "batches_learned": audit["unique"], "total_batches": total,
    }


def _print(f: dict, args, log) -> None:
    log(f"records produced: {f['records_produced']:,}  (1 poison in {args.poison_every})")
    log(f"records learned: {f['records_learned']:,}  ({f['batches_learned']:,} of {f['total_batches']:,} batches)")
    log(f"records dead-lettered: {f['records_dead_lettered']:,}  ({f['dead_letter_copies']:,} copies in "
        f"{TOPIC}.dlq; {', '.join(f'{k} {v}' for k, v in sorted(f['dead_letter_reasons'].items()))})")
    log(f"records lost: {f['records_lost']}  (good records the learner never read: {f['records_unread']}; "
        f"the topic holds {f['topic_records']:,})")
    log(f"batches learned twice: {f['batches_learned_twice']}")
    log(f"SIGKILL restarts: {f['kills']} at checkpoint steps {f['kill_steps']}; lines before each kill kept up to "
        f"its checkpoint: {f['kept_before_kills']}")
    if f["kills"] < f["kills_asked"]:
        log(f"FAILED: {f['kills']} SIGKILL restarts of the {f['kills_asked']} asked ("
            + ("--minutes ran out first)" if f["stopped_by_minutes"] else "a learner ended before its kill)"))
    per = "; ".join("n/a" if p is None else f"{p[0]:.0f}->{p[1]:.0f}" for p in f["rss_per_process_mb"])
    start = "n/a" if f["rss_start_mb"] is None else f"{f['rss_start_mb']:.0f} MB"
    end = "n/a" if f["rss_end_mb"] is None else f"{f['rss_end_mb']:.0f} MB"
    log(f"learner RSS: start {start}, end {end}  (per process, first batch -> last sample: {per})")
    if f["compare"] is not None:
        worst, compared = f["compare"]
        log(f"against an uninterrupted run: largest loss difference {worst:.3g} nats over {compared:,} batches")
    elif f["compare_asked"]:
        log("against an uninterrupted run: not run (stopped by --minutes, the topic may not hold the whole stream)")
    log(f"wall time: {f['wall_s']:.0f}s; last learner exit code {f['exit_code']}"
        + (" (stopped by --minutes)" if f["stopped_by_minutes"] else ""))
    if f["stderr_tail"]:
        log("the learners' output ends:\n" + f["stderr_tail"])


def poison_every(text: str) -> int:
    """One poison record in this many: at least 2."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (one poison record in this many), got {text!r}")
    return value


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=positive_int, default=1_000_000,
                        help="records to produce, poison included (default %(default)s)")
    parser.add_argument("--minutes", type=seconds, default=30.0,
                        help="time budget in minutes; the last learner gets SIGTERM (default %(default)s)")
    parser.add_argument("--kills", type=non_negative_int, default=3,
                        help="SIGKILL restarts, each after a checkpoint (default %(default)s)")
    parser.add_argument("--poison-every", type=poison_every, default=1000,
                        help="one poison record in this many (default %(default)s)")
    parser.add_argument("--record-bytes", type=positive_int, default=10,
                        help="bytes of text per good record (default %(default)s)")
    parser.add_argument("--streams", type=positive_int, default=32, help="b: rows of a batch (default %(default)s)")
    parser.add_argument("--window", type=positive_int, default=20, help="w: bytes per row (default %(default)s)")
    parser.add_argument("--hidden", type=positive_int, default=32,
                        help="the LSTM's hidden units per layer (default %(default)s)")
    parser.add_argument("--embedding", type=positive_int, default=8,
                        help="byte embedding dimensions (default %(default)s)")
    parser.add_argument("--layers", type=positive_int, default=1, help="LSTM layers (default %(default)s)")
    parser.add_argument("--checkpoint-every", type=seconds, default=20.0,
                        help="the learner's, in seconds (default %(default)s)")
    parser.add_argument("--compare", action="store_true", help="also run an uninterrupted learner and compare")
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary directory)")
    args = parser.parse_args()
    with ended_by_signals("soak"):
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            figures = soak(args, args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="soak-") as root:
                figures = soak(args, Path(root))
    sys.exit(0 if passed(figures) else 1)


if __name__ == "__main__":
    main()
