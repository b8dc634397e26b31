"""`streamer strategies [NAME...]` and `streamer models`: every name with its one-line description; for
strategies each hyperparameter with its default and range (streamer.strategies.params.signature, the
same signature `--set` is checked against and `repr` prints)."""

from __future__ import annotations

from streamer.cli.errors import UserError
from streamer.cli.flags import DETECTOR_DESCRIPTIONS, STRATEGY_CHOICES, strategy_descriptions
from streamer.models.catalog import MODEL_CATALOG

__all__ = ["add_parsers", "run_strategies", "run_models", "strategy_lines"]


def add_parsers(sub) -> None:
    p = sub.add_parser("strategies", help="list the strategies: description, hyperparameters, defaults and ranges")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="only these strategies, or multitask (default: every strategy)")
    sub.add_parser("models", help="list the models: description, default learning rate and --model-opt options")


def _default_text(name: str, hyperparameter) -> str:
    from dataclasses import MISSING

    if name == "lr":
        rates = ", ".join(f"{model} {info.default_lr:g}" for model, info in MODEL_CATALOG.items())
        return f"the model's ({rates}); set with --lr"
    if name == "seed":
        return "the run's --seed"
    if name == "clip":
        return f"{hyperparameter.default!r}; set with --clip"
    return "none (required)" if hyperparameter.default is MISSING else repr(hyperparameter.default)


def strategy_lines(name: str) -> list[str]:
    """The strategy's description line, then one line per hyperparameter: name, default, range."""
    from streamer.cli.checks import strategy_signature

    description = strategy_descriptions().get(name, "the offline i.i.d. reference (MULTI), compare only")
    lines = [f"{name}: {description}"]
    signature = strategy_signature(name)
    width = max((len(key) for key in signature), default=0)
    for key, hyperparameter in signature.items():
        lines.append(f"    {key:<{width}}  default {_default_text(key, hyperparameter)}; takes {hyperparameter.allowed}")
    return lines


def run_strategies(args) -> int:
    names = args.names or list(STRATEGY_CHOICES)
    unknown = [name for name in names if name not in (*STRATEGY_CHOICES, "multitask")]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r} (known: {', '.join(STRATEGY_CHOICES)}, multitask)")
    for name in names:
        print("\n".join(strategy_lines(name)))
    print("\nset a hyperparameter with --set KEY=VALUE (learn, demo, compare) or a [strategy.<name>] table in "
          "--config FILE; boundaries: " + "; ".join(f"{k}: {v}" for k, v in DETECTOR_DESCRIPTIONS.items())
          + "; every:N: a boundary after every N-th batch")
    return 0


def run_models(args) -> int:
    for info in MODEL_CATALOG.values():
        print(f"{info.name}: {info.description}\n    default --lr {info.default_lr:g}; options: {info.options}")
    print("\ngive a model with --model NAME and its options with --model-opt KEY=VALUE; "
          "`streamer weights list` shows the pretrained weights the hf-* models load")
    return 0
