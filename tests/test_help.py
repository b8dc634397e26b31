"""Every flag explained once: each option of every subcommand has help, its default and its unit.

The parser is built in-process (streamer.cli.build_parser) and walked, nested subcommands included.
"""

import argparse
import re

import pytest

from streamer.cli import build_parser, main

# An option whose name says it is a duration, size, rate or port names its unit in its help.
UNITS = {
    r"minutes": ("minute",),
    r"timeout|every$|checkpoint-every": ("second", "batches"),
    r"bytes|probe-tokens": ("bytes",),
    r"probe-examples": ("utterances",),
    r"rate$": ("per second",),
    r"port$": ("port",),
    r"lambda|window": ("bytes", "tokens"),
    r"hidden|embedding": ("units", "dimensions"),
    r"max-batches": ("batches",),
}


def subparsers(parser: argparse.ArgumentParser, prefix: str = "streamer"):
    """(command path, parser) of every subcommand, nested ones included."""
    for action in parser._actions:  # noqa: SLF001 (argparse keeps subparsers there)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from subparsers(sub, f"{prefix} {name}")


COMMANDS = dict(subparsers(build_parser()))


def options(parser: argparse.ArgumentParser):
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):  # noqa: SLF001
            continue
        yield action


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)  # noqa: SLF001 (what --help prints for the option)


WORDED_DEFAULTS = {("streamer broker", "--port"): "a free one"}  # a default said in words


def shown(default) -> tuple[str, ...]:
    """How a default may appear in help text."""
    if isinstance(default, float):
        return (f"{default:g}", str(default), f"{default:,g}")
    return (str(default),)


def test_the_walk_finds_every_subcommand():
    assert {"streamer learn", "streamer demo", "streamer produce", "streamer compare", "streamer report",
            "streamer broker", "streamer data build", "streamer weights build", "streamer monitor push",
            "streamer strategies", "streamer models"} <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_a_default_and_a_unit(command):
    parser = COMMANDS[command]
    problems = []
    for action in options(parser):
        name = action.option_strings[-1] if action.option_strings else action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            problems.append(f"{name}: no help")
            continue
        text = expanded_help(parser, action)
        flag_like = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # noqa: SLF001
        if action.option_strings and not flag_like and action.default not in (None, [], (), argparse.SUPPRESS):
            forms = (*shown(action.default), WORDED_DEFAULTS.get((command, name), "\0"))
            if "default" not in text or not any(form in text for form in forms):
                problems.append(f"{name}: default {action.default!r} not shown in {text!r}")
        elif action.option_strings and not flag_like and action.default is None and action.required is False:
            if "default" not in text:
                problems.append(f"{name}: no default said (what happens without it?) in {text!r}")
        for pattern, words in UNITS.items():
            if action.option_strings and re.search(pattern, name) and not any(word in text for word in words):
                problems.append(f"{name}: no unit ({' or '.join(words)}) in {text!r}")
    assert not problems, f"{command}:\n" + "\n".join(problems)


def test_each_strategy_model_and_detector_is_described_in_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping: descriptions compare whole
    from streamer.cli.flags import DETECTOR_DESCRIPTIONS, strategy_descriptions
    from streamer.models.catalog import MODEL_CATALOG

    learn = COMMANDS["streamer learn"].format_help()
    flat = " ".join(learn.split())
    for name, description in strategy_descriptions().items():
        assert f"{name}: {' '.join(description.split())}" in flat, name
    for info in MODEL_CATALOG.values():
        assert f"{info.name}: {' '.join(info.description.split())}" in flat, info.name
    for name, description in DETECTOR_DESCRIPTIONS.items():
        assert f"{name}: {' '.join(description.split())}" in flat, name


def test_demo_help_shows_the_defaults_it_runs():
    from streamer.cli import parse

    args = parse(["demo"])
    assert (args.fragments, args.mean_tokens, args.minutes, args.metrics_port) == (40, 10_000, None, 0)
    text = " ".join(COMMANDS["streamer demo"].format_help().split())
    assert "N: fragments in the stream (default 40)" in text
    assert "stop after this many minutes (default: no limit)" in text


def test_from_fragment_means_the_same_everywhere():
    from streamer.cli import parse
    from streamer.cli.flags import SPAN_DEFAULT

    for command in ("learn", "demo", "compare"):
        assert parse([command]).from_fragment == SPAN_DEFAULT
    assert parse(["report", "x"]).from_fragment is None  # each run's own span (config.json), else 'half'
    from monitor.report import DEFAULT_SPAN

    assert DEFAULT_SPAN == SPAN_DEFAULT


def test_strategies_lists_each_hyperparameter_with_its_default_and_range(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    from streamer.cli.flags import strategy_descriptions

    for name, description in strategy_descriptions().items():
        assert f"{name}: {description}" in out
    assert re.search(r"p_write\s+default 0\.1; takes \[0, 1\]", out)
    assert re.search(r"n_experts\s+default 30; takes >= 1", out)
    assert re.search(r"clip\s+default 1\.0; set with --clip", out)
    assert main(["strategies", "naive"]) == 0
    assert capsys.readouterr().out.startswith("naive: online fine-tuning")


def test_models_lists_each_model(capsys):
    from streamer.models.catalog import MODEL_CATALOG

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for info in MODEL_CATALOG.values():
        assert f"{info.name}: {info.description}" in out and info.options in out


def test_a_listing_whose_reader_left_ends_quietly_and_no_other_broken_pipe_is_taken_for_it(monkeypatch):
    """`streamer strategies | head -1`: the reader closes the pipe, the next write fails with EPIPE, and the
    command ends 0 without a word. A broken pipe of anything else (a job's, a process's) was taken for
    that too: the command then ended 0 and said nothing of it."""
    import subprocess
    import sys

    cli_main = sys.modules["streamer.cli.main"]  # (the package's `main` is the function)
    listing = subprocess.Popen([sys.executable, "-m", "streamer", "strategies"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    listing.stdout.close()  # before its first line
    err = listing.stderr.read()
    assert listing.wait(timeout=60) == 0 and err == "", err

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setitem(cli_main.COMMANDS, "models", broken)
    with pytest.raises(BrokenPipeError):
        main(["models"])
