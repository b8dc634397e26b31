"""The terminal view is a pure function of a snapshot: render to an in-memory console and read it.
The operator's readings (activity, rates, compute and waiting time) come from monitor.console's clock,
driven here with explicit times."""

import math
import time
from dataclasses import replace

from rich.console import Console

from monitor.console import ActivityClock, ConsoleSnapshot, LoopReading, as_console, read_status, write_status
from monitor.tracker import ViewSnapshot
from monitor.view import (LiveView, activity_text, duration, learning_on_line, plain_line, render, sparkline,
                          waiting_for_line)

VIEW = ViewSnapshot(
    run="r1", strategy="naive", batches=50, total_batches=200, last_loss=1.0, rolling_ppl=3.5,
    recent_losses=(1.0, 2.0, 3.0, 2.0), recent_switches=(False, False, True, False), current_class="fr",
    overall={"ppl": 4.0, "ppl@sw": 9.5, "rec": 2.25},
    per_class={"en": {"ppl": 3.0, "ppl@sw": None, "rec": None, "n_batches": 20},
               "fr": {"ppl": 5.0, "ppl@sw": 9.5, "rec": 2.25, "n_batches": 30}},
    from_fragment=0, switches=4, detected_switches=2, tokens_per_s=1234.0, lag=7, queue_depth=2, dead_letters={"bad_utf8": 3},
    elapsed_s=12.0,
)
AT = time.mktime((2026, 11, 23, 15, 32, 10, 0, 0, -1))  # 15:32:10 local time
SNAPSHOT = ConsoleSnapshot(
    **vars(VIEW) | {"elapsed_s": 250.0}, activity="waiting", activity_since=AT, records=1500,
    lag_by_partition={"0": 3, "1": 4}, tokens_per_s_compute=1661.0, compute_s=190.0, waiting_s=56.0,
    checkpoint_age_s=12.0, probe_s=20.0, probe_share=0.08, at=AT + 60)


def _text(renderable) -> str:
    console = Console(width=140, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_render_shows_progress_perplexities_table_and_io():
    text = _text(render(VIEW))
    assert "50/200 batches" in text
    assert "rolling ppl 3.50" in text and "ppl 2.72" in text  # exp(1.0)
    assert "class fr" in text and "switches 4 true / 2 detected" in text
    assert "tokens/s 1,234" in text and "lag 7" in text and "dead letters 3 (bad_utf8 3)" in text
    rows = {line.split("│")[2].strip(): line for line in text.splitlines() if line.count("│") >= 6}
    assert "n/a" in rows["en"] and "3.00" in rows["en"]
    assert "9.50" in rows["fr ◀"] and "2.25" in rows["fr ◀"]
    assert "4.00" in rows["all"]


def test_render_shows_what_an_operator_watches():
    text = _text(render(SNAPSHOT))
    assert "caught up, waiting for records since 15:32:10" in text
    assert "records 1,500" in text and "batches 50" in text
    assert "lag 7 (p0 3 · p1 4)" in text and "queue 2" in text
    assert "tokens/s 1,234 (last 5s)" in text and "1,661 (last minute of compute)" in text
    assert "computing 3m10s" in text and "waiting 56s" in text
    assert "checkpoint 12s ago" in text and "probes 8% of wall (20s)" in text


def test_render_is_pure():
    assert _text(render(SNAPSHOT)) == _text(render(SNAPSHOT))
    assert _text(render(VIEW)) == _text(render(as_console(VIEW)))


def test_each_activity_is_said_with_its_time():
    assert activity_text(replace(SNAPSHOT, activity="consuming")) == "consuming"
    assert activity_text(replace(SNAPSHOT, activity="broker_lost")) == "broker lost since 15:32:10"
    assert activity_text(replace(SNAPSHOT, activity="joining")) == "joining the consumer group since 15:32:10"
    assert activity_text(replace(SNAPSHOT, activity="checkpointing")) == "checkpointing"
    assert activity_text(replace(SNAPSHOT, activity="topic_missing")) == "waiting for the topic to be created since 15:32:10"
    assert activity_text(replace(SNAPSHOT, activity="stopping", stop_reason="signal")).startswith("stopping (signal)")
    assert activity_text(replace(SNAPSHOT, activity="stopped", stop_reason="idle")) == "stopped: idle"
    assert activity_text(replace(SNAPSHOT, waiting_for=(3,))) == \
        "waiting for stream 3 since 15:32:10 (a batch takes a window of every stream)"
    assert activity_text(replace(SNAPSHOT, waiting_for=tuple(range(10)))).startswith(
        "waiting for streams 0, 1, 2, 3, 4, 5, 6, 7 (+2 more) since 15:32:10")
    assert [duration(s) for s in (None, 4.4, 184, 7500)] == ["n/a", "4s", "3m04s", "2h05m"]


def test_sparkline_marks_switches_and_scales_to_the_window():
    line = sparkline([1.0, 2.0, 3.0, 2.0], [False, False, True, False])
    assert line.plain == "▁▅┃▅"
    assert sparkline([]).plain == ""
    assert sparkline([1.0, math.inf, 3.0, math.nan]).plain == "▁×█×"  # a diverged batch (it raised ValueError)
    assert sparkline([math.nan]).plain == "×"


def test_the_plain_line_says_everything_in_one_line():
    line = plain_line(SNAPSHOT)
    assert line.startswith("[caught up, waiting for records since 15:32:10] batch 50/200 records 1500 "
                           "| loss 1.000 rolling_ppl 3.50 class fr ppl 4.00 ppl@sw 9.50 rec 2.25 ")
    assert "tok/s 1234 (last 5s) 1661 (last min of compute) compute 3m10s waiting 56s" in line
    assert "lag 7 (0:3,1:4) queue 2" in line and "checkpoint_age 12s dead_letters 3 probes 8% of wall" in line
    assert "\n" not in line


def test_plain_mode_prints_lines_every_interval_and_at_once_when_the_activity_changes(tmp_path):
    out = tmp_path / "out.txt"
    consuming = replace(SNAPSHOT, activity="consuming")
    with out.open("w") as handle:
        console = Console(file=handle, force_terminal=False, width=200)
        with LiveView(console=console, plain_interval_s=3600, idle_interval_s=3600) as view:
            assert not view.interactive
            view.update(consuming)
            view.update(consuming)  # throttled
            view.update(SNAPSHOT)  # the run now waits: said at once
            view.update(SNAPSHOT)  # throttled
            view.update(SNAPSHOT, force=True)
    assert out.read_text().splitlines() == [plain_line(consuming), plain_line(SNAPSHOT), plain_line(SNAPSHOT)]


def test_on_a_terminal_live_redraws_the_latest_snapshot(tmp_path):
    import io

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None, _environ={"TERM": "xterm"})
    view = LiveView(console=console)
    assert view.interactive
    assert "waiting for the first reading" in _text(view.renderable())
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


