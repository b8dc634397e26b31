"""`streamer compare`: its flags, turned into a streamer.compare_plan.CompareConfig and run (streamer.compare)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path

from streamer.cli.configs import model_config, schedule, stream_options
from streamer.cli.errors import UserError
from streamer.cli.flags import (CACHE_HELP, DEFAULT_CORPUS, add_broker_timeout_flag, add_detector_flag, add_model_flags,
                                add_span_flag, add_stream_flags, default_of, non_negative_int, positive_float,
                                positive_int, seeds)
from streamer.cli.runs import ensure_corpus, sigterm_as_interrupt
from streamer.cli.security_flags import add_security_flags
from streamer.config import LearnConfig

__all__ = ["add_parser", "run", "strategy_options", "compare_config"]


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="several strategies on the same stream and seeds, then CALM's Table 1")
    p.add_argument("--strategies", default="naive,replay",
                   help="comma-separated strategies, 'multitask' (the i.i.d. reference) included, or 'all' "
                        "(every registered one that runs on the model, and multitask); default %(default)s")
    p.add_argument("--seeds", type=seeds, help="comma-separated seeds, one stream each (default: --seed)")
    p.add_argument("--out", type=Path, help="one run directory per strategy and seed, and the tables "
                                            "(default runs/compare-<time>)")
    p.add_argument("--bootstrap-servers", metavar="HOST:PORT",
                   help="use this Kafka instead of the embedded broker (default: the embedded broker on a free port)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="a corpus name (built on first use) or a path of your own data (default %(default)s)")
    p.add_argument("--cache", type=Path, help=CACHE_HELP)
    add_stream_flags(p)
    add_model_flags(p, strategy=False, threads_help=(
        "torch threads of each run: with runs side by side (--jobs above 1) 1 each by default; with --jobs 1 "
        "the CPUs this process may use, less one for the event loop when there are more than 2; "
        "OMP_NUM_THREADS when set"))
    add_security_flags(p)
    g = p.add_argument_group("runs")
    g.add_argument("--max-batches", type=positive_int, help="stop each run after this many batches (default: no limit)")
    g.add_argument("--minutes", type=positive_float, help="stop each run after this many minutes (default: no limit)")
    add_span_flag(g, "the span of the tables")
    g.add_argument("-k", type=positive_int, default=default_of(LearnConfig, "k"),
                   help="batches after a switch for ppl@sw (default %(default)s)")
    add_detector_flag(g, "drift detector scored against the true switches")
    g.add_argument("--probe-every", type=non_negative_int, default=default_of(LearnConfig, "probe_every"),
                   help="score each class's probe split every N batches (0: only at switches; default %(default)s)")
    g.add_argument("--no-probe", action="store_true", help="do not score the probe split (default: scored)")
    g.add_argument("--checkpoint-every", type=positive_float, default=default_of(LearnConfig, "checkpoint_every_s"),
                   help="seconds between checkpoints of each run (default %(default)s)")
    add_broker_timeout_flag(g)
    g.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoint.pt (deleted after its report by default)")
    g.add_argument("--jobs", type=positive_int, metavar="N",
                   help="runs at a time, each in its own process with 1 torch thread (--threads N or "
                        "OMP_NUM_THREADS: N each); 1 runs them one after the other in this process (default: "
                        "the CPUs this process may use, divided by each run's threads)")


def strategy_options(names: list[str], tables: dict, cli_options) -> dict[str, tuple]:
    """Per strategy: its config-file table, then each --set KEY=VALUE it takes (later wins).

    A --set key that none of the strategies takes is an error."""
    from streamer.cli.config_file import strategy_hyperparameters

    allowed = {name: strategy_hyperparameters(name) for name in names}
    for key, _ in cli_options:
        if not any(key in keys for keys in allowed.values()):
            raise UserError(f"--set {key}: none of {', '.join(names)} takes it")
    return {name: (*tables.get(name, {}).items(), *((k, v) for k, v in cli_options if k in allowed[name]))
            for name in names}


def compare_config(args):
    """The comparison the flags ask for (its corpus as given: `run` puts the built directory there)."""
    from streamer.compare_plan import CompareConfig, CompareError, strategy_names
    from streamer.settings import omp_num_threads
    from streamer.threads import available_cpus

    try:
        names, by_all = strategy_names(args.strategies)
    except CompareError as exc:
        raise UserError(str(exc)) from None
    tables = getattr(args, "strategy_tables", {}) or {}
    options = stream_options(args)
    threads = args.threads or omp_num_threads() or 1  # each job's (a user's OMP_NUM_THREADS, as the policy's)
    return CompareConfig(
        learn=model_config(args, bootstrap_servers="", topic="", run_dir=Path("."), k=args.k, live_view=False),
        schedule=schedule(args), corpus=Path(args.corpus),
        out=args.out or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}",
        strategies=tuple(names), chosen_by_all=by_all,
        options=strategy_options(names, tables, args.strategy_options),
        seeds=tuple(args.seeds or (args.seed,)), params=args.params, span=args.from_fragment,
        probe_examples=options["probe_examples"], utterances=options["utterances"],
        keep_checkpoints=args.keep_checkpoints, bootstrap_servers=args.bootstrap_servers,
        flags={k: v for k, v in vars(args).items() if k not in ("strategy_tables", "thread_line")},
        jobs=args.jobs or max(1, available_cpus() // threads), job_threads=threads,
        thread_line=getattr(args, "thread_line", ""))


def run(args) -> int:
    from streamer.compare import run_compare

    sigterm_as_interrupt()
    config = compare_config(args)  # the strategies are checked before a corpus is built
    run_compare(dataclasses.replace(config, corpus=ensure_corpus(args.corpus, args.cache)))
    return 0
