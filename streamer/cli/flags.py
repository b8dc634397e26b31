"""Flag types, choices and the flag groups several subcommands share.

Every default shown here is read from the dataclass that owns it (LearnConfig, LSTMConfig,
Schedule, the stream options of producers.stream), so `--help` and the code cannot disagree.
Nothing here imports torch: `streamer --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
from pathlib import Path

from producers.orders import SCHEDULES, SEQUENCE_ORDERS
from producers.schedule import Schedule
from producers.stream import prepare_stream
from streamer.config import LearnConfig
from streamer.models.catalog import MODEL_CATALOG, LSTMConfig

__all__ = ["Parser", "STRATEGY_CHOICES", "MODEL_CHOICES", "DETECTOR_CHOICES", "DETECTOR_DESCRIPTIONS",
           "SCHEDULE_CHOICES", "ORDER_CHOICES", "PROBE_TOKENS", "SPAN_DEFAULT", "DEFAULT_BOOTSTRAP", "DEFAULT_TOPIC",
           "DEFAULT_CORPUS", "add_span_flag", "add_detector_flag", "positive_int", "positive_float",
           "non_negative_int", "probability", "port", "key_value", "seeds", "span", "default_of",
           "strategy_descriptions", "add_stream_flags", "add_model_flags", "add_run_flags", "add_broker_timeout_flag"]

MODEL_CHOICES = tuple(sorted(MODEL_CATALOG))
DETECTOR_CHOICES = ("adwin", "kswin", "none", "page-hinkley")  # monitor.drift.DETECTORS and none (a test keeps them equal)
DETECTOR_DESCRIPTIONS = {
    "page-hinkley": "Page-Hinkley test on the loss, rises only (quick, few false alarms)",
    "adwin": "ADWIN adaptive window: a change in the loss's mean, either way",
    "kswin": "Kolmogorov-Smirnov test of the last 30 losses against a 100-loss window",
    "none": "no detector",
}
SCHEDULE_CHOICES = SCHEDULES
ORDER_CHOICES = SEQUENCE_ORDERS
PROBE_TOKENS = 5000  # bytes per class the command line holds out as the probe split (the library's default is none)
# --from-fragment of learn, demo, compare and report: the paper's span. CALM scores fragments >= N/2 so that
# every class has been seen before the span starts; the live view, the final summary, Table 1 and the report
# then show the same numbers. Without a manifest (an open-ended topic has no N) learn scores the whole
# stream and says so at start.
SPAN_DEFAULT = "half"
# the defaults several subcommands share, each said once here
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"  # produce and learn: a local Kafka (`streamer broker --port 9092`, compose)
DEFAULT_TOPIC = "streamer"
DEFAULT_CORPUS = "calm-multilingual"
# where corpora are built and looked for: streamer.settings.cache_root (XDG_CACHE_HOME was unsaid)
CACHE_HELP = "corpus cache directory (default $STREAMER_CACHE, else $XDG_CACHE_HOME/streamer, else ~/.cache/streamer)"


def default_of(cls, name: str):
    """The default of a dataclass field or of a function's keyword argument: the one place it lives."""
    if dataclasses.is_dataclass(cls):
        found = {f.name: f for f in dataclasses.fields(cls)}[name]
        return found.default_factory() if found.default is dataclasses.MISSING else found.default
    return inspect.signature(cls).parameters[name].default


def strategy_descriptions() -> dict[str, str]:
    """Strategy name -> one-line description, without importing torch (streamer.strategies.catalog)."""
    from streamer.strategies.catalog import STRATEGY_CATALOG

    return {name: info.description for name, info in sorted(STRATEGY_CATALOG.items())}