def test_the_status_file_round_trips_the_snapshot(tmp_path):
    write_status(tmp_path / "status.json", SNAPSHOT)
    assert read_status(tmp_path / "status.json") == SNAPSHOT
    assert read_status(tmp_path / "missing.json") is None
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # the staging file was renamed


# --- the clock: activity, compute and waiting time, rates that fall to zero when idle -----------


def _reading(**kw):
    return LoopReading(**{"lag": {0: 0}, "records": 100, **kw})


def test_the_recent_rate_falls_to_zero_when_idle_and_the_compute_rate_keeps_the_models_speed():
    clock = ActivityClock(recent_window_s=5.0, compute_window_s=60.0, idle_after_s=2.0)
    clock.read(LoopReading(records=0), now=0.0)
    assert clock.activity == "joining"
    clock.read(LoopReading(records=0), now=4.0)  # still no partition: the JoinGroup wait
    for i in range(10):  # 10 batches of 100 tokens, one a second
        clock.learned(100, now=5.0 + i)
        clock.read(_reading(lag={0: 50}), now=5.0 + i + 0.5)
    assert clock.activity == "consuming"
    assert clock.recent_rate(now=14.5) == 500 / 5.0
    assert round(clock.compute_rate(now=14.5), 6) == round(1000 / 9.5, 6)  # 9.5 s of compute so far
    clock.read(_reading(), now=20.0)  # caught up, no batch for 6 s: waiting since the last batch
    assert clock.activity == "waiting"
    clock.read(_reading(), now=100.0)
    assert clock.recent_rate(now=100.0) == 0.0  # the last 5 s: nothing learned
    assert round(clock.compute_rate(now=100.0), 6) == round(1000 / 9.0, 6)  # waiting excluded
    split = clock.split(now=100.0)
    assert (split.joining_s, split.compute_s, split.idle_s) == (5.0, 9.0, 86.0)


