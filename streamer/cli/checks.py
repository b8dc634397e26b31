"""Flags and files checked before any work starts: each problem is a UserError (one line, exit 2).

`check_args(args)` runs after parsing and before a command does anything (no run directory,
broker, corpus or model yet): strategy hyperparameters (--set and [strategy.<name>] tables)
against the strategy's signature, ports in range and free, --run-dir not a file, every
--bootstrap-servers address parsable, --model-opt name= a local path or a cached model.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path

from streamer.cli.errors import UserError
from streamer.settings import torchrun_environment

__all__ = ["check_args", "check_hyperparameters", "check_port", "check_bootstrap", "check_run_dir", "check_topic",
           "check_writable", "check_model_name", "hyperparameter_defaults", "strategy_signature", "route_trainer_keys"]


def strategy_signature(strategy: str) -> dict:
    """The strategy's hyperparameters (streamer.strategies.params.signature), lr and clip included."""
    from streamer.strategies.params import signature

    if strategy == "multitask":
        from streamer.multitask import ShuffledNaive as cls
    else:
        from streamer.strategies.catalog import strategy_class

        cls = strategy_class(strategy)
    return signature(cls)


def hyperparameter_defaults(strategy: str) -> dict[str, object]:
    """The hyperparameters `--set` gives a strategy, with their defaults (lr and clip: the run's --lr, --clip)."""
    from streamer.strategies.params import TRAINER_KEYS

    return {name: h.default for name, h in strategy_signature(strategy).items() if name not in TRAINER_KEYS}


def _valid_keys(names) -> str:
    return ", ".join(sorted(names)) or "none"


def check_hyperparameters(strategy: str, options, where: str = "--set") -> list[tuple[str, object]]:
    """(key, value) pairs checked against `strategy`'s signature (type and range); returns them typed.

    lr and clip are checked too, though the run (--lr, --clip) carries them (see route_trainer_keys)."""
    from streamer.strategies.params import HyperparameterError

    accepted = strategy_signature(strategy)
    checked = []
    for key, value in options:
        if key not in accepted:
            raise UserError(f"{where} {key}: not a hyperparameter of {strategy} (it takes {_valid_keys(accepted)}; "
                            f"`streamer strategies {strategy}` shows their defaults and ranges)")
        try:
            checked.append((key, accepted[key].check(value)))
        except HyperparameterError as exc:
            raise UserError(f"{where} {exc}") from None
    return checked


def route_trainer_keys(args, options) -> list[tuple[str, object]]:
    """`--set lr=X` and `--set clip=X` are --lr X and --clip X (one rule: the trainer's step and clipping
    belong to the run, every gradient strategy takes them); the other options are returned.

    Given both ways with different values, a one-line error names both."""
    from streamer.strategies.params import TRAINER_KEYS

    rest = []
    for key, value in options:
        if key not in TRAINER_KEYS:
            rest.append((key, value))
            continue
        flag = getattr(args, key, None)  # --lr and --clip default to None: the model's rate, LearnConfig's clip
        if flag is not None and float(flag) != float(value):
            raise UserError(f"--set {key}={value} contradicts --{key} {flag}: give one")
        setattr(args, key, float(value))
    return rest


def check_port(port: int | None, host: str, flag: str) -> None:
    """A port in 0..65535 that nothing listens on (0: any free port)."""
    if port is None:
        return
    if not 0 <= port <= 65535:
        raise UserError(f"{flag} {port}: expected a port in 0..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))  # (0: any free port; the host is checked all the same)
        except OSError as exc:  # (socket.gaierror too: a host that resolves to nothing)
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"{flag} {port}: port {port} on {host} is in use (choose another, or 0 for a free one)"
                                ) from None
            raise UserError(f"{flag} {port}: cannot bind {host}:{port} ({exc.strerror or exc})") from None


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


_TOPIC = re.compile(r"[A-Za-z0-9._-]+")
_TOPIC_LIMIT = 249  # Kafka's
_NAME_LIMIT = 255  # bytes of a file name (ext4, xfs, tmpfs)