STRATEGY_CHOICES = tuple(strategy_descriptions())


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _checked(kind: type, what: str, holds=lambda value: value > 0):
    """An argparse type: `kind` parsed from text, for which `holds(value)` (default: greater than zero); a
    float must be finite (`--lr inf` made every weight NaN in the first step, and the run went on)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not holds(value) or (isinstance(value, float) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


positive_int = _checked(int, "a positive integer")
positive_float = _checked(float, "a positive number")
non_negative_int = _checked(int, "an integer >= 0", lambda value: value >= 0)
probability = _checked(float, "a probability in 0..1", lambda value: 0 <= value <= 1)


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def key_value(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value an int, else a float, else text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


def strategy_name(text: str) -> str:
    if text == "multitask":
        raise argparse.ArgumentTypeError("multitask is the offline i.i.d. reference, not a streaming strategy: "
                                         "run it with `streamer compare --strategies naive,multitask`")
    return text


def seeds(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or len(set(values)) != len(values) or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated integers >= 0, got {text!r}")
    return values


def span(text: str) -> str | int:
    """--from-fragment: 'half', 'all' or a fragment index."""
    if text in ("half", "all"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'half', 'all' or a fragment index, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'half', 'all' or a fragment index >= 0, got {value}")
    return value


def add_detector_flag(group, what: str) -> None:
    """--detector with each detector's one-line description."""
    described = "; ".join(f"{name}: {text}" for name, text in DETECTOR_DESCRIPTIONS.items())
    group.add_argument("--detector", choices=DETECTOR_CHOICES, default=default_of(LearnConfig, "detector"),
                       help=f"{what} (default %(default)s). {described}")


def add_span_flag(group, what: str, *, the_runs: bool = False) -> None:
    """--from-fragment, the same in learn, demo, compare and report (SPAN_DEFAULT says why); `the_runs`
    (report): by default the span each run was learned with, from its config.json."""
    default = ("default: the span the run was learned with, from its config.json; 'half' for a log without one"
               if the_runs else "default: 'half'")
    group.add_argument("--from-fragment", type=span, default=None if the_runs else SPAN_DEFAULT,
                       help=f"{what}: the first fragment scored: 'half' (the paper's span, fragments >= N/2; "
                            f"without a manifest learn scores the whole stream and says so), 'all' or a "
                            f"fragment index ({default})")


def _class_list(text: str) -> tuple[str, ...]:
    return tuple(c for c in text.split(",") if c)


def add_stream_flags(p) -> None:
    """How `produce`, `demo` and `compare` cut a corpus into a stream (producers.schedule.Schedule)."""
    g = p.add_argument_group("stream schedule")
    g.add_argument("--schedule", choices=SCHEDULE_CHOICES, default=default_of(Schedule, "kind"),
                   help="default %(default)s; calm: CALM's random class order, sequence (each class once), "
                        "recurring (R rounds), "
                        "independent (each stream switches on its own clock)")
    g.add_argument("--order", choices=ORDER_CHOICES, default=default_of(Schedule, "order"),
                   help="sequence: given (--given-order), h2l / l2h by class size, or a balanced permutation "
                        "(default %(default)s)")
    g.add_argument("--given-order", type=_class_list, default=default_of(Schedule, "given_order"),
                   help="sequence with --order given: the class order, comma-separated (default: none; "
                        "needed by --order given)")
    g.add_argument("--permutation", type=int, default=default_of(Schedule, "permutation"),
                   help="sequence: which balanced permutation, 0 to classes - 1 (the classes' cyclic shifts, "
                        "not --fragments' N; default %(default)s)")
    g.add_argument("--repeats", type=positive_int, default=default_of(Schedule, "repeats"),
                   help="recurring: rounds over all classes (R; default %(default)s)")
    g.add_argument("--probe-tokens", type=non_negative_int, default=PROBE_TOKENS,
                   help="text corpora: bytes per class held out as the probe split, never streamed "
                        "(default %(default)s; 0 = none)")
    g.add_argument("--probe-examples", type=non_negative_int, default=default_of(prepare_stream, "probe_examples"),
                   help="utterance corpora: utterances per class held out as the probe split, never streamed "
                        "(default %(default)s; 0 = none)")
    g.add_argument("--as-text", action="store_true",
                   help="stream a labelled utterance corpus as running text instead of one utterance per record")
    g.add_argument("--fragments", type=positive_int, default=default_of(Schedule, "n_fragments"),
                   help="N: fragments in the stream (default %(default)s)")
    g.add_argument("--lambda", dest="mean_tokens", type=positive_int, default=default_of(Schedule, "mean_tokens"),
                   help="lambda: mean fragment length over all streams, in the corpus's tokens: bytes for text "
                        "corpora (calm-multilingual, your .txt), words for word corpora (calm-multidomain), "
                        "utterances for utterance corpora (intents-multilingual, multiwoz-domains, your JSONL/CSV) "
                        "(default %(default)s)")
    g.add_argument("--streams", type=positive_int, default=default_of(Schedule, "streams"),
                   help="b: parallel streams, one record key each (default %(default)s)")
    g.add_argument("--window", type=positive_int, default=default_of(Schedule, "window"),
                   help="w: tokens (bytes) per window and per record (default %(default)s)")
    g.add_argument("--seed", type=non_negative_int, default=default_of(Schedule, "seed"),
                   help="seed of the stream's schedule (demo and compare: of the model too) (default %(default)s)")


