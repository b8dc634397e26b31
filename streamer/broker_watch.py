"""Whether the prequential loop's broker answers: lost, back, or away too long.

A watch task asks the source whether its broker answers (`source.reachable()`, when it has one) every
`probe_every_s`: a broker that has not answered for `lost_after_s` is lost (one line; the model is
kept, the queued batches are learned, nothing is committed), one that answers again is back (one line;
the consumer rejoins its group and reads on from the learner's own offsets); one lost for
`broker_timeout_s` stops the loop with stop_reason "broker_lost" (the learner then checkpoints)."""

from __future__ import annotations

import asyncio
import time

__all__ = ["BrokerWatch"]


class BrokerWatch:
    """Watch `source`'s broker for streamer.loop.PrequentialLoop. `each_probe()` runs after each answer
    (the intake's log_changes); `stop(reason)` stops the loop."""

    def __init__(self, source, *, probe_every_s: float, lost_after_s: float, broker_timeout_s: float | None,
                 log, each_probe, stop):
        self.source = source
        self.broker_timeout_s, self.probe_every_s, self.lost_after_s = broker_timeout_s, probe_every_s, lost_after_s
        self._log, self._each_probe, self._stop = log, each_probe, stop
        self.lost_since: float | None = None  # wall time of the broker's last answer while it is lost
        self.topic_gone = False  # lost as the topic was deleted (the broker answers): said so
        self.closing = False  # set on leaving the loop's `async with`: the watch task's loop ends

    async def watch(self) -> None:
        """Lost, back, or away too long: see the module's docstring."""
        reachable = getattr(self.source, "reachable", None)
        if reachable is None:
            return
        where = getattr(self.source, "bootstrap_servers", "the broker")
        answered = time.monotonic()
        while True:
            await asyncio.sleep(self.probe_every_s)
            if self.closing:
                return
            ok = await reachable()
            if self.closing:
                return
            self._each_probe()
            now = time.monotonic()
            if ok:
                if self.lost_since is not None:
                    back = f"topic {self.source.topic} exists again at {where}" if self.topic_gone else \
                        f"Kafka at {where} is back"
                    self._log(f"{back} after {time.time() - self.lost_since:.0f} s; rejoining the group, "
                              "reading on from the learner's own offsets")
                    self.lost_since, self.topic_gone = None, False
                answered = now
                continue
            away = now - answered
            if self.lost_since is None and away >= self.lost_after_s:
                self.lost_since = time.time() - away
                self.topic_gone = getattr(self.source, "topic_gone", False)  # (deleted: the broker answers)
                timeout = f"{self.broker_timeout_s:g} s" if self.broker_timeout_s else "ever"
                lost = f"topic {self.source.topic} is gone from {where} (deleted {away:.0f} s ago)" \
                    if self.topic_gone else f"Kafka at {where} is lost (no answer for {away:.0f} s)"
                self._log(f"{lost}; keeping the model, waiting for it up to {timeout} (--broker-timeout)")
            if self.broker_timeout_s and away >= self.broker_timeout_s:
                self._stop("broker_lost")
                return
