"""The terminal view: a pure function from a snapshot to a rich renderable.

`LiveView` has rich.live.Live redraw it (``get_renderable``) on a terminal and falls back
to one plain log line every few seconds when stdout is not a terminal (or a dumb one) (less often while the
run waits, and at once when its activity changes). The snapshot is a monitor.console
ConsoleSnapshot (a tracker's ViewSnapshot renders too, without the operator's readings).
"""

from __future__ import annotations

import math
import time

from rich.console import Console, ConsoleOptions, Group
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from monitor.console import ConsoleSnapshot, as_console
from monitor.tracker import ViewSnapshot, exp_or_inf

__all__ = ["render", "render_waiting", "shown_classes", "sparkline", "plain_line", "progress_row", "status_line",
           "io_line", "rate_line", "activity_line", "activity_text", "duration", "streams_text", "waiting_for_line",
           "many_classes_line", "learning_on_line", "LiveView"]

_BARS = "▁▂▃▄▅▆▇█"


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if value == float("inf"):
        return "inf"
    if abs(value) >= 1e6:  # a diverging run's ppl of 1e217: not 218 digits
        return f"{value:.{digits + 1}g}"
    return f"{value:.{digits}f}"


def sparkline(values, switches=()) -> Text:
    """Loss bars scaled to the window's finite range; switch positions in bold red, a non-finite loss (a diverged
    batch's inf or nan, which raised ValueError here and stopped the view) as a bold red ×."""
    text = Text()
    finite = [value for value in values if math.isfinite(value)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
    span = (high - low) or 1.0
    switches = tuple(switches) + (False,) * (len(values) - len(switches))
    for value, switched in zip(values, switches):
        if not math.isfinite(value):
            text.append("×", style="bold red")
            continue
        bar = _BARS[min(len(_BARS) - 1, int((value - low) / span * len(_BARS)))]
        text.append("┃" if switched else bar, style="bold red" if switched else "cyan")
    return text


_NUMBERS = ("batches", "ppl", "ppl@sw", "rec")  # the CALM table's columns after the class
_TABLE_CHROME = 3 * (1 + len(_NUMBERS)) + 1  # its borders and cells' padding


def shown_classes(names, current: str | None, rows: int | None) -> tuple[list, int]:
    """The classes a table of at most `rows` class rows shows (all of them when None): the first ones in `names`'
    order with `current` among them, one row left to say how many more there are; and that many."""
    names = list(names)
    if rows is None or len(names) <= rows:
        return names, 0
    room = max(1, rows - 1) - (current in names)
    first = set([name for name in names if name != current][:room])
    shown = [name for name in names if name in first or name == current]
    return shown, len(names) - len(shown)


class _ClassTable:
    """The CALM table, laid out for the width it is drawn at: numbers are never cut (a 40-column terminal showed
    `33.…`); a header gives way to its values' width first, then the class names (with an ellipsis, the current
    class's marker kept). At most `class_rows` rows of classes (see shown_classes); the row "all" always."""

    def __init__(self, snapshot: ViewSnapshot, class_rows: int | None = None):
        self.snapshot, self.class_rows = snapshot, class_rows

    def _table(self, max_width: int) -> Table:
        s, o = self.snapshot, self.snapshot.overall
        names, more = shown_classes(sorted(s.per_class), s.current_class, self.class_rows)
        cells = {name: (str(v["n_batches"]), _fmt(v["ppl"]), _fmt(v["ppl@sw"]), _fmt(v["rec"]))
                 for name, v in s.per_class.items()}
        rows = [(name, name == s.current_class, cells[name]) for name in names]
        more_row = Text(f"+{more} more", style="dim") if more else None
        total = ("", _fmt(o["ppl"]), _fmt(o["ppl@sw"]), _fmt(o["rec"]))
        values = [max(len(cells[i]) for cells in [total] + [row[2] for row in rows]) for i in range(len(_NUMBERS))]
        widths = [max(width, len(header)) for width, header in zip(values, _NUMBERS)]
        names = max([len("all"), len(more_row or "")] + [len(name) + 2 * current for name, current, _ in rows])
        over = sum(widths) + names - (max_width - _TABLE_CHROME)
        edges = over <= 0  # else without the outer borders and their padding: 4 columns more
        over -= 0 if edges else 4
        for index, value in enumerate(values):
            cut = max(0, min(over, widths[index] - value))
            widths[index], over = widths[index] - cut, over - cut
        names = max(3, names - max(0, over))
        table = Table(title=f"CALM metrics (fragments >= {s.from_fragment})", expand=False, show_edge=edges,
                      pad_edge=edges)
        table.add_column("class", width=names, no_wrap=True, overflow="ellipsis")
        for header, width in zip(_NUMBERS, widths):
            table.add_column(header, justify="right", width=width, no_wrap=True, overflow="ellipsis")
        for name, current, cells in rows:
            label = Text(name, no_wrap=True, overflow="ellipsis")
            if current:
                label.truncate(max(1, names - 2), overflow="ellipsis")
                label.append(" ◀")
            table.add_row(label, *cells)
        if more_row is not None:
            table.add_row(more_row)
        table.add_row(Text("all"), *total, style="bold")
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions):
        yield self._table(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self._table(options.max_width))


