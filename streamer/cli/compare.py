"""`streamer compare`: its flags, turned into a streamer.compare.CompareConfig and run."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path

from streamer.cli.configs import model_config, schedule, stream_options
from streamer.cli.errors import UserError
from streamer.cli.flags import (DETECTOR_CHOICES, add_model_flags, add_stream_flags, default_of, positive_float,
                                positive_int, seeds, span)
from streamer.cli.runs import ensure_corpus, sigterm_as_interrupt
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
    p.add_argument("--bootstrap-servers", help="use this Kafka instead of the embedded broker")
    p.add_argument("--corpus", default="calm-multilingual",
                   help="a corpus name (built on first use) or a path of your own data (default %(default)s)")
    p.add_argument("--cache", type=Path, help="corpus cache directory (default $STREAMER_CACHE or ~/.cache/streamer)")
    add_stream_flags(p)
    add_model_flags(p, strategy=False)
    g = p.add_argument_group("runs")
    g.add_argument("--max-batches", type=positive_int, help="stop each run after this many batches (default: no limit)")
    g.add_argument("--minutes", type=positive_float, help="stop each run after this many minutes (default: no limit)")
    g.add_argument("--from-fragment", type=span, default="half",
                   help="evaluated span of the tables: 'half' (default, the paper's N/2), 'all' or an index")
    g.add_argument("-k", type=positive_int, default=default_of(LearnConfig, "k"),
                   help="batches after a switch for ppl@sw (default %(default)s)")
    g.add_argument("--detector", choices=DETECTOR_CHOICES, default=default_of(LearnConfig, "detector"),
                   help="drift detector scored against the true switches (default %(default)s)")
    g.add_argument("--probe-every", type=int, default=default_of(LearnConfig, "probe_every"),
                   help="score each class's probe split every N batches (0: only at switches; default %(default)s)")
    g.add_argument("--no-probe", action="store_true", help="do not score the probe split")
    g.add_argument("--checkpoint-every", type=positive_float, default=default_of(LearnConfig, "checkpoint_every_s"),
                   help="seconds between checkpoints of each run (default %(default)s)")
    g.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoint.pt (deleted after its report by default)")


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
    from streamer.compare import CompareConfig, CompareError, strategy_names

    try:
        names, by_all = strategy_names(args.strategies)
    except CompareError as exc:
        raise UserError(str(exc)) from None
    tables = getattr(args, "strategy_tables", {}) or {}
    options = stream_options(args)
    return CompareConfig(
        learn=model_config(args, bootstrap_servers="", topic="", run_dir=Path("."), k=args.k, live_view=False),
        schedule=schedule(args), corpus=Path(args.corpus),
        out=args.out or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}",
        strategies=tuple(names), chosen_by_all=by_all,
        options=strategy_options(names, tables, args.strategy_options),
        seeds=tuple(args.seeds or (args.seed,)), params=args.params, span=args.from_fragment,
        probe_examples=options["probe_examples"], utterances=options["utterances"],
        keep_checkpoints=args.keep_checkpoints, bootstrap_servers=args.bootstrap_servers,
        flags={k: v for k, v in vars(args).items() if k != "strategy_tables"})


def run(args) -> int:
    from streamer.compare import run_compare

    sigterm_as_interrupt()
    config = compare_config(args)  # the strategies are checked before a corpus is built
    run_compare(dataclasses.replace(config, corpus=ensure_corpus(args.corpus, args.cache)))
    return 0