def _model_help() -> str:
    models = "; ".join(f"{info.name}: {info.description} (--lr default {info.default_lr:g}; options: {info.options})"
                       for info in MODEL_CATALOG.values())
    return "the model (default %(default)s). " + models.replace("%", "%%")


def add_model_flags(p, strategy: bool = True, threads_help: str | None = None) -> None:
    """The model, its sizes and options, and (learn, demo) the strategy; `threads_help`: compare's own."""
    g = p.add_argument_group("model and strategy")
    if strategy:
        described = "; ".join(f"{name}: {text}" if text else name for name, text in strategy_descriptions().items())
        g.add_argument("--strategy", type=strategy_name, choices=STRATEGY_CHOICES,
                       default=default_of(LearnConfig, "strategy"),
                       help=f"the continual-learning strategy (default %(default)s). {described.replace('%', '%%')}")
    g.add_argument("--model", dest="model_name", choices=MODEL_CHOICES, default=default_of(LearnConfig, "model_name"),
                   help=_model_help())
    g.add_argument("--model-opt", dest="model_options", action="append", type=key_value, default=[],
                   metavar="KEY=VALUE", help="an option of the model, e.g. --model-opt path=DIR (repeatable; "
                                             "default: none; `streamer models` lists each model's options)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=default_of(LearnConfig, "device"),
                   help="auto = cuda when available, else cpu (default %(default)s)")
    g.add_argument("--hidden", type=positive_int, default=default_of(LSTMConfig, "hidden"),
                   help="LSTM hidden size, units per layer (default %(default)s)")
    g.add_argument("--embedding", type=positive_int, default=default_of(LSTMConfig, "embedding"),
                   help="token embedding size (bytes for lstm-char, words for lstm-word), dimensions "
                        "(default %(default)s)")
    g.add_argument("--layers", type=positive_int, default=default_of(LSTMConfig, "layers"),
                   help="LSTM layers (default %(default)s)")
    g.add_argument("--dropout", type=probability, default=default_of(LSTMConfig, "dropout"),
                   help="dropout probability between the LSTM layers, 0..1 (default %(default)s)")
    lrs = ", ".join(f"{name} {info.default_lr:g}" for name, info in MODEL_CATALOG.items())
    g.add_argument("--lr", type=positive_float,
                   help=f"Adam learning rate (default: the model's own: {lrs}; pretrained hf-* models diverge "
                        f"at the LSTMs' rate)")
    g.add_argument("--clip", type=positive_float,
                   help=f"gradient-norm clipping threshold of the trainer (default {default_of(LearnConfig, 'clip'):g}; "
                        "--set clip=X is the same)")
    g.add_argument("--set", dest="strategy_options", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="a hyperparameter of the strategy, e.g. --set p_write=0.1 (repeatable; default: none; "
                        "`streamer strategies NAME` lists its keys, defaults and ranges; --set lr=X and clip=X "
                        "are --lr and --clip)")
    g.add_argument("--params", type=positive_int, metavar="N",
                   help="size the hidden layers so the strategy's model has about N parameters "
                        "(models sized by --hidden only; overrides --hidden; default: --hidden decides)")
    g.add_argument("--threads", type=positive_int, metavar="N",
                   help=threads_help or "torch threads (default: the CPUs this process may use, less one for the "
                                        "event loop when there are more than 2; OMP_NUM_THREADS when set)")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML file: flag defaults (top-level keys), [strategy.<name>] hyperparameters, "
                        "[model] options; the command line wins (default: none)")


