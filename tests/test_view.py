"""The terminal view is a pure function of a snapshot: render to an in-memory console and read it."""

from rich.console import Console

from monitor.tracker import ViewSnapshot
from monitor.view import LiveView, plain_line, render, sparkline

SNAPSHOT = ViewSnapshot(
    run="r1", strategy="naive", batches=50, total_batches=200, last_loss=1.0, rolling_ppl=3.5,
    recent_losses=(1.0, 2.0, 3.0, 2.0), recent_switches=(False, False, True, False), current_class="fr",
    overall={"ppl": 4.0, "ppl@sw": 9.5, "rec": 2.25},
    per_class={"en": {"ppl": 3.0, "ppl@sw": None, "rec": None, "n_batches": 20},
               "fr": {"ppl": 5.0, "ppl@sw": 9.5, "rec": 2.25, "n_batches": 30}},
    from_fragment=0, switches=4, detected_switches=2, tokens_per_s=1234.0, lag=7, queue_depth=2, dead_letters={"bad_utf8": 3},
    elapsed_s=12.0,
)


def _text(renderable) -> str:
    console = Console(width=100, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_render_shows_progress_perplexities_table_and_io():
    text = _text(render(SNAPSHOT))
    assert "50/200 batches" in text
    assert "rolling ppl 3.50" in text and "ppl 2.72" in text  # exp(1.0)
    assert "class fr" in text and "switches 4 true / 2 detected" in text
    assert "tokens/s 1,234" in text and "lag 7" in text and "dead letters 3" in text
    rows = {line.split("│")[2].strip(): line for line in text.splitlines() if line.count("│") >= 6}
    assert "n/a" in rows["en"] and "3.00" in rows["en"]
    assert "9.50" in rows["fr ◀"] and "2.25" in rows["fr ◀"]
    assert "4.00" in rows["all"]


def test_render_is_pure():
    assert _text(render(SNAPSHOT)) == _text(render(SNAPSHOT))


def test_sparkline_marks_switches_and_scales_to_the_window():
    line = sparkline([1.0, 2.0, 3.0, 2.0], [False, False, True, False])
    assert line.plain == "▁▅┃▅"
    assert sparkline([]).plain == ""


def test_plain_mode_prints_log_lines_when_not_a_terminal(tmp_path):
    out = tmp_path / "out.txt"
    with out.open("w") as handle:
        console = Console(file=handle, force_terminal=False, width=200)
        with LiveView(console=console, plain_interval_s=3600) as view:
            assert not view.interactive
            view.update(SNAPSHOT)
            view.update(SNAPSHOT)  # throttled
            view.update(SNAPSHOT, force=True)
    lines = out.read_text().splitlines()
    assert lines == [plain_line(SNAPSHOT)] * 2
    assert lines[0].startswith("batch 50/200 loss 1.000 rolling_ppl 3.50 class fr ppl 4.00 ppl@sw 9.50 rec 2.25")


def test_on_a_terminal_live_redraws_the_latest_snapshot(tmp_path):
    import io

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    view = LiveView(console=console)
    assert view.interactive
    assert "waiting for the first batch" in _text(view.renderable())
    with view:
        view.update(SNAPSHOT, force=True)
        assert _text(view.renderable()) == _text(render(SNAPSHOT))
    assert "50/200 batches" in out.getvalue()


def test_a_disabled_view_prints_nothing(tmp_path):
    out = tmp_path / "out.txt"
    with out.open("w") as handle:
        with LiveView(console=Console(file=handle, force_terminal=False), enabled=False) as view:
            view.update(SNAPSHOT, force=True)
    assert out.read_text() == ""
