"""Flags and files checked before any work starts: each problem is a UserError (one line, exit 2).

`check_args(args)` runs after parsing and before a command does anything (no run directory,
broker, corpus or model yet): strategy hyperparameters (--set and [strategy.<name>] tables)
against the strategy's signature, ports in range and free, --run-dir not a file, every
--bootstrap-servers address parsable, --model-opt name= a local path or a cached model.
"""

from __future__ import annotations

import errno
import inspect
import socket
from pathlib import Path

from streamer.cli.errors import UserError

__all__ = ["check_args", "check_hyperparameters", "check_port", "check_bootstrap", "check_run_dir",
           "check_model_name", "hyperparameter_defaults"]

# value ranges by name where the meaning is plain (anything else: only the type is checked)
PROBABILITIES = ("p_write", "fisher_decay", "gamma")
AT_LEAST_ONE = ("steps", "n_replay", "memory_size", "n_ref", "n_experts", "gate_steps", "gate_hidden",
                "n_components", "neighbours", "bottleneck", "max_adapters", "r_interval")
NOT_NEGATIVE = ("warmup_batches", "local_steps", "ewc_lambda", "l2_lambda", "alpha", "local_lambda")
POSITIVE = ("gate_lr", "local_lr")


def hyperparameter_defaults(strategy: str) -> dict[str, object]:
    """The hyperparameters --set may give a strategy, with their defaults (lr and clip are flags of the run)."""
    from streamer.cli.config_file import strategy_hyperparameters

    if strategy == "multitask":
        from streamer.multitask import ShuffledNaive as cls
    else:
        from streamer.strategies.catalog import strategy_class

        cls = strategy_class(strategy)
    allowed = strategy_hyperparameters(strategy)
    return {name: p.default for name, p in inspect.signature(cls).parameters.items() if name in allowed}


def _typed(key: str, value, default, where: str):
    """`value` as the type of `default`, or UserError."""
    if isinstance(default, bool):
        if value in (0, 1, True, False) or str(value).lower() in ("true", "false"):
            return value in (1, True) or str(value).lower() == "true"
        raise UserError(f"{where} {key}={value}: expected true or false")
    if isinstance(default, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"{where} {key}={value}: expected an integer (default {default})")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where} {key}={value}: expected a number (default {default:g})")
        return float(value)
    if isinstance(default, str):
        return str(value)
    return value


def _in_range(key: str, value, where: str) -> None:
    bad = ((key in PROBABILITIES and not 0 <= value <= 1, "in [0, 1]"),
           (key in AT_LEAST_ONE and value < 1, ">= 1"),
           (key in NOT_NEGATIVE and value < 0, ">= 0"),
           (key in POSITIVE and not value > 0, "> 0"))
    for failed, wanted in bad:
        if failed:
            raise UserError(f"{where} {key}={value}: expected a value {wanted}")


def check_hyperparameters(strategy: str, options, where: str = "--set") -> list[tuple[str, object]]:
    """(key, value) pairs checked against `strategy`'s signature; returns them with the values typed."""
    defaults = hyperparameter_defaults(strategy)
    checked = []
    for key, value in options:
        if key not in defaults:
            hint = "; --lr sets the learning rate" if key == "lr" else ""
            raise UserError(f"{where} {key}: not a hyperparameter of {strategy} "
                            f"(it takes {', '.join(sorted(defaults)) or 'none'}{hint})")
        value = _typed(key, value, defaults[key], where)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _in_range(key, value, where)
        checked.append((key, value))
    return checked


def check_port(port: int | None, host: str, flag: str) -> None:
    """A port in 0..65535 that nothing listens on (0: any free port)."""
    if port is None:
        return
    if not 0 <= port <= 65535:
        raise UserError(f"{flag} {port}: expected a port in 0..65535")
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"{flag} {port}: port {port} on {host} is in use (choose another, or 0 for a free one)"
                                ) from None
            raise UserError(f"{flag} {port}: cannot bind {host}:{port} ({exc.strerror})") from None


def check_bootstrap(servers: str | None, flag: str = "--bootstrap-servers") -> None:
    """Comma-separated HOST:PORT (or [IPv6]:PORT) addresses."""
    if servers is None:
        return
    entries = [entry.strip() for entry in servers.split(",")]
    for entry in entries:
        host, sep, port = entry.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        valid_host = bool(host) and all(c.isalnum() or c in ".-_:" for c in host)
        if not (sep and valid_host and port.isdigit() and 0 < int(port) <= 65535):
            raise UserError(f"{flag} {servers!r}: expected HOST:PORT[,HOST:PORT...], got {entry!r}")


def check_run_dir(run_dir: Path | None, flag: str = "--run-dir") -> None:
    """A directory, or a path where one can be made: not a file, nor under one."""
    if run_dir is None:
        return
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise UserError(f"{flag} {run_dir}: {path} is a file, not a directory")
            return


def check_model_name(options) -> None:
    """--model-opt name=X: a local directory, or a model in the local Hugging Face cache; never the hub."""
    for key, value in options:
        if key != "name":
            continue
        name = str(value)
        if Path(name).expanduser().exists():
            continue
        from streamer.models.weights import WEIGHTS

        if _in_hf_cache(name):
            continue
        built = f" (registered weights are given with --model-opt path=...; `streamer weights build {name}` " \
                f"builds them)" if name in WEIGHTS else ""
        raise UserError(f"--model-opt name={name}: neither a local path nor a model in the Hugging Face cache; "
                        f"streamer does not download from the hub here: use --model-opt path=DIR or gguf=FILE{built}")


def _in_hf_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a malformed repo id
        return False


def _strategy_names(args) -> list[str]:
    if getattr(args, "strategy", None):
        return [args.strategy]
    if getattr(args, "strategies", None):
        from streamer.compare import CompareError, strategy_names

        try:
            return list(strategy_names(args.strategies)[0])
        except CompareError:
            return []  # the command says why, in one line
    return []


def _check_strategy_options(args) -> None:
    names = _strategy_names(args)
    if not names:
        return
    if getattr(args, "strategy", None):  # learn, demo: --set and the file's table of the chosen strategy
        args.strategy_options = check_hyperparameters(args.strategy, args.strategy_options)
        return
    defaults = {name: hyperparameter_defaults(name) for name in names}  # compare: each that takes a key
    for name, table in (getattr(args, "strategy_tables", None) or {}).items():
        if name in defaults:
            check_hyperparameters(name, table.items(), where=f"[strategy.{name}]")
    for key, value in args.strategy_options:
        takers = [name for name in names if key in defaults[name]]
        if not takers:
            valid = sorted(set().union(*defaults.values()))
            raise UserError(f"--set {key}: none of {', '.join(names)} takes it (they take {', '.join(valid) or 'none'})")
        for name in takers:
            check_hyperparameters(name, [(key, value)])


def check_args(args) -> None:
    """Every check that applies to the parsed flags of `args.command`; UserError on the first problem."""
    check_bootstrap(getattr(args, "bootstrap_servers", None))
    check_run_dir(getattr(args, "run_dir", None))
    out = getattr(args, "out", None)
    if args.command == "compare":
        check_run_dir(out, "--out")
    if args.command == "broker":
        check_port(args.port, "127.0.0.1", "--port")
    if getattr(args, "metrics_port", None) is not None:
        check_port(args.metrics_port, getattr(args, "metrics_host", "127.0.0.1"), "--metrics-port")
    if getattr(args, "model_options", None):
        check_model_name(args.model_options)
    if getattr(args, "strategy_options", None) is not None:
        _check_strategy_options(args)
