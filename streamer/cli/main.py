"""The `streamer` command: the parser of every subcommand, and errors as one line."""

from __future__ import annotations

import argparse
import logging
import os
import select
import stat
import sys

from streamer.cli import broker, catalogs, compare, data, demo, learn, monitor, produce, report, status
from streamer.cli.checks import check_args
from streamer.cli.errors import UserError, caused_by, out_of_memory, storage_error
from streamer.cli.flags import Parser
from streamer.cli.launch import launches_ranks
from streamer.cli.rank_process import label_rank_lines, stop_with_the_agent
from streamer.cli.ranks import pin_rank
from streamer.cli.runs import sigterm_before_learning
from streamer.settings import (agent_pid, forbid_model_hub, omp_num_threads, started_by_torchrun_agent,
                               torchrun_environment)
from streamer.threads import choose_spin

__all__ = ["build_parser", "parse", "main"]

COMMANDS = {"broker": broker.run, "data": data.run_data, "weights": data.run_weights, "produce": produce.run,
            "learn": learn.run, "demo": demo.run, "compare": compare.run, "monitor": monitor.cmd_monitor,
            "report": report.run, "status": status.run, "strategies": catalogs.run_strategies,
            "models": catalogs.run_models}
THREADED = ("learn", "demo", "compare")  # the commands that run torch: the thread policy applies


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="streamer", description="Online streaming continual learner with live monitoring.")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the Kafka client's log")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    broker.add_parser(sub)
    data.add_data_parser(sub, Parser)
    data.add_weights_parser(sub, Parser)
    produce.add_parser(sub)
    learn.add_parser(sub)
    demo.add_parser(sub)
    compare.add_parser(sub)
    monitor.add_monitor_parser(sub)
    report.add_parser(sub)
    catalogs.add_parsers(sub)
    status.add_parser(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # noqa: SLF001 (argparse keeps its subparsers there)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[command]
    raise KeyError(command)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the flags; with --config FILE, the file's values become defaults the command line overrides."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    from streamer.cli.config_file import apply_config_file

    try:
        return apply_config_file(args.config, _command_parser(parser, args.command), lambda: parser.parse_args(argv))
    except UserError as exc:
        parser.exit(2, f"streamer {args.command}: error: {exc}\n")


def _user_errors() -> tuple[type[Exception], ...]:
    """What becomes one line on stderr and exit status 2: errors a user can fix."""
    from producers.corpora import CorpusError
    from producers.kafka import ProduceError
    from producers.schedule import ScheduleError
    from streamer.broker import BrokerError
    from streamer.compare_plan import CompareError
    from streamer.source import SourceError

    return UserError, CorpusError, ScheduleError, SourceError, ProduceError, BrokerError, CompareError


def _reader_left(stream) -> bool:
    """Whether `stream` is a pipe whose reading end is closed (poll says POLLERR of its writing end)."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no descriptor, or no poll() here
        return False


def main(argv: list[str] | None = None) -> int:
    forbid_model_hub()  # HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1 before transformers is imported
    environment = torchrun_environment()
    label_rank_lines(environment and environment[0])  # a rank's lines go out whole, `rank r: ` first but on rank 0
    if started_by_torchrun_agent():  # a rank: it ends with its agent (whose death left it running)
        stop_with_the_agent(agent_pid())
    args = parse(argv)  # imports no torch: OpenMP's wait is set after it, before torch loads its runtime
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line as given: --nproc's ranks run it
    launcher = args.command == "learn" and launches_ranks(args)  # each rank decides its threads and spins
    if args.command == "learn" and (pinned := pin_rank(args)):  # a rank's share of the CPUs, before the policy
        print(pinned, flush=True)
    governed = not launcher and choose_spin(getattr(args, "threads", None), omp_num_threads())  # before torch loads
    if args.command == "learn":  # from here, before torch loads (seconds); the learner's own handler takes over
        sigterm_before_learning()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:  # its connection errors become our one-line messages
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL + 1)
    known = _user_errors()
    try:
        check_args(args)  # before any work: nothing is created for flags that cannot run
        if args.command in THREADED and not launcher:
            from streamer.threads import apply_thread_policy

            policy = apply_thread_policy(args.threads, omp_num_threads(), govern_spin=governed)
            if args.command == "compare":  # said once its flags hold and it knows its runs are its own
                args.thread_line = policy.describe()  # (with jobs side by side, each has its own threads)
            else:
                print(policy.describe(), flush=True)
        return COMMANDS[args.command](args) or 0
    except KeyboardInterrupt:
        print("streamer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `streamer models | head`: the reader left; say nothing more
        if not _reader_left(sys.stdout):  # another pipe (a job's, a process's): not to be taken for it
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit must not raise again
        return 0
    except known as exc:
        print(f"streamer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if (line := storage_error(exc)) is None:
            raise
        print(f"streamer {args.command}: error: {line}", file=sys.stderr)
        return 2
    except Exception as exc:
        if (line := out_of_memory(exc)) is not None:
            print(f"streamer {args.command}: error: {line}", file=sys.stderr)
            return 2
        if caused_by(exc, KeyboardInterrupt) is None:
            raise
        print("streamer: interrupted", file=sys.stderr)  # a Ctrl-C that landed inside an import's C code
        return 130
