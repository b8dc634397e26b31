"""The loss log and the end-of-run report (results.json and loss_curve.png)."""

import json
import math
import tracemalloc

import numpy as np
import pytest

from monitor.losslog import LossLogWriter, read_loss_log
from monitor.report import build_report, load_run, resolve_from_fragment, write_report

NAMES = {0: "A", 1: "B"}
# the hand-worked stream of test_calm_metrics: fragments 0..5
FRAGMENTS = [(0, [4, 2]), (1, [6, 6, 3]), (0, [5, 3, 2, 1]), (1, [5, 4, 3]), (0, [2, 4]), (1, [7, 1])]


def project_records():
    """The project's format: the four CALM keys plus extra ones."""
    records = []
    for sequence, (domain, losses) in enumerate(FRAGMENTS):
        for loss in losses:
            records.append({"loss": float(loss), "domain": domain, "domain_name": NAMES[domain],
                            "sequence": sequence, "step": len(records), "learn_s": 0.01})
    return records


def make_run(tmp_path, config=None):
    run = tmp_path / "run"
    with LossLogWriter(run / "losses.jsonl") as log:
        for record in project_records():
            log.write(record)
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    return run


def test_loss_log_round_trip(tmp_path):
    path = tmp_path / "losses.jsonl"
    with LossLogWriter(path) as log:
        log.write({"loss": np.float32(2.5), "domain": 1, "domain_name": "de", "sequence": 0, "step": 0})
        # flushed per line: a reader sees the line before the writer is closed
        assert read_loss_log(path) == [{"loss": 2.5, "domain": 1, "domain_name": "de", "sequence": 0, "step": 0}]
        log.write({"loss": 1.25, "domain": 0, "domain_name": "en", "sequence": 1})
    assert [r["loss"] for r in read_loss_log(path)] == [2.5, 1.25]
    with LossLogWriter(path, append=True) as log:
        log.write({"loss": 3.0, "domain": 0, "domain_name": "en", "sequence": 1})
    assert len(read_loss_log(path)) == 3
    with pytest.raises(ValueError, match="sequence"):
        with LossLogWriter(path) as log:
            log.write({"loss": 1.0, "domain": 0, "domain_name": "en"})


