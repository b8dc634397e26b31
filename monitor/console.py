"""What an operator watches: the run's activity, its compute and waiting time, and rates that fall to zero.

`ActivityClock` turns the loop's plain state, read a few times a second (a `LoopReading`), into the
run's activity (waiting for the topic, joining the group, consuming, caught up and waiting,
broker lost, checkpointing, stopping, stopped) and splits wall time into compute (consuming,
checkpointing) and waiting (the topic's creation, joining the consumer group, idle, broker lost).
Its rates: tokens/s over the last few seconds of wall time (zero when nothing is learned) and over
the last minute of compute (waiting excluded, so it keeps the model's speed while the run waits).
`ConsoleSnapshot` is the tracker's `ViewSnapshot` plus these readings: what the terminal view, the
plain log and `streamer status` (through `status.json`) show.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from monitor.files import json_safe, replace_text
from monitor.tracker import ViewSnapshot

__all__ = ["ActivityClock", "ConsoleSnapshot", "LoopReading", "TimeSplit", "COMPUTE_ACTIVITIES",
           "STATUS_FILE", "as_console", "snapshot_to_json", "snapshot_from_json", "write_status", "read_status"]

COMPUTE_ACTIVITIES = ("consuming", "checkpointing", "stopping")  # the rest waits: topic_missing, joining,
# waiting (caught up), broker_lost, topic_gone (deleted under the learner: waited for as a lost broker)
STATUS_VERSION = 1
STATUS_FILE = "status.json"  # in the run directory: the console's latest snapshot, for `streamer status`


@dataclass(frozen=True)
class LoopReading:
    """The loop's, the checkpointer's and the probes' plain state at one moment (wall times in seconds
    since the epoch). `waiting_since is None` with `waiting_reported=False`: the loop does not say, and
    the clock infers "caught up" (no lag, nothing queued, no batch for a while)."""

    step: int = 0
    records: int = 0
    lag: dict = field(default_factory=dict)  # partition -> records not yet taken (the consumer lag)
    read_again: int = 0  # records read again after a rewind (--keep-windows), the run's total
    queue_depth: int = 0
    waiting_since: float | None = None
    waiting_reported: bool = False
    broker_lost_since: float | None = None
    topic_gone: bool = False  # lost as the topic was deleted (the broker answers), since broker_lost_since
    checkpointing: bool = False
    checkpoint_at: float | None = None  # the last written checkpoint
    probe_seconds: float = 0.0
    stop_reason: str | None = None  # the loop was asked to stop, or reached a stop condition
    finished: bool = False  # the run is over (its final checkpoint written)
    topic_missing_since: float | None = None  # the source waits for its topic to be created
    waiting_for: tuple = ()  # stream ids the next batch waits for while others' records come (waiting_since: since)
    busy_s: float | None = None  # the worker's seconds in steps so far (None: not said; see ActivityClock)


@dataclass(frozen=True)
class TimeSplit:
    """Where a run's wall time went (seconds): compute, and waiting by cause."""

    compute_s: float = 0.0
    joining_s: float = 0.0  # before the first partition is read: the group's JoinGroup
    idle_s: float = 0.0  # caught up, waiting for records
    broker_lost_s: float = 0.0
    topic_missing_s: float = 0.0  # the topic does not exist yet (a source that waits for its creation)

    @property
    def waiting_s(self) -> float:
        return self.joining_s + self.idle_s + self.broker_lost_s + self.topic_missing_s