def _clock(wall: float | None) -> str:
    return "?" if wall is None else time.strftime("%H:%M:%S", time.localtime(wall))


def duration(seconds: float | None) -> str:
    """12s, 3m04s, 2h05m; n/a for None."""
    if seconds is None:
        return "n/a"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


_ACTIVITY_STYLE = {"consuming": "bold green", "checkpointing": "bold blue", "waiting": "bold yellow",
                   "joining": "bold yellow", "topic_missing": "bold yellow", "broker_lost": "bold red",
                   "topic_gone": "bold red",
                   "stopping": "bold", "stopped": "bold"}


def activity_text(snapshot: ConsoleSnapshot) -> str:
    """consuming / caught up, waiting since HH:MM:SS / broker lost since HH:MM:SS / checkpointing / ..."""
    since = _clock(snapshot.activity_since)
    if snapshot.activity == "waiting" and snapshot.waiting_for:
        return (f"waiting for {streams_text(snapshot.waiting_for)} since {since} "
                "(a batch takes a window of every stream)")
    return {"waiting": f"caught up, waiting for records since {since}",
            "joining": f"joining the consumer group since {since}",
            "topic_missing": f"waiting for the topic to be created since {since}",
            "broker_lost": f"broker lost since {since}",
            "topic_gone": f"topic deleted since {since} (waited for up to --broker-timeout)",
            "stopping": f"stopping ({snapshot.stop_reason}): last checkpoint, commit, leaving the group",
            "stopped": f"stopped: {snapshot.stop_reason or 'done'}"}.get(snapshot.activity, snapshot.activity)


def streams_text(ids, most: int = 8) -> str:
    """stream 3 / streams 3, 7 / streams 0, 1, ... (+5 more)"""
    ids = list(ids)
    shown = ", ".join(str(i) for i in ids[:most]) + (f" (+{len(ids) - most} more)" if len(ids) > most else "")
    return f"stream{'s' if len(ids) > 1 else ''} {shown}"


def waiting_for_line(streams: tuple, windows: int, waited_s: float) -> str:
    """The log line when the learning has waited `waited_s` for `streams` (LoopReading.waiting_for)."""
    return (f"the next batch waits for {streams_text(streams)}: no batch for {duration(waited_s)} while another "
            f"stream holds more than {windows} windows (a batch takes a window of every stream; the others' "
            "records are kept, not learned, until then)")


def many_classes_line(first: str, limit: int) -> str:
    """The log line when the truth headers have named more than `limit` classes (RunTracker.past_limit)."""
    return (f"the truth headers have named more than {limit:,} classes (the next: {first!r}): each is kept apart "
            "for the life of the run, about 1 KB of memory and 0.2 KB of every checkpoint a class; a header with "
            "a value per record (an id) is not a class (README: How a stream looks)")


def learning_on_line(streams: tuple, waited_s: float) -> str:
    """The log line when a batch is cut again after the learning waited for `streams`."""
    return f"{streams_text(streams)}: records came, learning on after {duration(waited_s)} of waiting"


def _lag_unknown(snapshot: ConsoleSnapshot) -> bool:
    """Readings came in, but none with the lag (no partition measured yet)."""
    return snapshot.records is not None and not snapshot.lag_by_partition