def test_the_loops_own_waiting_and_broker_lost_times_win():
    clock = ActivityClock()
    clock.read(_reading(waiting_reported=True, waiting_since=AT), now=0.0)
    assert (clock.activity, clock.activity_since) == ("waiting", AT)
    clock.read(_reading(waiting_reported=True, broker_lost_since=AT + 5), now=1.0)
    assert (clock.activity, clock.activity_since) == ("broker_lost", AT + 5)
    clock.read(_reading(waiting_reported=True, checkpointing=True), now=2.0)
    assert clock.activity == "checkpointing"
    clock.read(_reading(waiting_reported=True, lag={0: 9}), now=3.0)
    assert clock.activity == "consuming"
    assert clock.split(now=3.0).broker_lost_s == 1.0 and clock.split(now=3.0).compute_s == 1.0
    # a topic deleted under the learner (the broker answers) was shown as "broker lost since"
    clock.read(_reading(waiting_reported=True, broker_lost_since=AT + 8, topic_gone=True), now=3.5)
    assert (clock.activity, clock.activity_since) == ("topic_gone", AT + 8)
    assert clock.split(now=4.0).broker_lost_s == 1.5
    assert activity_text(replace(SNAPSHOT, activity="topic_gone")) == (
        "topic deleted since 15:32:10 (waited for up to --broker-timeout)")
    clock.read(_reading(waiting_reported=True, stop_reason="signal"), now=4.0)
    assert clock.activity == "stopping"  # the last checkpoint, the commit, leaving the group
    clock.read(_reading(waiting_reported=True, stop_reason="signal", finished=True), now=5.0)
    assert clock.activity == "stopped"


def test_streams_waited_for_count_as_waiting_from_the_last_batch_and_are_shown_only_while_waiting():
    clock = ActivityClock()
    clock.read(_reading(waiting_reported=True, lag={0: 9}), now=0.0)
    clock.learned(100, now=1.0)
    clock.read(_reading(waiting_reported=True, lag={0: 9}), now=6.0)  # others' records came: consuming, so far
    clock.read(_reading(waiting_reported=True, waiting_since=AT, waiting_for=(3,)), now=7.0)  # named after 5 s
    assert (clock.activity, clock.activity_since) == ("waiting", AT)
    split = clock.split(now=7.0)
    assert (split.compute_s, split.idle_s) == (1.0, 6.0)  # the quiet time since the last batch was waiting
    snapshot = clock.snapshot(VIEW, now=7.0, wall=AT + 6)
    assert snapshot.waiting_for == (3,) and activity_text(snapshot).startswith("waiting for stream 3 since")
    clock.read(_reading(waiting_reported=True, waiting_for=(3,), checkpointing=True), now=8.0)
    assert clock.snapshot(VIEW, now=8.0, wall=AT + 7).waiting_for == ()  # said only with the waiting
    clock.read(_reading(waiting_reported=True, lag={0: 9}), now=10.0)  # records again, no batch: consuming
    clock.read(_reading(waiting_reported=True, waiting_since=AT + 9, waiting_for=(3,)), now=11.0)  # named again
    split = clock.split(now=11.0)  # the 2 s checkpointing stay compute; of the time since, the last second moves
    assert (split.compute_s, split.idle_s) == (3.0, 8.0)  # (moving all since the last batch: 0.0 and 11.0)


def test_a_wait_the_loop_says_late_counts_from_its_start_and_one_said_at_once_moves_nothing():
    """Records that make no batch (a slow stream's, before any other is far ahead): the loop says it waits
    once no batch was cut for a while, since the last batch; that time was waiting, not compute. A wait
    said as it begins (caught up: a fetch with nothing) leaves the time before it as compute."""
    clock = ActivityClock()
    clock.read(_reading(waiting_reported=True, lag={0: 9}), now=0.0)
    clock.learned(100, now=1.0)
    clock.read(_reading(waiting_reported=True), now=3.0)  # records come, no batch: consuming, so far
    clock.read(_reading(waiting_reported=True, waiting_since=time.time() - 6), now=7.0)
    assert clock.activity == "waiting"
    assert (clock.split(now=7.0).compute_s, clock.split(now=7.0).idle_s) == (1.0, 6.0)
    clock.learned(100, now=8.0)
    clock.read(_reading(waiting_reported=True, lag={0: 9}), now=9.0)
    clock.read(_reading(waiting_reported=True, waiting_since=time.time()), now=10.0)  # caught up, said at once
    split = clock.split(now=10.0)
    assert clock.activity == "waiting" and round(split.compute_s, 2) == 3.0 and round(split.idle_s, 2) == 7.0