@dataclass(frozen=True)
class ConsoleSnapshot(ViewSnapshot):
    """The view's snapshot plus the operator's readings; `tokens_per_s` here is over the last
    `recent_window_s` of wall time (zero when idle), `lag` the sum of `lag_by_partition`."""

    activity: str = "consuming"
    activity_since: float | None = None  # wall time the activity began
    stop_reason: str | None = None
    records: int | None = None
    lag_by_partition: dict = field(default_factory=dict)
    read_again: int = 0  # records read again after a rewind (LoopReading)
    recent_window_s: float = 5.0
    tokens_per_s_compute: float | None = None  # over the last minute of compute
    compute_s: float | None = None
    waiting_s: float | None = None
    checkpoint_age_s: float | None = None
    probe_s: float = 0.0
    probe_share: float | None = None  # probe evaluations' share of wall time
    at: float | None = None  # wall time of the snapshot
    waiting_for: tuple = ()  # stream ids the next batch waits for while others' records come (LoopReading)


def as_console(snapshot: ViewSnapshot) -> ConsoleSnapshot:
    """A tracker's ViewSnapshot as a ConsoleSnapshot without readings (the view accepts both)."""
    if isinstance(snapshot, ConsoleSnapshot):
        return snapshot
    return ConsoleSnapshot(**{f.name: getattr(snapshot, f.name) for f in fields(ViewSnapshot)})