def check_topic(args) -> None:
    """--topic a name Kafka takes (letters, digits, '.', '_', '-'; at most 249 characters, with the
    `.truth` topic `produce` writes or the learner's `.dlq`; not '.' or '..'): the embedded broker takes
    any, and the name also names files. Without --manifest, `<topic>.manifest.json` a file name the file system
    takes; without --run-dir, `learn`'s `runs/<topic>-<group>` one directory."""
    topic = getattr(args, "topic", None)
    if topic is None or args.command not in ("learn", "produce"):
        return
    if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise UserError(f"--topic {topic!r}: not a Kafka topic name (ASCII letters, digits, '.', '_' and '-')")
    # the learner's dead letters go to <topic>.dlq, produce's fragment starts to <topic>.truth
    sidecar = ".truth" if args.command == "produce" and not args.no_truth_topic else ".dlq"
    if len(topic + sidecar) > _TOPIC_LIMIT:
        raise UserError(f"--topic: {len(topic)} characters, over Kafka's {_TOPIC_LIMIT - len(sidecar)} (with its "
                        f"{sidecar} topic" + ("; or --no-truth-topic)" if sidecar == ".truth" else ")"))
    if args.manifest is None and len(f"{topic}.manifest.json") > _NAME_LIMIT:
        raise UserError(f"--topic: {len(topic)} characters, too long for its default manifest's file name "
                        f"({topic[:12]}....manifest.json); give --manifest PATH")
    if args.command == "learn" and args.run_dir is None:
        from streamer.config import default_group

        group = args.group or default_group(topic, args.strategy)
        name = f"{topic}-{group}"
        if "/" in name or len(name.encode()) > _NAME_LIMIT:
            raise UserError(f"the default run directory runs/<topic>-<group> cannot be named after --topic and "
                            f"--group {group[:40]!r}{'...' if len(group) > 40 else ''} (one directory: no '/', "
                            f"at most {_NAME_LIMIT} bytes); give --run-dir DIR")


def check_writable(path: Path, flag: str = "--manifest") -> None:
    """A file `path` can be written at: not a directory, and its nearest existing folder writable."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: a directory, not a file")
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise UserError(f"{flag} {path}: {folder} is not a folder this user can write in")
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
        from streamer.compare_plan import CompareError, strategy_names

        try:
            return list(strategy_names(args.strategies)[0])
        except CompareError:
            return []  # the command says why, in one line
    return []


def _check_strategy_options(args) -> None:
    names = _strategy_names(args)
    if not names:
        return
    for name, table in (getattr(args, "strategy_tables", None) or {}).items():  # the file's, named as its
        if name in names:  # (a bad value there was blamed on --set)
            check_hyperparameters(name, table.items(), where=f"{getattr(args, 'config', None)}: [strategy.{name}]")
    if getattr(args, "strategy", None):  # learn, demo: --set and the file's table of the chosen strategy
        checked = check_hyperparameters(args.strategy, args.strategy_options)
        args.strategy_options = route_trainer_keys(args, checked)
        return
    signatures = {name: strategy_signature(name) for name in names}  # compare: each that takes a key
    for key, value in args.strategy_options:
        takers = [name for name in names if key in signatures[name]]
        if not takers:
            valid = set().union(*signatures.values())
            raise UserError(f"--set {key}: none of {', '.join(names)} takes it (they take {_valid_keys(valid)})")
        for name in takers:
            check_hyperparameters(name, [(key, value)])
    args.strategy_options = route_trainer_keys(args, args.strategy_options)


def check_cuda() -> None:
    """--device cuda where torch sees no CUDA device: one line before any work."""
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(f"--device cuda: torch sees no CUDA device here (torch {torch.__version__}, {build}); "
                        "give --device cpu, or auto (cuda where there is one)")


def check_args(args) -> None:
    """Every check that applies to the parsed flags of `args.command`; UserError on the first problem."""
    check_bootstrap(getattr(args, "bootstrap_servers", None))
    check_run_dir(getattr(args, "run_dir", None))
    check_topic(args)
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
    if getattr(args, "device", None) == "cuda":  # (compare built and produced its stream first, then failed, and
        check_cuda()                            # its --out held files that refused the same command on cpu)
    if getattr(args, "pin_cpus", False) and args.nproc == 1 and torchrun_environment() is None:
        raise UserError("--pin-cpus pins a rank of torchrun (or of --nproc N) to its share of the CPUs; "
                        "this is one process: leave it out, or use taskset")