def _lag_text(snapshot: ConsoleSnapshot, most: int = 8) -> str:
    if _lag_unknown(snapshot):
        return "n/a"
    parts = [f"p{partition} {lag:,}" for partition, lag in list(snapshot.lag_by_partition.items())[:most]]
    more = len(snapshot.lag_by_partition) - most
    detail = " · ".join(parts) + (f" · +{more} more" if more > 0 else "")
    return f"{snapshot.lag:,}" + (f" ({detail})" if detail else "")


def _dead_text(snapshot: ConsoleSnapshot) -> str:
    total = sum(snapshot.dead_letters.values())
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(snapshot.dead_letters.items()))
    return f"{total:,}" + (f" ({reasons})" if reasons else "")


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def activity_line(snapshot: ConsoleSnapshot) -> Text:
    style = _ACTIVITY_STYLE.get(snapshot.activity, "bold")
    records = "n/a" if snapshot.records is None else f"{snapshot.records:,}"
    return Text.assemble((activity_text(snapshot), style), ("  records ", "dim"), records,
                         ("  batches ", "dim"), f"{snapshot.batches:,}",
                         ("  elapsed ", "dim"), duration(snapshot.elapsed_s))


def progress_row(snapshot: ViewSnapshot) -> Table:
    total = snapshot.total_batches
    progress = Table.grid(padding=(0, 1))
    label = f"{snapshot.batches}/{total} batches" if total else f"{snapshot.batches} batches"
    progress.add_row(ProgressBar(total=total or None, completed=snapshot.batches, width=40), Text(label))
    return progress


def status_line(snapshot: ViewSnapshot) -> Text:
    return Text.assemble(
        ("loss ", "dim"), _fmt(snapshot.last_loss, 3), ("  ppl ", "dim"),
        _fmt(exp_or_inf(snapshot.last_loss)),  # (a loss of 3e4 overflowed a float power)
        ("  rolling ppl ", "dim"), _fmt(snapshot.rolling_ppl),
        ("  class ", "dim"), snapshot.current_class or "n/a",
        ("  switches ", "dim"), f"{snapshot.switches} true / {snapshot.detected_switches} detected",
    )


def rate_line(snapshot: ConsoleSnapshot) -> Text:
    return Text.assemble(
        ("tokens/s ", "dim"), f"{snapshot.tokens_per_s:,.0f}", (f" (last {snapshot.recent_window_s:.0f}s)", "dim"),
        ("  ", "dim"), _rate(snapshot.tokens_per_s_compute), (" (last minute of compute)", "dim"),
        ("  computing ", "dim"), duration(snapshot.compute_s), ("  waiting ", "dim"), duration(snapshot.waiting_s),
    )


def io_line(snapshot: ConsoleSnapshot) -> Text:
    share = ("none yet" if snapshot.probe_share is None or not snapshot.probe_s
             else f"{snapshot.probe_share:.0%} of wall ({duration(snapshot.probe_s)})")
    none = "none" if snapshot.activity == "stopped" else "none yet"  # (a finished run's may have been removed)
    age = none if snapshot.checkpoint_age_s is None else f"{duration(snapshot.checkpoint_age_s)} ago"
    again = (("  read again ", "dim"), f"{snapshot.read_again:,}") if snapshot.read_again else ()
    return Text.assemble(
        ("lag ", "dim"), _lag_text(snapshot), *again, ("  queue ", "dim"), str(snapshot.queue_depth),
        ("  dead letters ", "dim"), _dead_text(snapshot),
        ("  checkpoint ", "dim"), age, ("  probes ", "dim"), share,
    )


def render(snapshot: ViewSnapshot, class_rows: int | None = None) -> Panel:
    """Pure: the same snapshot always renders the same text (a tracker's ViewSnapshot renders without
    the operator's readings). `class_rows`: the most rows the CALM table gives classes (see shown_classes)."""
    snapshot = as_console(snapshot)
    spark = Text.assemble(("recent loss ", "dim"), sparkline(snapshot.recent_losses, snapshot.recent_switches))
    body = Group(activity_line(snapshot), progress_row(snapshot), status_line(snapshot), spark,
                 rate_line(snapshot), io_line(snapshot), _ClassTable(snapshot, class_rows))
    oracle = " (oracle: told the class)" if snapshot.oracle else ""
    title = Text(f"streamer · run {snapshot.run} · strategy {snapshot.strategy}{oracle}")  # a name's [..]: no markup
    return Panel(body, title=title, expand=False)