def add_broker_timeout_flag(g, producing: bool = False) -> None:
    """--broker-timeout: learn, demo (through add_run_flags), compare and produce (`producing`)."""
    what = "mid-run (a send waits for it)" if producing else "mid-run (the learner keeps its model and waits)"
    g.add_argument("--broker-timeout", type=positive_float, default=default_of(LearnConfig, "broker_timeout_s"),
                   metavar="SECONDS",
                   help="seconds the Kafka broker may be unreachable, at start (retried with backoff) or lost "
                        f"{what}, before giving up with exit status 2"
                        + ("" if producing else "; the learner writes its checkpoint first") + " (default %(default)s)")


def add_run_flags(p, minutes: float | None = None, metrics_port: int | None = None,
                  run_dir_default: str = "runs/<time>-<strategy>") -> None:
    """How a learning run (learn, demo) stops, is watched and is checkpointed (`minutes`, `metrics_port`:
    the command's own defaults, when it has them)."""
    g = p.add_argument_group("run")
    g.add_argument("--run-dir", type=Path,
                   help=f"where losses.jsonl, results.json, plots and checkpoint.pt go (default {run_dir_default})")
    g.add_argument("--max-batches", type=positive_int,
                   help="stop after this many batches (default: no limit; the stream's end when there is a manifest)")
    g.add_argument("--minutes", type=positive_float, default=minutes,
                   help="stop after this many minutes (%s)" % ("default %(default)s" if minutes else "default: no limit"))
    g.add_argument("--metrics-port", type=port, default=metrics_port,
                   help="serve Prometheus metrics on this port (0 = a free port; %s)"
                        % ("default: none served" if metrics_port is None else "default %(default)s"))
    g.add_argument("--metrics-host", default=default_of(LearnConfig, "metrics_host"),
                   help="address the metrics endpoint binds (default %(default)s: this machine only; 0.0.0.0 for all)")
    add_span_flag(g, "the span of the live CALM metrics and the final tables")
    g.add_argument("--no-view", action="store_true", help="plain log lines instead of the live terminal view")
    add_detector_flag(g, "drift detector that finds switches in the loss without labels")
    g.add_argument("--probe-every", type=non_negative_int, default=default_of(LearnConfig, "probe_every"),
                   help="score each class's held-out probe split every N batches (0: only at switches; "
                        "default %(default)s)")
    g.add_argument("--no-probe", action="store_true",
                   help="do not score the manifest's probe split (default: scored when the manifest has one)")
    g.add_argument("--checkpoint-every", type=positive_float, default=default_of(LearnConfig, "checkpoint_every_s"),
                   help="seconds between checkpoints (one is always written at the end; default %(default)s)")
    add_broker_timeout_flag(g)
    g.add_argument("--max-record-bytes", type=positive_int, default=default_of(LearnConfig, "max_record_bytes"),
                   help="dead-letter records larger than this many bytes, key, value and headers together, as "
                        "too_large (default %(default)s)")