def test_compute_is_the_workers_time_in_steps_where_the_loop_says_it():
    """A live topic's records come a few a second: the run consumes between batches while the worker
    waits for them. Compute is the worker's seconds in steps (LoopReading.busy_s), the rest of the
    consuming time idle, so the compute rate is the model's speed (it was counted as compute: a paced
    stream's rate fell to a fiftieth of it). A step run while the run said waiting moves to compute."""
    clock = ActivityClock()
    clock.read(_reading(waiting_reported=True, lag={0: 5}, busy_s=0.0), now=0.0)
    for i in range(10):  # a batch a second, 0.1 s of work each; records keep coming (no wait is said)
        clock.learned(100, now=i + 0.5)
        clock.read(_reading(waiting_reported=True, lag={0: 0}, busy_s=0.1 * (i + 1)), now=i + 1.0)
    split = clock.split(now=10.0)
    assert clock.activity == "consuming" and (round(split.compute_s, 6), round(split.idle_s, 6)) == (1.0, 9.0)
    assert round(clock.compute_rate(now=10.0), 6) == 1000.0  # 1,000 tokens in 1 s of compute
    clock.read(_reading(waiting_reported=True, waiting_since=time.time(), busy_s=1.0), now=11.0)
    assert clock.activity == "waiting"
    clock.learned(100, now=15.0)  # its step (0.3 s) ran while the run said waiting
    clock.read(_reading(waiting_reported=True, lag={0: 0}, busy_s=1.3), now=15.1)
    split = clock.split(now=15.1)
    assert round(split.compute_s, 6) == 1.3 and round(split.compute_s + split.idle_s, 6) == 15.1


def test_a_missing_topic_is_waited_for_and_counts_as_waiting_for_it():
    clock = ActivityClock()
    clock.read(LoopReading(topic_missing_since=AT), now=0.0)
    assert (clock.activity, clock.activity_since) == ("topic_missing", AT)
    clock.read(LoopReading(), now=7.0)  # created: the group is joined next
    assert clock.activity == "joining"
    split = clock.split(now=9.0)
    assert (split.topic_missing_s, split.joining_s, split.waiting_s) == (7.0, 2.0, 9.0)


def test_a_lag_not_measured_yet_is_not_shown_as_zero():
    unmeasured = replace(SNAPSHOT, lag_by_partition={}, lag=0)
    assert "| lag n/a queue 2 " in plain_line(unmeasured)
    assert "lag n/a  queue 2" in _text(render(unmeasured))
    assert "lag 7 (p0 3 · p1 4)" in _text(render(SNAPSHOT))


def test_records_read_again_are_shown_beside_the_lag_once_there_are_any():
    again = replace(SNAPSHOT, read_again=12345)
    assert "lag 7 (0:3,1:4) read_again 12345 queue 2" in plain_line(again)
    assert "lag 7 (p0 3 · p1 4)  read again 12,345  queue 2" in _text(render(again))
    assert "read" not in plain_line(SNAPSHOT).split("| lag")[1] and "read again" not in _text(render(SNAPSHOT))


def test_the_log_says_when_the_learning_waits_for_streams_and_when_it_learns_on():
    assert waiting_for_line((3,), 256, 60.2) == (
        "the next batch waits for stream 3: no batch for 1m00s while another stream holds more than 256 windows "
        "(a batch takes a window of every stream; the others' records are kept, not learned, until then)")
    assert waiting_for_line((3, 7), 4, 9).startswith(
        "the next batch waits for streams 3, 7: no batch for 9s while another stream holds more than 4 windows")
    assert learning_on_line((3, 7), 184) == "streams 3, 7: records came, learning on after 3m04s of waiting"


def test_names_with_rich_markup_are_shown_as_written():
    """Class and run names are the user's: a class `[/bold]es` raised rich's MarkupError at the end of a run,
    `[red]en` showed as a red "en", and a run dir `exp[v2]` was titled "run exp"."""
    per_class = {"[/bold]es": VIEW.per_class["en"], "[red]en": VIEW.per_class["fr"]}
    snapshot = replace(SNAPSHOT, run="exp[v2]", per_class=per_class, current_class="[red]en")
    text = _text(render(snapshot))
    assert "run exp[v2] · strategy naive" in text
    assert "[/bold]es" in text and "[red]en ◀" in text and "class [red]en" in text


def test_a_huge_finite_loss_shows_an_infinite_perplexity():
    """`learn --lr 10000` logs losses of 3e4..6e5 nats: e ** loss raised OverflowError in the live view (and in
    `streamer status` on a terminal); a loss of 500 showed a perplexity of 218 digits."""
    text = _text(render(replace(SNAPSHOT, last_loss=6e5, rolling_ppl=math.inf)))
    assert "loss 600000.000  ppl inf  rolling ppl inf" in text
    assert "loss 500.000  ppl 1.4e+217" in _text(render(replace(SNAPSHOT, last_loss=500.0)))


