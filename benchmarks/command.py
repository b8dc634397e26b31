"""What the benchmarks' command lines share.

Option types that refuse a bad value with argparse's one line (not a traceback from deep inside a
run): the CLI's `positive_int`, and `counts` (comma-separated, each at least 1), `seconds`
(finite, over 0) and `fraction` (0 <= x < 1).

`ended_by_signals`: a benchmark stopped by a signal ends as Ctrl-C ends it, through its `finally`
blocks (its child processes stopped and reaped, the broker stopped, scratch files removed), then one
line and status 128 + the signal. Without it, SIGTERM (`timeout`, as benchmarks/gpu_host.sh runs
them, or a kill) ended the parent at once and left its children running, orphaned; Ctrl-C printed a
traceback. Once one signal arrived, further SIGINT and SIGTERM are ignored, so the clean-up is not
cut short; kill -9 still ends it (children started with streamer.broker.die_with_parent die with it).

    with ended_by_signals("scaling"):
        ...  # the benchmark
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys

from streamer.cli.flags import positive_float, positive_int

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def counts(text: str) -> list[int]:
    """Comma-separated whole numbers, each at least 1 (`5,10,30`)."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no numbers in {text!r}")
    return values


def seconds(text: str) -> float:
    """A finite number of seconds over 0."""
    value = positive_float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text}")
    return value


def fraction(text: str) -> float:
    """At least 0 and below 1 (a dropout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:  # (nan too)
        raise argparse.ArgumentTypeError(f"expected at least 0 and below 1, got {text}")
    return value


@contextlib.contextmanager
def ended_by_signals(name: str):
    received: list[int] = []

    def interrupt(signum, frame) -> None:
        received.append(signum)
        for each in SIGNALS:  # the clean-up runs to its end
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {each: signal.signal(each, interrupt) for each in SIGNALS}
    try:
        yield
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        print(f"{name}: stopped by {signal.Signals(signum).name}; its processes are ended and its scratch "
              "files removed", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
