"""The terminal view: a pure function from a snapshot to a rich renderable.

`LiveView` has rich.live.Live redraw it (``get_renderable``) on a terminal and falls back
to one plain log line every few seconds when stdout is not a terminal.
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from monitor.compare import ORACLE_STRATEGIES
from monitor.tracker import ViewSnapshot

__all__ = ["render", "render_waiting", "sparkline", "plain_line", "progress_row", "status_line", "io_line", "LiveView"]

_BARS = "▁▂▃▄▅▆▇█"


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if value == float("inf"):
        return "inf"
    return f"{value:.{digits}f}"


def sparkline(values, switches=()) -> Text:
    """Loss bars scaled to the window's range; switch positions in bold red."""
    text = Text()
    if not values:
        return text
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    switches = tuple(switches) + (False,) * (len(values) - len(switches))
    for value, switched in zip(values, switches):
        bar = _BARS[min(len(_BARS) - 1, int((value - low) / span * len(_BARS)))]
        text.append("┃" if switched else bar, style="bold red" if switched else "cyan")
    return text


def _class_table(snapshot: ViewSnapshot) -> Table:
    table = Table(title=f"CALM metrics (fragments >= {snapshot.from_fragment})", expand=False)
    for column in ("class", "batches", "ppl", "ppl@sw", "rec"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for name, values in sorted(snapshot.per_class.items()):
        marker = " ◀" if name == snapshot.current_class else ""
        table.add_row(name + marker, str(values["n_batches"]), _fmt(values["ppl"]),
                      _fmt(values["ppl@sw"]), _fmt(values["rec"]))
    o = snapshot.overall
    table.add_row("all", "", _fmt(o["ppl"]), _fmt(o["ppl@sw"]), _fmt(o["rec"]), style="bold")
    return table


def progress_row(snapshot: ViewSnapshot) -> Table:
    total = snapshot.total_batches
    progress = Table.grid(padding=(0, 1))
    label = f"{snapshot.batches}/{total} batches" if total else f"{snapshot.batches} batches"
    progress.add_row(ProgressBar(total=total or None, completed=snapshot.batches, width=40), Text(label))
    return progress


def status_line(snapshot: ViewSnapshot) -> Text:
    return Text.assemble(
        ("loss ", "dim"), _fmt(snapshot.last_loss, 3), ("  ppl ", "dim"),
        _fmt(None if snapshot.last_loss is None else 2.718281828459045 ** snapshot.last_loss),
        ("  rolling ppl ", "dim"), _fmt(snapshot.rolling_ppl),
        ("  class ", "dim"), snapshot.current_class or "n/a",
        ("  switches ", "dim"), f"{snapshot.switches} true / {snapshot.detected_switches} detected",
    )


def io_line(snapshot: ViewSnapshot) -> Text:
    return Text.assemble(
        ("tokens/s ", "dim"), f"{snapshot.tokens_per_s:,.0f}", ("  lag ", "dim"), str(snapshot.lag),
        ("  queue ", "dim"), str(snapshot.queue_depth),
        ("  dead letters ", "dim"), str(sum(snapshot.dead_letters.values())),
        ("  elapsed ", "dim"), f"{snapshot.elapsed_s:.0f}s",
    )


def render(snapshot: ViewSnapshot) -> Panel:
    """Pure: the same snapshot always renders the same text."""
    spark = Text.assemble(("recent loss ", "dim"), sparkline(snapshot.recent_losses, snapshot.recent_switches))
    body = Group(progress_row(snapshot), status_line(snapshot), spark, io_line(snapshot), _class_table(snapshot))
    oracle = " (oracle: told the class)" if snapshot.strategy in ORACLE_STRATEGIES else ""
    return Panel(body, title=f"streamer · run {snapshot.run} · strategy {snapshot.strategy}{oracle}", expand=False)


def render_waiting() -> Text:
    """Before the first snapshot."""
    return Text("waiting for the first batch", style="dim")


def plain_line(snapshot: ViewSnapshot) -> str:
    o = snapshot.overall
    total = f"/{snapshot.total_batches}" if snapshot.total_batches else ""
    return (f"batch {snapshot.batches}{total} loss {_fmt(snapshot.last_loss, 3)} "
            f"rolling_ppl {_fmt(snapshot.rolling_ppl)} class {snapshot.current_class or 'n/a'} "
            f"ppl {_fmt(o['ppl'])} ppl@sw {_fmt(o['ppl@sw'])} rec {_fmt(o['rec'])} "
            f"tok/s {snapshot.tokens_per_s:.0f} lag {snapshot.lag}")


class LiveView:
    """Context manager; call `update(snapshot)` as often as you like.

    On a terminal, rich.live.Live redraws `render(latest snapshot)` a few times a second
    (`get_renderable`); `update` only swaps the snapshot (immutable), so the learner never
    waits for drawing. Elsewhere (a pipe, a log file) it prints `plain_line` at most every
    `plain_interval_s` seconds, or at once with `force=True`.
    """

    def __init__(self, console: Console | None = None, plain_interval_s: float = 5.0, enabled: bool = True):
        self.console = console or Console()
        self.enabled = enabled
        self.plain_interval_s = plain_interval_s
        self._live: Live | None = None
        self._snapshot: ViewSnapshot | None = None
        self._last_plain: float | None = None

    @property
    def interactive(self) -> bool:
        return self.enabled and self.console.is_terminal

    def renderable(self):
        """What Live draws now: the latest snapshot, rendered."""
        snapshot = self._snapshot
        return render_waiting() if snapshot is None else render(snapshot)

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
        if force or self._last_plain is None or now - self._last_plain >= self.plain_interval_s:
            self._last_plain = now
            self.console.print(plain_line(snapshot), highlight=False, soft_wrap=True)

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