def render_waiting() -> Text:
    """Before the first snapshot."""
    return Text("starting: waiting for the first reading of the loop", style="dim")


def plain_line(snapshot: ViewSnapshot) -> str:
    """One log line: activity, counts, losses, rates, lag, timings, checkpoint, dead letters, probes."""
    s = as_console(snapshot)
    o = s.overall
    total = f"/{s.total_batches}" if s.total_batches else ""
    records = "n/a" if s.records is None else str(s.records)
    age = "none" if s.checkpoint_age_s is None else duration(s.checkpoint_age_s)
    share = "none" if s.probe_share is None or not s.probe_s else f"{s.probe_share:.0%} of wall"
    lags = ",".join(f"{p}:{lag}" for p, lag in s.lag_by_partition.items())
    return (f"[{activity_text(s)}] batch {s.batches}{total} records {records} "
            f"| loss {_fmt(s.last_loss, 3)} rolling_ppl {_fmt(s.rolling_ppl)} class {s.current_class or 'n/a'} "
            f"ppl {_fmt(o['ppl'])} ppl@sw {_fmt(o['ppl@sw'])} rec {_fmt(o['rec'])} "
            f"| tok/s {s.tokens_per_s:.0f} (last {s.recent_window_s:.0f}s) {_rate(s.tokens_per_s_compute).replace(',', '')} "
            f"(last min of compute) compute {duration(s.compute_s)} waiting {duration(s.waiting_s)} "
            f"| lag {'n/a' if _lag_unknown(s) else s.lag}" + (f" ({lags})" if lags else "")
            + (f" read_again {s.read_again}" if s.read_again else "") + f" queue {s.queue_depth} "
            f"| checkpoint_age {age} dead_letters {sum(s.dead_letters.values())} probes {share}")


class LiveView:
    """Context manager; call `update(snapshot)` as often as you like.

    On a terminal, rich.live.Live redraws `render(latest snapshot)` a few times a second
    (`get_renderable`); `update` only swaps the snapshot (immutable), so the learner never
    waits for drawing. Elsewhere (a pipe, a log file) it prints `plain_line` at most every
    `plain_interval_s` seconds while the run consumes, every `idle_interval_s` while it does
    anything else (waits, joins, has lost the broker), at once when the activity changes or
    with `force=True`.
    """

    def __init__(self, console: Console | None = None, plain_interval_s: float = 5.0, enabled: bool = True,
                 idle_interval_s: float = 30.0):
        self.console = console or Console()
        self.enabled = enabled
        self.plain_interval_s, self.idle_interval_s = plain_interval_s, idle_interval_s
        self._live: Live | None = None
        self._snapshot: ViewSnapshot | None = None
        self._last_plain: float | None = None
        self._last_activity: str | None = None

    @property
    def interactive(self) -> bool:
        """Live redraws: on a terminal that is not dumb (rich's Live draws nothing on TERM=dumb, and the run
        showed nothing till its end) nor told not to animate (TTY_INTERACTIVE=0)."""
        return self.enabled and self.console.is_interactive

    def renderable(self):
        """What Live draws now: the latest snapshot, rendered to fit the terminal's height (Live cut what did not
        fit: with 22 classes the table lost its last rows, the row "all" and the current class among them, for
        the whole run)."""
        snapshot = self._snapshot
        if snapshot is None:
            return render_waiting()
        panel = render(snapshot)
        over = len(self.console.render_lines(panel, pad=False)) - self.console.height
        if over > 0:
            panel = render(snapshot, class_rows=len(snapshot.per_class) - over)
        return panel

    def __enter__(self) -> "LiveView":
        if self.interactive:
            self._live = Live(console=self.console, refresh_per_second=4, transient=False,
                              get_renderable=self.renderable)
            self._live.__enter__()
        return self

    def update(self, snapshot: ViewSnapshot, force: bool = False) -> None:
        if not self.enabled:
            return
        self._snapshot = snapshot
        if self._live is not None:
            if force:
                self._live.refresh()
            return
        now = time.monotonic()
        activity = as_console(snapshot).activity
        interval = self.plain_interval_s if activity == "consuming" else self.idle_interval_s
        if (force or self._last_plain is None or activity != self._last_activity
                or now - self._last_plain >= interval):
            self._last_plain, self._last_activity = now, activity
            self.console.print(plain_line(snapshot), highlight=False, soft_wrap=True, markup=False)

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
