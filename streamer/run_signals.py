"""How a learning run meets SIGINT and SIGTERM: the first stops the loop after the step in flight (the last
checkpoint, the commit, the group left, the report); a second SIGINT exits at once (130), a second SIGTERM is
ignored."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from streamer.loop import PrequentialLoop

__all__ = ["StopOnSignals"]


class StopOnSignals:
    """While the run lasts, `signals` stop the loop cleanly; a second SIGINT exits at once (130), through
    the report too, and a second SIGTERM is ignored."""

    def __init__(self, signals: tuple, loop: PrequentialLoop, log):
        self.signals, self.loop, self.log = tuple(signals), loop, log

    def __enter__(self):
        event_loop = asyncio.get_running_loop()
        for signum in self.signals:
            event_loop.add_signal_handler(signum, self._received, signum)
        return self

    def __exit__(self, *exc) -> None:
        event_loop = asyncio.get_running_loop()
        for signum in self.signals:
            event_loop.remove_signal_handler(signum)  # puts Python's own SIGINT handler back
        if self.loop.stop_reason == "signal":  # "Ctrl-C again aborts" holds through the report as well
            signal.signal(signal.SIGINT, _abort_handler)
            # and a second SIGTERM is ignored there, as during the stop: the report is kept (a rank's
            # agent that dies sends one)
            if signal.SIGTERM in self.signals:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _received(self, signum) -> None:
        name = signal.Signals(signum).name
        if self.loop.stop_reason == "signal":
            if signum == signal.SIGINT:
                _abort(signum)
            return
        self.log(f"{name}: stopping after the step in flight (checkpoint, commit, leave the group); "
                 + ("Ctrl-C again aborts" if signum == signal.SIGINT else "SIGINT aborts"))
        self.loop.stop("signal")
        # From now on SIGINT aborts in Python's own handler, which runs between two bytecodes of the
        # main thread: the event loop's handler would wait for whatever the shutdown is doing
        # (the last checkpoint, the report), which under load took over 2 s.
        signal.signal(signal.SIGINT, _abort_handler)


def _abort_handler(signum, frame) -> None:
    _abort(signum)


def _abort(signum) -> None:
    print(f"streamer: {signal.Signals(signum).name} again: exiting now, without a final checkpoint",
          file=sys.stderr, flush=True)
    os._exit(130)
