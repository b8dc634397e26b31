"""`streamer produce`: replay a corpus as a CALM stream into a Kafka topic."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from streamer.cli.checks import check_writable
from streamer.cli.configs import schedule, stream_options
from streamer.cli.errors import UserError
from streamer.cli.flags import (CACHE_HELP, DEFAULT_BOOTSTRAP, DEFAULT_CORPUS, DEFAULT_TOPIC, add_broker_timeout_flag,
                                add_stream_flags, positive_float, positive_int)
from streamer.cli.runs import corpus_dir, default_manifest_path, prepare_and_say, sigterm_as_interrupt
from streamer.cli.security_flags import add_security_flags, client_options, kafka_security

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("produce", help="replay a corpus as a CALM stream into a Kafka topic")
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="a built corpus name (`streamer data list`) or a path of your own data: a directory with "
                        "one .txt per class, JSONL, CSV/TSV or a datasets directory (default %(default)s)")
    p.add_argument("--cache", type=Path, help=CACHE_HELP)
    p.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP, metavar="HOST:PORT",
                   help="Kafka address, comma-separated for several (default %(default)s)")
    p.add_argument("--topic", default=DEFAULT_TOPIC,
                   help="the topic to write, created when missing (default %(default)s)")
    p.add_argument("--partitions", type=positive_int, default=1,
                   help="partitions of the topic: created with this many when missing; a topic that exists must have "
                        "as many, else nothing is sent (default %(default)s)")
    p.add_argument("--rate", type=positive_float,
                   help="pace in records per second (default: as fast as the broker takes them)")
    p.add_argument("--token-rate", type=positive_float,
                   help="pace in bytes of text per second (default: no limit)")
    p.add_argument("--realtime-factor", type=positive_float, default=1.0,
                   help="speed of the replay relative to --rate / --token-rate (2 = twice as fast; default 1)")
    p.add_argument("--loop", action="store_true",
                   help="replay forever (positions and fragments continue), for a daemon, at the pace --rate or "
                        "--token-rate gives (refused without one); the manifest says "
                        "\"loop\": true, so a learner does not stop after one lap (its totals are one lap's)")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--resume", action="store_true",
                      help="onto a topic that holds the start of this production (the same flags; stopped by a "
                           "signal or a lost broker): send only the records and truth announcements it lacks, so "
                           "the topic ends as one uninterrupted production would leave it (default: a topic that "
                           "holds records is refused)")
    held.add_argument("--append", action="store_true",
                      help="onto a topic that holds records: write this whole stream after them, a second copy "
                           "if it is the same (default: a topic that holds records is refused)")
    p.add_argument("--no-truth-topic", action="store_true",
                   help="do not announce fragments on the <topic>.truth sidecar topic")
    p.add_argument("--manifest", type=Path,
                   help=f"where to write the ground-truth manifest and its .probe/ split (default "
                        f"{default_manifest_path('<topic>')}, where `streamer learn --topic <topic>` finds it; "
                        f"under --cache when given)")
    add_broker_timeout_flag(p, producing=True)
    add_stream_flags(p)
    add_security_flags(p)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from producers.kafka import produce
    from producers.stream import looped, write_manifest

    sigterm_as_interrupt()  # SIGTERM stops it as Ctrl-C does: what was sent is flushed and said
    if args.loop and not (args.rate or args.token_rate):  # (175k records in its first 6 s on the embedded broker)
        raise UserError("--loop replays forever: give it a pace, --rate (records/s) or --token-rate (bytes/s); "
                        "unpaced it sends as fast as the broker takes records until the broker's disk is full")
    kafka_options = client_options(kafka_security(args))  # checked before the stream is prepared
    corpus = corpus_dir(args.corpus, args.cache)
    manifest_path = args.manifest or default_manifest_path(args.topic, args.cache)
    notes: list[str] = []  # said once the topic is taken: a refused production held nothing out, recycled nothing
    records, manifest = prepare_and_say(corpus, schedule(args), None,  # (the data's errors create nothing)
                                        log=notes.append, **stream_options(args))
    check_writable(manifest_path)  # (nor does a manifest that cannot be written)
    truth_topic = None if args.no_truth_topic else f"{args.topic}.truth"
    # the broker reached and the topic there before the manifest is written: an unreachable broker left a
    # manifest of a topic never written, which `learn --topic` then found
    held, resume = _topic_as_asked(args, records, truth_topic, kafka_options)
    for note in notes:
        print(note, flush=True)
    if args.loop:  # no end: a learner must not stop at one lap's total (the figures stay a lap's)
        manifest["loop"] = True
    write_manifest(manifest, manifest_path)  # --resume: the same manifest as the interrupted production's
    print(f"stream: {manifest['n_fragments']} fragments, {manifest['total_batches']} batches, "
          f"{len(records)} records; manifest {manifest_path}", flush=True)
    console = Console()
    stream = looped(records, manifest) if args.loop else records
    left = None if args.loop else len(records) - (held.records if resume else 0)
    counted = [0]  # records sent so far, said when a signal or a lost broker stops the production

    def progressed(sent: int, sent_bytes: int) -> None:
        counted[0] = sent
        progress.update(task, completed=sent, mb=sent_bytes / 1e6)

    with Progress(TextColumn("producing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[mb]:.2f} MB"),
                  console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("produce", total=left, mb=0.0)
        try:
            sent = asyncio.run(_stopped_by_signals(produce(  # producers.stream.produce_stream's, with --broker-timeout
                stream, args.bootstrap_servers, args.topic,
                rate=args.rate and args.rate * args.realtime_factor,
                token_rate=args.token_rate and args.token_rate * args.realtime_factor,
                partitions=args.partitions, truth_topic=truth_topic,
                client_options=kafka_options, broker_timeout_s=args.broker_timeout,
                log=lambda line: print(line, flush=True), **resume, progress=progressed)))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM
            print(f"stopped: sent {counted[0]} records to {args.topic} at {args.bootstrap_servers}; the same "
                  "command with --resume " + ("continues the loop where it stopped" if args.loop else "sends the rest"),
                  flush=True)
            raise
    print(f"sent {sent} records to {args.topic} at {args.bootstrap_servers}"
          + (f" ({held.records} were there already)" if resume else ""))
    return 0


async def _stopped_by_signals(producing):
    """`producing`, cancelled by Ctrl-C or SIGTERM so that its records in flight are flushed and its
    producer stopped (a second signal cuts that short), then KeyboardInterrupt."""
    loop, task, caught = asyncio.get_running_loop(), asyncio.current_task(), []

    def stop() -> None:
        caught.append(True)
        task.cancel()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop)
    try:
        return await producing
    except asyncio.CancelledError:
        if caught:
            raise KeyboardInterrupt from None
        raise


def _topic_as_asked(args, records, truth_topic: str | None, kafka_options):
    """(what the topic holds, produce's keyword arguments that resume it): the topic created or found
    with --partitions partitions, and holding no records unless --resume or --append says what to do."""
    from producers.held import held_by, resume_positions
    from producers.kafka import ensure_topic

    def say(line: str) -> None:
        print(line, flush=True)

    partitions = asyncio.run(ensure_topic(args.bootstrap_servers, args.topic, args.partitions, kafka_options,
                                          broker_timeout_s=args.broker_timeout, log=say))
    if partitions != args.partitions:  # fewer: records for a partition it lacks; more: streams hashed together
        raise UserError(f"topic {args.topic} exists with {partitions} partition{'s' * (partitions != 1)}, but "
                        f"--partitions is {args.partitions}: give --partitions {partitions}, or a new --topic")
    held = asyncio.run(held_by(args.bootstrap_servers, args.topic, truth_topic, kafka_options,
                               broker_timeout_s=args.broker_timeout, log=say))
    if not (held.records or held.announcements) or args.append:
        return held, {}
    if not args.resume:
        truth = f" and {truth_topic} {held.announcements} announcements" if held.announcements else ""
        raise UserError(f"topic {args.topic} holds {held.records} records{truth} already; producing again would "
                        f"add a second copy: --resume continues the production it holds (the same flags), "
                        f"--append adds this one after it, or give a new --topic")
    after = resume_positions(records, held, args.topic, loop=args.loop)
    whole = not args.loop and held.records == len(records)
    say(f"resuming: topic {args.topic} holds {held.records} of the stream's {len(records)} records"
        + (" (the whole stream): nothing left to send" if whole
           else "; sending those after them"))
    return held, {"after": after, "announced": held.announced}
