"""`--config FILE`: flag defaults and hyperparameters from a TOML file (learn, demo, compare).

    fragments = 10              # top-level keys: flag names without "--", dashes or underscores
    lambda = 3000
    seeds = [0, 1, 2]           # a list is the comma-separated flag value
    strategy = "replay"         # or [strategy] name = "replay" when the file also has [strategy.<name>]

    [strategy.replay]           # that strategy's hyperparameters (what --set KEY=VALUE sets)
    p_write = 0.05

    [model]                     # the model's options (what --model-opt KEY=VALUE sets);
    path = "/data/model"        # name = "lstm-char" here picks the model, like --model

The command line wins: a flag given there overrides the file's value, and `--set` /
`--model-opt` entries come after the file's, so theirs are the ones used. An unknown key,
strategy or hyperparameter, or a value the flag would refuse, is a one-line error.
"""

from __future__ import annotations

import argparse
import inspect
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from streamer.cli.errors import UserError

__all__ = ["ConfigError", "ConfigFile", "read_config_file", "apply_config_file", "strategy_hyperparameters"]

_TABLE_FLAGS = {"set": "[strategy.<name>] tables", "model_opt": "the [model] table", "config": "the command line"}


class ConfigError(UserError):
    """A config file that cannot be used; one line naming the file and the key."""


@dataclass(frozen=True)
class ConfigFile:
    path: Path
    flags: dict[str, Any] = field(default_factory=dict)  # argparse dest -> value, converted and checked
    strategies: dict[str, dict[str, Any]] = field(default_factory=dict)  # strategy -> hyperparameters
    model: dict[str, Any] = field(default_factory=dict)  # model options


def strategy_hyperparameters(name: str) -> set[str]:
    """The keyword arguments a strategy's constructor takes that a file or --set may give.

    lr and clip are flags of their own; `multitask` takes its shuffled learner's."""
    if name == "multitask":
        from streamer.multitask import ShuffledNaive as cls
    else:
        from streamer.strategies.catalog import STRATEGY_CATALOG, strategy_class

        if name not in STRATEGY_CATALOG:
            raise KeyError(name)
        cls = strategy_class(name)
    parameters = inspect.signature(cls).parameters
    return {key for key in parameters if key not in ("model", "lr", "clip")}


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Flag name (without dashes, "-" as "_") -> its action, for every --long flag of `parser`."""
    actions = {}
    for action in parser._actions:  # noqa: SLF001 (argparse has no public list of a parser's flags)
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option[2:].replace("-", "_")] = action
    return actions


def _convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    """`value` as the flag would have parsed it from the command line."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # noqa: SLF001
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(value, (dict, bool)) or action.nargs not in (None, "?"):
        raise ConfigError(f"{where}: {key} cannot be {value!r}")
    text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
    if action.type is not None:
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
    else:
        value = text
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {key} = {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _strategy_tables(entries: dict, where: str) -> tuple[str | None, dict[str, dict[str, Any]]]:
    name, tables = None, {}
    for strategy, table in entries.items():
        if strategy == "name":
            name = table
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [strategy] holds name = \"...\" and [strategy.<name>] tables, "
                              f"got {strategy} = {table!r}")
        try:
            allowed = strategy_hyperparameters(strategy)
        except KeyError:
            raise ConfigError(f"{where}: [strategy.{strategy}]: unknown strategy") from None
        for key in table:
            if key not in allowed:
                hint = " (a flag: set it at the top level)" if key in ("lr", "clip") else ""
                raise ConfigError(f"{where}: [strategy.{strategy}] {key}: not a hyperparameter of {strategy}"
                                  f"{hint}; it takes {', '.join(sorted(allowed)) or 'none'}")
        tables[strategy] = dict(table)
    return name, tables


def _both_hint(text: str, error: str) -> str:
    """Why TOML refused a file with `strategy = "x"` (or `model = ...`) beside a [strategy.x] (or [model])
    table: a key cannot be a value and a table at once."""
    both = [key for key in ("strategy", "model") if re.search(rf"(?m)^\s*{key}\s*=", text)
            and re.search(rf"(?m)^\s*\[\s*{key}\s*[.\]]", text)]
    if "Cannot overwrite a value" not in error or not both:
        return ""
    key = both[0]
    return (f"; {key} = \"...\" and a [{key}...] table cannot both be in one file: write the name in the "
            f"table, [{key}] name = \"...\"")


def read_config_file(path: Path, parser: argparse.ArgumentParser) -> ConfigFile:
    """Read and check a TOML config against the flags of `parser` (one subcommand's parser)."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a TOML file (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML ({exc}){_both_hint(text, str(exc))}") from None
    actions = _flag_actions(parser)
    flags, strategies, model = {}, {}, {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key == "strategy" and isinstance(value, dict):
            name, strategies = _strategy_tables(value, where)
            if name is None:
                continue
            value = name
        elif key == "model" and isinstance(value, dict):
            model = dict(value)
            if "name" not in model:
                continue
            value = model.pop("name")
        if key in _TABLE_FLAGS:
            raise ConfigError(f"{where}: {raw_key}: not allowed at the top level; use {_TABLE_FLAGS[key]}")
        if key not in actions:
            raise ConfigError(f"{where}: {raw_key}: unknown key (not a flag of `streamer {parser.prog.split()[-1]}`)")
        action = actions[key]
        flags[action.dest] = _convert(action, raw_key, value, where)
    return ConfigFile(Path(path), flags, strategies, model)


def apply_config_file(path: Path, parser: argparse.ArgumentParser,
                      parse_again: Callable[[], argparse.Namespace]) -> argparse.Namespace:
    """Make the file's values the subcommand's defaults and parse the command line again, so its
    flags win; then put the file's hyperparameters and model options before the command line's (a
    hyperparameter given with --set is dropped from every table of the file, so its bad value is not refused).

    Sets `args.strategy_tables` (strategy -> hyperparameters) for commands that run several."""
    config = read_config_file(path, parser)
    parser.set_defaults(**config.flags)
    args = parse_again()
    if hasattr(args, "model_options"):
        args.model_options = [*config.model.items(), *args.model_options]
    elif config.model:
        raise ConfigError(f"{path}: [model]: this command has no model options")
    given = {key for key, _ in args.strategy_options}  # a --set KEY wins: the file's KEY is neither taken
    tables = {name: {key: value for key, value in table.items() if key not in given}  # nor checked
              for name, table in config.strategies.items()}
    if hasattr(args, "strategy"):  # learn and demo: the chosen strategy's table
        args.strategy_options = [*tables.get(args.strategy, {}).items(), *args.strategy_options]
    args.strategy_tables = tables
    return args