def test_a_dumb_terminal_gets_the_plain_lines():
    """rich's Live draws nothing on TERM=dumb: the view was live there, and the run showed nothing till its end."""
    import io

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=400, color_system=None, _environ={"TERM": "dumb"})
    with LiveView(console=console) as view:
        assert not view.interactive
        view.update(SNAPSHOT)
    assert out.getvalue() == plain_line(SNAPSHOT) + "\n"


def _text_at(renderable, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_narrow_terminal_shortens_class_names_never_numbers():
    """At 40 columns rich cut the metric values (`33.…`); the class names are shortened now, the marker kept."""
    values = {"ppl": 33.17, "ppl@sw": 9.5, "rec": 2.25, "n_batches": 120}
    five = replace(SNAPSHOT, per_class={name: values for name in ("en", "fr", "de", "es", "cs")})
    long = replace(SNAPSHOT, per_class={"a_rather_long_class_name": values, "fr": values})
    for snapshot in (five, long):
        rows = [line for line in _text_at(render(snapshot), 40).splitlines() if "33.17" in line]
        assert len(rows) == len(snapshot.per_class)
        assert all([cell.strip() for cell in row.split("│")[-5:-1]] == ["120", "33.17", "9.50", "2.25"]
                   for row in rows), rows
    assert "fr ◀ │" in _text_at(render(five), 40)
    narrow = _text_at(render(long), 40)
    assert "a_rather_long_class_name" not in narrow and "│ a_rathe… │" in narrow
    assert "│ a_rather_long_class_name │" in _text_at(render(long), 140)  # whole where it fits


def test_many_classes_keep_the_row_all_and_the_current_class_on_a_short_terminal():
    """Live cuts what does not fit the terminal: with 22 classes the table lost its last rows ("..." after
    class08), the row "all" and the current class's marker among them, for the whole run."""
    import io

    values = {"ppl": 3.0, "ppl@sw": None, "rec": None, "n_batches": 5}
    many = replace(SNAPSHOT, per_class={f"class{i:02d}": values for i in range(22)}, current_class="class17")
    console = Console(file=io.StringIO(), force_terminal=True, width=140, height=30, color_system=None,
                      _environ={"TERM": "xterm"})
    view = LiveView(console=console)
    view.update(many)
    lines = _text(view.renderable()).splitlines()
    assert len(lines) == 30  # all the room there is
    shown = [line.split("│")[2].strip() for line in lines if line.count("│") >= 6]
    assert shown[-3:] == ["class17 ◀", f"+{22 - len(shown) + 2} more", "all"] and shown[0] == "class00", shown
    assert len(_text(render(many)).splitlines()) > 30  # all of them where there is room (streamer status)
    from monitor.view import shown_classes

    assert shown_classes(["a", "b", "c", "d"], "d", 3) == (["a", "d"], 2)
    assert shown_classes(["a", "b", "c", "d"], None, 3) == (["a", "b"], 2)
    assert shown_classes(["a", "b", "c", "d"], "a", 4) == (["a", "b", "c", "d"], 0)


def test_the_status_file_of_a_diverged_run_is_strict_json_and_reads_back(tmp_path):
    """status.json had bare Infinity and NaN (not JSON to other readers): they are "inf" and "nan" now, read back as
    floats, except in a name (a class called "inf")."""
    import json

    import pytest

    diverged = replace(SNAPSHOT, last_loss=math.nan, rolling_ppl=math.inf, current_class="inf",
                       overall={"ppl": math.inf, "ppl@sw": None, "rec": None}, recent_losses=(1.0, math.inf),
                       per_class={"inf": {"ppl": math.inf, "ppl@sw": None, "rec": None, "n_batches": 3}})
    write_status(tmp_path / "status.json", diverged)
    data = json.loads((tmp_path / "status.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert data["rolling_ppl"] == "inf" and data["overall"]["ppl"] == "inf" and data["last_loss"] == "nan"
    again = read_status(tmp_path / "status.json")
    assert again.current_class == "inf" and again.rolling_ppl == math.inf and math.isnan(again.last_loss)
    assert again.recent_losses == (1.0, math.inf) and again.per_class["inf"]["ppl"] == math.inf
    assert "rolling ppl inf" in _text(render(again))