class ActivityClock:
    """Activity, compute/waiting split and token rates; call `read()` a few times a second and
    `learned()` at every batch, with monotonic `now` (wall times come in the readings).

    Compute is the worker's own time where the loop says it (`LoopReading.busy_s`, with the probes'
    seconds): the wall time while consuming goes to compute up to what the worker spent in steps, the
    rest to idle. A live topic's records that come a few a second keep the run consuming between
    batches, while the worker waits for them: counted as compute, a paced stream's 'last min of
    compute' rate fell to a fiftieth of the model's speed. Without it, the activity's wall time."""

    def __init__(self, recent_window_s: float = 5.0, compute_window_s: float = 60.0, idle_after_s: float = 2.0,
                 min_compute_s: float = 0.01):
        self.recent_window_s, self.compute_window_s, self.idle_after_s = recent_window_s, compute_window_s, idle_after_s
        self.min_compute_s = min_compute_s
        self.activity, self.activity_since = "joining", None
        self._split = {"compute_s": 0.0, "joining_s": 0.0, "idle_s": 0.0, "broker_lost_s": 0.0, "topic_missing_s": 0.0}
        self._started = self._last = None  # monotonic
        self._started_wall = None
        self._recent: deque = deque()  # (monotonic, tokens)
        self._computed: deque = deque()  # (compute seconds so far, tokens)
        self._recent_tokens = self._computed_tokens = 0  # their tokens, kept as they change (read per batch)
        self._last_batch = self._last_batch_wall = None
        self._records_at_start = None
        self._probe_seconds_at_start = None
        self.reading = LoopReading()
        self._consuming_from = -math.inf  # (monotonic) when the activity last became consuming
        self._busy_seen: float | None = None  # the worker's (and probes') seconds at the last reading
        self._pool = 0.0  # wall seconds consuming since then: compute up to the worker's, the rest idle

    def _advance(self, now: float) -> None:
        """Account the time since the last call to the activity that held during it."""
        if self._started is None:
            self._started = self._last = now
            self._started_wall = time.time()
            return
        bucket = {"consuming": "compute_s", "checkpointing": "compute_s", "stopping": "compute_s",
                  "joining": "joining_s", "topic_missing": "topic_missing_s", "waiting": "idle_s",
                  "broker_lost": "broker_lost_s", "topic_gone": "broker_lost_s"}.get(self.activity)
        if bucket == "compute_s" and self.activity == "consuming" and self._busy_seen is not None:
            self._pool += max(0.0, now - self._last)  # settled at the next reading (_settle)
        elif bucket:
            self._split[bucket] += max(0.0, now - self._last)
        self._last = now

    def _settle(self, busy: float) -> None:
        """The consuming time since the last reading: compute as far as the worker spent `busy - seen`
        seconds in steps (and probes), idle beyond. Steps run while the activity said waiting or joining
        (a batch's step before its result turns the run to consuming) move from there to compute."""
        if self._busy_seen is None:
            self._busy_seen = busy
            return
        worked, self._busy_seen = max(0.0, busy - self._busy_seen), max(busy, self._busy_seen)
        taken = min(worked, self._pool)
        self._split["compute_s"] += taken
        self._split["idle_s"] += self._pool - taken
        self._pool, left = 0.0, worked - taken
        for bucket in ("idle_s", "joining_s"):
            moved = min(left, self._split[bucket])
            self._split[bucket] -= moved
            self._split["compute_s"] += moved
            left -= moved

    def _set(self, activity: str, since: float | None) -> None:
        if activity != self.activity:
            self.activity, self.activity_since = activity, since or time.time()
        elif since is not None:
            self.activity_since = since

    def learned(self, tokens: int, now: float) -> None:
        """A batch was learned at `now`: it counts in both rates; the run is consuming."""
        self._advance(now)
        if self.activity in ("joining", "waiting"):
            self._set("consuming", time.time())
        self._last_batch, self._last_batch_wall = now, time.time()
        self._recent.append((now, tokens))
        self._computed.append((self._split["compute_s"], tokens))
        self._recent_tokens += tokens
        self._computed_tokens += tokens

    def read(self, reading: LoopReading, now: float) -> None:
        """The loop's state at `now`: the activity from here on."""
        self._advance(now)
        if reading.busy_s is not None:
            self._settle(reading.busy_s + reading.probe_seconds)
        if self._records_at_start is None:
            self._records_at_start, self._probe_seconds_at_start = reading.records, reading.probe_seconds
        self.reading = reading
        before = self.activity
        self._set(*self._activity(reading, now))
        if before != "consuming" and self.activity == "consuming":
            self._consuming_from = now
        if before == "consuming" and self.activity == "waiting" and self._busy_seen is None:
            # inferred, or reported late (streams waited for; records that make no batch): the quiet time since
            # the last batch (or since the activity became consuming, after an earlier wait) was waiting, as far
            # back as the loop's wait began (one it says at once moves next to nothing)
            quiet_since = max(self._last_batch if self._last_batch is not None else self._started, self._consuming_from)
            quiet = min(now - quiet_since, self._split["compute_s"])
            if reading.waiting_reported and reading.waiting_since is not None:
                quiet = max(0.0, min(quiet, time.time() - reading.waiting_since))
            self._split["compute_s"] -= quiet
            self._split["idle_s"] += quiet

    def _activity(self, r: LoopReading, now: float) -> tuple[str, float | None]:
        if r.finished:
            return "stopped", None
        if r.broker_lost_since is not None:
            return ("topic_gone" if r.topic_gone else "broker_lost"), r.broker_lost_since
        if r.stop_reason is not None:
            return "stopping", None
        if r.checkpointing:
            return "checkpointing", None
        if r.topic_missing_since is not None:
            return "topic_missing", r.topic_missing_since
        if r.waiting_reported:
            if r.waiting_since is not None:
                return "waiting", r.waiting_since
        elif self._caught_up(r, now):
            return "waiting", self._last_batch_wall
        if not r.lag and r.records == self._records_at_start and self._last_batch is None:
            return "joining", self._started_wall  # no partition read yet in this process
        return "consuming", None

    def _caught_up(self, r: LoopReading, now: float) -> bool:
        quiet_since = self._last_batch if self._last_batch is not None else self._started
        return bool(r.lag) and not sum(r.lag.values()) and not r.queue_depth and now - quiet_since >= self.idle_after_s

    def split(self, now: float | None = None) -> TimeSplit:
        """Where the wall time went so far (consuming time not yet settled counts as compute)."""
        if now is not None:
            self._advance(now)
        return TimeSplit(**{**self._split, "compute_s": self._split["compute_s"] + self._pool})

    def recent_rate(self, now: float) -> float:
        """Tokens learned per second over the last `recent_window_s` of wall time: zero when idle."""
        while self._recent and now - self._recent[0][0] > self.recent_window_s:
            self._recent_tokens -= self._recent.popleft()[1]
        if self._started is None:
            return 0.0
        span = min(self.recent_window_s, max(now - self._started, 0.5))
        return self._recent_tokens / span

    def compute_rate(self, now: float) -> float | None:
        """Tokens per second over the last `compute_window_s` of compute time (waiting excluded):
        the model's speed, kept while the run waits. None before any batch or `min_compute_s` of compute."""
        settled = self.activity == "consuming" and self._busy_seen is not None  # (compute comes at readings)
        ongoing = self.activity in COMPUTE_ACTIVITIES and not settled
        computed = self._split["compute_s"] + (now - self._last if ongoing else 0.0)
        while self._computed and computed - self._computed[0][0] > self.compute_window_s:
            self._computed_tokens -= self._computed.popleft()[1]
        if computed < self.min_compute_s or self._last_batch is None:
            return None
        return self._computed_tokens / min(self.compute_window_s, computed)

    def snapshot(self, view: ViewSnapshot, now: float, wall: float) -> ConsoleSnapshot:
        """The tracker's snapshot with this clock's readings at `now` (monotonic) / `wall`."""
        r, split = self.reading, self.split(now)
        elapsed = now - self._started if self._started is not None else 0.0
        probe_s = r.probe_seconds - (self._probe_seconds_at_start or 0.0)
        values = {f.name: getattr(view, f.name) for f in fields(ViewSnapshot)}
        values.update(tokens_per_s=self.recent_rate(now), lag=sum(r.lag.values()) if r.lag else view.lag,
                      queue_depth=r.queue_depth)
        return ConsoleSnapshot(
            **values, activity=self.activity, activity_since=self.activity_since, stop_reason=r.stop_reason,
            records=r.records, lag_by_partition={str(p): lag for p, lag in sorted(r.lag.items())},
            read_again=r.read_again,
            recent_window_s=self.recent_window_s, tokens_per_s_compute=self.compute_rate(now),
            compute_s=split.compute_s, waiting_s=split.waiting_s,
            checkpoint_age_s=None if r.checkpoint_at is None else max(0.0, wall - r.checkpoint_at),
            probe_s=probe_s, probe_share=probe_s / elapsed if elapsed >= 1.0 else None, at=wall,
            waiting_for=tuple(r.waiting_for) if self.activity == "waiting" else ())