def test_reads_calm_library_format(tmp_path):
    # what the CALM library's log_loss writes: json.dumps of exactly four keys, one per line
    path = tmp_path / "calm.log"
    path.write_text(
        '{"loss": 4.2, "domain": 3, "domain_name": "fr", "sequence": 0}\n'
        "\n"
        '{"loss": 3, "domain": 1, "domain_name": "cs", "sequence": 1}\n'
    )
    records = read_loss_log(path)
    assert records == [
        {"loss": 4.2, "domain": 3, "domain_name": "fr", "sequence": 0},
        {"loss": 3, "domain": 1, "domain_name": "cs", "sequence": 1},
    ]
    assert load_run(path) == (records, {})


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"loss": 1.0, "domain": 0, "sequence": 0}', "domain_name"),
        ('{"loss": "high", "domain": 0, "domain_name": "en", "sequence": 0}', "loss"),
        ("{not json", "JSON"),
    ],
)
def test_bad_line_names_its_line_number(tmp_path, bad_line, reason):
    path = tmp_path / "losses.jsonl"
    path.write_text('{"loss": 1.0, "domain": 0, "domain_name": "en", "sequence": 0}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=rf"losses\.jsonl:3: .*{reason}"):
        read_loss_log(path)


def test_resolve_from_fragment():
    records = [{"sequence": s} for s in (0, 1, 2, 3, 4, 5, 6)]
    assert resolve_from_fragment("half", records, {"n_fragments": 100}) == 50
    assert resolve_from_fragment("half", records, {}) == 3  # N = 6 + 1 = 7, 7 // 2
    assert resolve_from_fragment("all", records, {}) == 0
    assert resolve_from_fragment(4, records, {}) == 4
    assert resolve_from_fragment("4", records, {}) == 4
    with pytest.raises(ValueError):
        resolve_from_fragment("most", records, {})


def test_build_report_uses_half_of_configured_fragments(tmp_path):
    run = make_run(tmp_path, {"n_fragments": 4, "strategy": "naive", "model": "lstm"})
    report = build_report(run, k=2)
    assert report["run"] == str(run)
    assert report["config"]["strategy"] == "naive"
    # N = 4 -> span fragments >= 2: A [5,3,2,1], B [5,4,3], A [2,4] (revisit: prev mean 2.75,
    # first two (2+4)/2 = 3, 2 < 2.75 -> rec 0), B [7,1] last
    assert report["span"] == {"from_fragment": 2, "the_runs": False, "n_fragments_expected": 4,
                              "n_fragments_seen": 6, "complete": True}
    assert report["metrics"]["loss"] == pytest.approx(37 / 11)
    assert report["metrics"]["ppl@sw"] == pytest.approx(math.exp(3))
    assert report["metrics"]["rec"] == 0
    # whole stream: 58 / 16, revisits 4, 4.5, 3 (see test_calm_metrics)
    assert report["whole_stream"]["loss"] == pytest.approx(58 / 16)
    assert report["whole_stream"]["ppl@sw"] == pytest.approx(math.exp(11.5 / 3))


def test_build_report_says_when_the_stream_is_incomplete(tmp_path):
    run = make_run(tmp_path, {"n_fragments": 10})
    report = build_report(run, k=2)
    # N = 10 -> span fragments >= 5: only B [7, 1], the last fragment
    assert report["span"]["complete"] is False
    assert report["span"]["from_fragment"] == 5
    assert report["metrics"]["loss"] == pytest.approx(4.0)
    assert report["metrics"]["ppl@sw"] is None
    assert "6 of 10" in report["metrics"]["notes"][0]


def test_write_report_writes_strict_json_and_a_png(tmp_path):
    run = make_run(tmp_path, {"n_fragments": 6})
    # a diverged batch: ppl of the whole stream becomes inf
    with LossLogWriter(run / "losses.jsonl", append=True) as log:
        log.write({"loss": 500.0, "domain": 1, "domain_name": "B", "sequence": 5})
    report = write_report(run)
    text = (run / "results.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    loaded = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard {name}"))
    assert loaded["metrics"]["ppl"] == "inf" and report["metrics"]["ppl"] == math.inf
    assert loaded["span"]["from_fragment"] == 3
    assert loaded["metrics"]["ppl@sw"] is None  # span 3..5 has no revisit
    png = (run / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 5000


def test_write_report_of_a_log_file_goes_next_to_it_or_to_out_dir(tmp_path):
    run = make_run(tmp_path)
    log = run / "losses.jsonl"
    write_report(log, k=2)
    assert (run / "results.json").exists() and (run / "loss_curve.png").exists()
    out = tmp_path / "elsewhere"
    write_report(log, out, from_fragment="all")
    assert json.loads((out / "results.json").read_text())["span"]["from_fragment"] == 0


def test_a_run_that_logged_gate_weights_gets_the_gate_figure(tmp_path):
    run = tmp_path / "run"
    with LossLogWriter(run / "losses.jsonl") as log:
        for index, record in enumerate(project_records()):
            weight = index / 20  # expert 0 gains weight over time
            log.write({**record, "gates": [weight, 1 - weight]})
    write_report(run)
    png = (run / "gate_weights.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    plain = make_run(tmp_path / "plain")
    write_report(plain)
    assert not (plain / "gate_weights.png").exists()


def write_long_log(run, lines, files=3):
    """A live run's loss log of `lines` batches (fragments of 50, three classes, a spike now and then),
    split over rotated files as LossLogWriter leaves them: losses.1.jsonl, ..., losses.jsonl."""
    run.mkdir(parents=True)
    names = [run / f"losses.{number}.jsonl" for number in range(1, files)] + [run / "losses.jsonl"]
    per_file = -(-lines // files)
    for number, path in enumerate(names):
        with open(path, "w", encoding="utf-8") as log:
            for batch in range(number * per_file, min(lines, (number + 1) * per_file)):
                sequence, domain = batch // 50, (batch // 50) % 3
                loss = 1.5 + 0.3 * domain + math.exp(-(batch % 50) / 8) + (4.0 if batch % 997 == 0 else 0.0)
                log.write(f'{{"loss": {loss!r}, "domain": {domain}, "domain_name": "{NAMES.get(domain, "C")}", '
                          f'"sequence": {sequence}, "batch": {batch}, "tokens": 200, "train_loss": {loss!r}, '
                          f'"predict_s": 0.001, "learn_s": 0.002, "time": {1.7e9 + batch / 100!r}, '
                          f'"detected_switch": {"true" if batch % 50 == 3 else "false"}}}\n')


def report_peak_bytes(run) -> int:
    """The peak of Python's allocations (numpy's included) while the full report is written."""
    tracemalloc.start()
    try:
        write_report(run)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def steady_peaks(*runs) -> list[int]:
    """report_peak_bytes of each run, the least of two rounds taken in turn: a cache a report fills or another
    test of the worker emptied moves one report's peak by about 1.5 MB (a fresh clone's suite saw the short
    run's at 5.2 MB, the long one's at 6.7; alone, both are 6.7)."""
    rounds = [[report_peak_bytes(run) for run in runs] for _ in range(2)]
    return [min(peaks) for peaks in zip(*rounds)]


def test_the_report_of_a_long_rotated_log_stays_in_memory_independent_of_its_length(tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    write_long_log(short, 2_000)
    write_long_log(long, 20_000)
    write_report(short)  # imports (matplotlib, river) and their caches, outside the measurement
    peaks = steady_peaks(short, long)
    # measured: 2.0 MB at both lengths; holding the records (the report before) took 4.3 and 32.7 MB. The margin is
    # above the 1.5 MB a worker's caches move one report's peak by (steady_peaks)
    assert peaks[1] < peaks[0] + 3_000_000, f"peak {peaks[0] / 1e6:.1f} MB at 2k lines, {peaks[1] / 1e6:.1f} MB at 20k"
    assert peaks[1] < 10_000_000
    report = json.loads((long / "results.json").read_text())
    assert report["whole_stream"]["n_batches"] == 20_000 and report["span"]["n_fragments_seen"] == 400
    assert report["detection"]["evaluation"]["n_true"] == 399


def write_probe_log(run, rows):
    """probes.jsonl as a long run leaves it with --probe-every 0: a probe at every switch of write_long_log's
    stream (fragments of 50), each scoring the three classes."""
    names = [NAMES.get(domain, "C") for domain in range(3)]
    with open(run / "probes.jsonl", "w", encoding="utf-8") as log:
        for number in range(rows):
            batch = number * 50
            trigger = "start" if batch == 0 else "switch"
            ended = names[(number - 1) % 3] if trigger == "switch" else None
            scores = {name: 2.0 + (index + number % 7) / 10 for index, name in enumerate(names)}
            log.write(json.dumps({"batch": batch, "trigger": trigger, "ended_class": ended, "scores": scores,
                                  "seconds": 0.01, "time": 1.7e9 + number}) + "\n")


def test_the_report_holds_no_more_of_a_long_probe_log_than_of_a_short_one(tmp_path):
    """A run left for weeks probes at every switch: the report held every row of probes.jsonl (and DMI
    read it whole too). Measured: the peak grew by 6.4 MB from 1,000 to 10,000 rows; now it does not. 30,000 rows
    (about 20 MB more, held) against a margin of 3 MB: a fresh clone's suite saw the short run's peak 1.4 MB below
    the long one's at 10,000 rows, where the margin was 0.5 MB (a worker's caches, see steady_peaks)."""
    short, long = tmp_path / "short", tmp_path / "long"
    write_long_log(short, 2_000)
    write_long_log(long, 2_000)
    write_probe_log(short, 1_000)
    write_probe_log(long, 30_000)
    write_report(short), write_report(long)  # imports and caches (a second report's peak is 1.4 MB lower)
    peaks = steady_peaks(short, long)
    assert peaks[1] < peaks[0] + 3_000_000, f"peak {peaks[0] / 1e6:.1f} MB at 1k rows, {peaks[1] / 1e6:.1f} MB at 30k"
    forgetting = json.loads((long / "results.json").read_text())["forgetting"]
    assert forgetting["probe_evaluations"] == 30_000 and forgetting["probe_seconds"] == 300.0
    matrix = json.loads((long / "results.json").read_text())["probe_matrix"]
    assert matrix["stages"] == [50, 100, 150] and matrix["classes"] == ["A", "B", "C"]


def test_the_summary_line_of_a_resumed_run_counts_its_own_batches_and_tokens():
    """A resumed run's rate is its own tokens over its own compute time; its total stands beside."""
    from pathlib import Path

    from streamer.cli.report import summary_line
    from streamer.config import RunSummary

    fresh = RunSummary(100, 2000, 12.0, "end_of_stream", {}, Path("r"), compute_seconds=10.0)
    assert summary_line(fresh).startswith("100 batches, 2000 tokens in 12.0s: 10.0s computing (200 tokens/s)")
    resumed = RunSummary(40, 800, 6.0, "end_of_stream", {}, Path("r"), compute_seconds=4.0, batches_before=60)
    assert summary_line(resumed).startswith("40 batches (100 in all, resumed at 60), 800 tokens in 6.0s: "
                                            "4.0s computing (200 tokens/s)")


def test_a_stop_by_a_signal_leaves_a_long_logs_report_to_streamer_report(tmp_path, monkeypatch, capsys):
    """The report reads the whole loss log, up to 2 GB for a daemon: 43.5 s from SIGTERM to exit with 280 MB, past
    systemd's TimeoutStopSec (20 s), which killed the stop and marked the unit failed. A stop by a signal writes
    the report of a log up to SIGNAL_REPORT_BYTES; past it, one line says which command writes it. Any other stop
    (the stream's end, a limit) writes it whatever the log's size."""
    from streamer.cli import report
    from streamer.config import RunSummary

    run = make_run(tmp_path)
    size = (run / "losses.jsonl").stat().st_size
    assert report.print_run_report(RunSummary(21, 210, 1.0, "signal", {}, run)) is not None  # a short log
    assert (run / "results.json").is_file()
    (run / "results.json").unlink()
    monkeypatch.setattr(report, "SIGNAL_REPORT_BYTES", size - 1)  # this log, as a daemon's 2 GB
    capsys.readouterr()
    assert report.print_run_report(RunSummary(21, 210, 1.0, "signal", {}, run)) is None
    assert not (run / "results.json").exists()
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        f"report not written at this stop: the loss log holds 0 MB, and a stop by a signal reads at most 0 MB of it, "
        f"to stay within the stop timeouts of systemd and docker; `streamer report {run}` writes it (the checkpoint "
        "is written)") and len(out) == 2
    assert report.print_run_report(RunSummary(21, 210, 1.0, "end_of_stream", {}, run))["metrics"]
    assert (run / "results.json").is_file()


def test_the_summary_line_says_how_many_updates_were_skipped():
    """A model gone non-finite (a damaged checkpoint's NaN weights) skipped every update and the run
    ended with exit 0 and a line that looked like any other: only a Prometheus counter knew."""
    from pathlib import Path

    from streamer.cli.report import summary_line
    from streamer.config import RunSummary

    line = summary_line(RunSummary(50, 1000, 6.0, "end_of_stream", {}, Path("r"), skipped=50))
    assert line.endswith("stopped: end_of_stream; 50 of its updates skipped (a non-finite loss or gradients: "
                         "nothing learned from those batches)")
    assert "skipped" not in summary_line(RunSummary(50, 1000, 6.0, "end_of_stream", {}, Path("r")))


def test_the_summary_line_says_each_cause_of_waiting_apart():
    """The time a run waited for its topic to be created is not the consumer group's joining."""
    from pathlib import Path

    from streamer.cli.report import summary_line
    from streamer.config import RunSummary

    summary = RunSummary(10, 200, 40.0, "idle", {}, Path("r"), compute_seconds=2.0, topic_missing_seconds=30.0,
                         joining_seconds=3.0, idle_seconds=4.0)
    assert ("40.0s: 2.0s computing (100 tokens/s), 37.0s waiting (for the topic 30.0s, joining the group 3.0s, "
            "idle 4.0s), 1.0s starting and stopping; stopped: idle") in summary_line(summary)


def test_a_runs_log_given_as_a_file_is_reported_with_its_runs_config(tmp_path):
    """`streamer report RUN/losses.jsonl` is the run's report: its config.json (the stream's 10 fragments:
    incomplete, span from 5) is read as for RUN (before, the file's 6 fragments were taken for the
    stream, and results.json lost the run's config)."""
    run = make_run(tmp_path, {"n_fragments": 10, "strategy": "naive"})
    by_file, by_dir = write_report(run / "losses.jsonl", k=2), build_report(run, k=2)
    assert by_file["span"] == by_dir["span"] and by_file["span"]["complete"] is False
    assert json.loads((run / "results.json").read_text())["config"]["strategy"] == "naive"


def test_report_errors_are_one_line_and_runs_of_one_name_get_a_folder_each(tmp_path):
    """A directory without a loss log (a comparison's --out, a run that learned nothing) and an --out that
    is a file are one line, not a traceback; two runs of the same name (A/naive-seed0, B/naive-seed0) get
    two folders under the report (the second wrote over the first). An empty probes.jsonl is no probe
    table (it showed a bogus forgetting row), and a figure of an earlier report there is removed."""
    import subprocess
    import sys

    compare_out = tmp_path / "cmp"
    for parent in ("a", "b"):
        make_run(tmp_path / parent, {"n_fragments": 6}).rename(tmp_path / parent / "naive-seed0")
    make_run(compare_out, {"n_fragments": 6}).rename(compare_out / "naive-seed0")
    empty = tmp_path / "empty"
    empty.mkdir()

    def report(*args):
        return subprocess.run([sys.executable, "-m", "streamer", "report", *map(str, args)], capture_output=True,
                              text=True, timeout=120)
    for args, said in (([compare_out], f"{compare_out} has no losses.jsonl, but 1 of its folders do: give those "
                                        f"(e.g. {compare_out / 'naive-seed0'})"),
                       ([empty], "has no losses.jsonl (not a run directory, or its run has written no loss log"),
                       ([compare_out / "naive-seed0", "--out", compare_out / "naive-seed0" / "losses.jsonl"],
                        "is a file; give a directory")):
        done = report(*args)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = report(tmp_path / "a" / "naive-seed0", tmp_path / "b" / "naive-seed0", "--out", tmp_path / "both")
    assert done.returncode == 0, done.stderr
    assert {p.name for p in (tmp_path / "both").iterdir() if p.is_dir()} == {"naive-seed0", "naive-seed0-2"}

    run = compare_out / "naive-seed0"
    (run / "probes.jsonl").write_text("")
    (run / "probe_matrix.png").write_bytes(b"an earlier run's")
    report_ = write_report(run)
    assert report_["forgetting"] is None and not (run / "probe_matrix.png").exists()


def test_a_last_line_torn_by_a_crash_is_left_out_with_a_note_and_a_bad_line_elsewhere_still_refused(tmp_path):
    """kill -9 while a line is written leaves it cut short: the report leaves it out, as a resume does, and
    says so (it refused the whole log: 'losses.jsonl:17: not JSON'). A bad line before the end is refused."""
    run = make_run(tmp_path, {"n_fragments": 6})
    whole = build_report(run, k=2)
    with open(run / "losses.jsonl", "a", encoding="utf-8") as log:
        log.write('{"loss": 3.5, "domain": 1, "domain_')
    torn = build_report(run, k=2)
    assert torn["metrics"]["loss"] == whole["metrics"]["loss"]
    assert any("last line was cut short" in note for note in torn["metrics"]["notes"])
    assert not any("cut short" in note for note in whole["metrics"]["notes"])
    with open(run / "losses.jsonl", "a", encoding="utf-8") as log:
        log.write("\n")  # now a whole line that is not JSON: a damaged log, not a crash's
    with pytest.raises(ValueError, match=r"losses.jsonl:17: not JSON"):
        build_report(run, k=2)


def test_a_from_fragment_past_the_runs_last_is_one_line(tmp_path, capsys):
    """`report --from-fragment 99` on a 10-fragment run printed empty tables titled 'fragments >= 99 of 10'
    (learn refuses the same value)."""
    from streamer.cli import main

    run = make_run(tmp_path, {"n_fragments": 10, "strategy": "naive"})
    assert main(["report", str(run), "--from-fragment", "9"]) == 0
    capsys.readouterr()
    assert main(["report", str(run), "--from-fragment", "10"]) == 2
    assert capsys.readouterr().err == ("streamer report: error: --from-fragment 10 is past the stream's last "
                                       "fragment: it has 10 (0 to 9); give one of those, 'half' or 'all'\n")


def test_a_run_of_independent_streams_is_not_called_incomplete_and_says_its_metrics_are_approximate(tmp_path):
    """Each batch takes the fragment most of its rows are in: most fragments of independent streams are
    never logged, and every whole run was reported as an incomplete stream."""
    run = make_run(tmp_path, {"n_fragments": 50, "strategy": "naive"})
    (run / "manifest.json").write_text(json.dumps({"schedule": "independent", "n_fragments": 50}))
    report = build_report(run, k=2, from_fragment="all")
    notes = report["metrics"]["notes"]
    assert report["span"]["complete"] and not any("incomplete" in note for note in notes)
    assert notes[0].startswith("independent streams: each batch is scored as the fragment most of its rows are in")
    (run / "manifest.json").write_text(json.dumps({"schedule": "calm", "n_fragments": 50}))
    assert not build_report(run, k=2, from_fragment="all")["span"]["complete"]


def test_a_run_of_independent_streams_stopped_before_its_last_batch_is_incomplete(tmp_path):
    """Its fragments cannot tell (most are never logged), its batches can: `learn --max-batches 300` on a
    4,722-batch independent stream was reported complete, with no note, and Table 1 did not flag it."""
    logged = len(project_records())
    config = {"n_fragments": 50, "strategy": "naive", "model_name": "lstm-char", "total_batches": logged + 1}
    run = make_run(tmp_path, config)
    (run / "manifest.json").write_text(json.dumps({"schedule": "independent", "n_fragments": 50}))
    report = build_report(run, k=2, from_fragment="all")
    notes = report["metrics"]["notes"]
    assert report["span"]["complete"] is False
    assert notes[0].startswith("independent streams:")
    assert notes[1] == (f"incomplete stream: {logged:,} of the stream's {logged + 1:,} batches were logged; "
                        "these metrics cover what was logged")
    (run / "config.json").write_text(json.dumps({**config, "total_batches": logged}))  # the whole stream
    assert build_report(run, k=2, from_fragment="all")["span"]["complete"]
    # another tokenizer's batches are not the manifest's byte windows: its total tells nothing
    (run / "config.json").write_text(json.dumps({**config, "model_name": "lstm-word"}))
    assert build_report(run, k=2, from_fragment="all")["span"]["complete"]


def test_a_report_scores_the_span_and_k_the_run_was_learned_with_unless_told_otherwise(tmp_path, capsys):
    """A learner without a manifest scores the whole stream (from_fragment 0 in its config.json) and writes
    results.json so; `streamer report RUN` scored fragments >= N/2 with k 10 and wrote other numbers over
    those. Now the run's own span and k are the default; the flags still choose another."""
    from streamer.cli import main

    run = make_run(tmp_path, {"n_fragments": 6, "from_fragment": 0, "k": 2})
    own = build_report(run)
    assert own["span"]["from_fragment"] == 0 and own["metrics"]["loss"] == pytest.approx(58 / 16)
    assert own["metrics"]["ppl@sw"] == pytest.approx(math.exp(11.5 / 3))  # k 2 (see the test above)
    assert build_report(run, from_fragment="half", k=2)["span"]["from_fragment"] == 3
    assert main(["report", str(run)]) == 0
    assert "fragments >= 0 of 6 (the whole stream)" in capsys.readouterr().out
    assert json.loads((run / "results.json").read_text())["span"]["from_fragment"] == 0
    assert build_report(make_run(tmp_path / "bare"))["span"]["from_fragment"] == 3  # no config.json: 'half'


def test_a_run_without_a_detector_is_reported_as_such_not_as_one_that_found_nothing(tmp_path):
    """--detector none ended with 'drift detector: found 0 of 5 switches ... recall 0.00' and results.json
    held recall 0."""
    from streamer.cli.report import detection_line

    run = make_run(tmp_path, {"n_fragments": 6, "detector": "none"})
    report = build_report(run, k=2)
    assert report["detection"]["evaluation"] is None and report["detection"]["metrics"] is None
    assert detection_line(report) == "drift detector: off (--detector none)"
    assert detection_line(build_report(make_run(tmp_path / "ph", {"n_fragments": 6}), k=2)).startswith(
        "drift detector: found ")


def test_a_torn_probe_log_a_damaged_config_and_an_out_through_a_file_are_each_one_line(tmp_path, capsys):
    """A kill -9 mid-row of probes.jsonl failed the report with "Expecting ',' delimiter" (no file named); a
    damaged config.json said "Expecting value" alone; --out RUN/config.json/sub was a NotADirectoryError
    traceback."""
    from streamer.cli import main

    run = make_run(tmp_path, {"n_fragments": 6})
    row = {"batch": 0, "trigger": "start", "ended_class": None, "scores": {"en": 5.0, "fr": 5.5}}
    (run / "probes.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "batch": 4})[:30])
    assert build_report(run, k=2)["forgetting"]["probe_evaluations"] == 1
    (run / "probes.jsonl").write_text(json.dumps(row)[:30] + "\n" + json.dumps(row) + "\n")
    assert main(["report", str(run)]) == 2
    assert f"{run / 'probes.jsonl'}:1: not JSON" in capsys.readouterr().err
    (run / "probes.jsonl").unlink()
    assert main(["report", str(run), "--out", str(run / "config.json" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Not a directory" in err and str(run / "config.json") in err, err
    (run / "config.json").write_text('{"n_fragments": 6,\n')
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'config.json'} is not JSON" in err, err


def test_the_runs_own_span_past_what_it_logged_is_empty_not_refused_and_several_runs_share_one_k_and_span(
        tmp_path, capsys):
    """A run learned --from-fragment 8 and stopped at fragment 5: `report RUN` refused it with a flag the user
    never gave ('--from-fragment 8 is past the stream's last fragment'). And `report A B` of runs learned with
    different k averaged their ppl@sw in one Table 1 row without a word."""
    from streamer.cli import main

    early = make_run(tmp_path / "early", {"from_fragment": 8, "k": 2})
    report = build_report(early)
    assert report["span"]["from_fragment"] == 8 and report["metrics"]["loss"] is None
    assert any("starts at fragment 8 (its config.json), past the fragments it logged (0 to 5)" in note
               for note in report["metrics"]["notes"])
    assert main(["report", str(early)]) == 0
    assert "fragments >= 8 of 6 (the run's span, from its config.json)" in capsys.readouterr().out
    a = make_run(tmp_path / "a", {"from_fragment": 0, "k": 2, "strategy": "naive"})
    b = make_run(tmp_path / "b", {"from_fragment": 3, "k": 10, "strategy": "naive"})
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "ab")]) == 0
    err = capsys.readouterr().err
    assert "the runs were learned with different k; all scored with -k 10" in err
    assert "the runs were learned over different spans; all scored from fragment 'half'" in err
    both = json.loads((tmp_path / "ab" / "run" / "results.json").read_text())
    assert both["span"]["from_fragment"] == 3


def test_a_dollar_in_a_class_or_run_name_is_drawn_as_written(tmp_path):
    """matplotlib reads text between `$`s as mathtext: a class file `cs $^$.txt` made every figure raise
    (learn, report and compare ended in a traceback), and `US$ and CA$` was set in italics."""
    names = {0: "cs $^$", 1: "US$ and CA$"}
    run = tmp_path / "run $^$"
    with LossLogWriter(run / "losses.jsonl") as log:
        for index, record in enumerate(project_records()):
            log.write({**record, "domain_name": names[record["domain"]], "gates": [index / 20, 1 - index / 20]})
    with open(run / "probes.jsonl", "w", encoding="utf-8") as probes:
        for batch, ended in ((0, None), (2, names[0]), (5, names[1])):
            scores = {name: 2.0 + batch / 10 for name in names.values()}
            probes.write(json.dumps({"batch": batch, "trigger": "switch" if batch else "start",
                                     "ended_class": ended, "scores": scores, "seconds": 0.01}) + "\n")
    write_report(run)
    for name in ("loss_curve.png", "gate_weights.png", "probe_matrix.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    from matplotlib import cbook

    from monitor.plots import literal

    assert not cbook.is_math_text(literal("US$ and CA$")) and not cbook.is_math_text(literal(r"a\$b$"))


def test_the_report_of_a_run_that_logged_no_batch_says_so(tmp_path):
    """It said the run's span was "past the fragments it logged (0 to -1)"."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "losses.jsonl").write_text("")
    (run / "config.json").write_text(json.dumps({"from_fragment": 2, "n_fragments": 4}))
    notes = write_report(run)["metrics"]["notes"]
    assert "no batches logged: nothing to score" in notes and not any("-1" in note for note in notes), notes


def test_report_names_the_figures_it_wrote(tmp_path, capsys):
    """`streamer report` said "written to ...: results.json, loss_curve.png" of a run it also drew the probe matrix
    and the gate weights of."""
    from streamer.cli.main import main

    run = tmp_path / "run"
    with LossLogWriter(run / "losses.jsonl") as log:
        for index, record in enumerate(project_records()):
            log.write({**record, "gates": [index / 20, 1 - index / 20]})
    with open(run / "probes.jsonl", "w", encoding="utf-8") as probes:
        for batch, ended in ((0, None), (2, "A"), (5, "B")):
            probes.write(json.dumps({"batch": batch, "trigger": "switch" if batch else "start", "ended_class": ended,
                                     "scores": {"A": 2.0, "B": 2.5}, "seconds": 0.01}) + "\n")
    assert main(["report", str(run)]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1]
    assert written == f"written to {run}: results.json, loss_curve.png, probe_matrix.png, gate_weights.png"
    (run / "probes.jsonl").unlink()
    assert main(["report", str(run)]) == 0  # (and an earlier report's probe matrix is not this one's)
    assert capsys.readouterr().out.strip().endswith(": results.json, loss_curve.png, gate_weights.png")


def test_a_run_that_logged_every_fragment_is_complete_and_its_probes_are_summed_over_every_row(tmp_path):
    """Six fragments expected and six logged: complete, with no "incomplete stream" note. Its probes: 0.5 +
    0.25 + 0.25 s over 3 evaluations; class C, probed but never streamed, is a column after those streamed;
    a classifier's end-of-run probe (trigger "end") closes B's first fragment: a stage at batch 16."""
    run = make_run(tmp_path, {"n_fragments": 6})
    rows = [{"batch": 0, "trigger": "periodic", "scores": {"A": 3.0, "B": 3.0, "C": 3.0}, "seconds": 0.5},
            {"batch": 2, "trigger": "switch", "ended_class": "A", "scores": {"A": 1.0, "B": 3.5, "C": 3.25},
             "seconds": 0.25},
            {"batch": 16, "trigger": "end", "ended_class": "B", "scores": {"A": 2.0, "B": 1.5, "C": 3.0},
             "seconds": 0.25}]
    (run / "probes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = build_report(run, k=2)
    assert report["span"]["complete"] is True and report["span"]["n_fragments_seen"] == 6
    assert not any(note.startswith("incomplete stream") for note in report["metrics"]["notes"])
    assert (report["forgetting"]["probe_seconds"], report["forgetting"]["probe_evaluations"]) == (1.0, 3)
    assert report["probe_matrix"] == {"stages": [2, 16], "classes": ["A", "B", "C"],
                                      "values": [[1.0, 3.5, 3.25], [2.0, 1.5, 3.0]], "unit": "held-out loss (nats)"}
    assert report["forgetting"]["forgetting"] == 1.0  # A: 1.0 just after its stage, 2.0 at the end


def test_a_report_scores_detections_with_the_runs_detector_and_says_an_oracle_run(tmp_path):
    """A run's detector (config.json) names the detections' source; without one, the default page-hinkley.
    An oracle run (the class told to the strategy) says so."""
    plain = build_report(make_run(tmp_path / "a", {"n_fragments": 6}), k=2)
    told = build_report(make_run(tmp_path / "b", {"n_fragments": 6, "detector": "adwin", "oracle": True}), k=2)
    assert plain["oracle"] is False and told["oracle"] is True
    assert plain["detection"]["source"].startswith("detect_offline with 'page-hinkley'")
    assert told["detection"]["source"].startswith("detect_offline with 'adwin'")