def snapshot_to_json(snapshot: ConsoleSnapshot) -> dict:
    return {"version": STATUS_VERSION, **asdict(snapshot)}


def _numbers(value):
    """json_safe's "inf", "-inf" and "nan" back to floats, in a value of numbers (or lists and dicts of them)."""
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {key: _numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers(item) for item in value]
    return value


def snapshot_from_json(data: dict) -> ConsoleSnapshot:
    """Inverse of snapshot_to_json (tuples back from lists; a numeric field's "inf" and "nan", as status.json
    writes them, back to floats); unknown keys are ignored."""
    numeric = {f.name for f in fields(ConsoleSnapshot) if "str" not in str(f.type)}  # (names: a class "inf")
    known = {f.name for f in fields(ConsoleSnapshot)}
    values = {key: _numbers(value) if key in numeric else value for key, value in data.items() if key in known}
    for name in ("recent_losses", "recent_switches", "waiting_for"):
        values[name] = tuple(values.get(name, ()))
    return ConsoleSnapshot(**values)


def write_status(path: Path, snapshot: ConsoleSnapshot) -> None:
    """`status.json` in the run directory, replaced atomically (a reader never sees half a file); strict JSON: a
    diverged run's inf is "inf" (see monitor.files.json_safe)."""
    replace_text(path, json.dumps(json_safe(snapshot_to_json(snapshot)), default=str, allow_nan=False))


def read_status(path: Path) -> ConsoleSnapshot | None:
    """The last status a learner wrote, or None without one (or an unreadable one)."""
    try:
        return snapshot_from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None
