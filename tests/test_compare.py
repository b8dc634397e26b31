"""Reports across runs: Table 1 per strategy, forgetting table, after-switch / heatmap / gate figures."""

import json
import math

import numpy as np
import pytest

from monitor.compare import (
    FORGETTING_MISSING_NOTE,
    forgetting_table_markdown,
    load_runs,
    summarise_runs,
    table1_markdown,
    write_comparison,
)
from monitor.figures import (
    after_switch_curves,
    plot_after_switch,
    plot_gate_weights,
    plot_probe_heatmap,
    strategy_after_switch,
)
from monitor.losslog import LossLogWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report(run, strategy, seed, ppl, ppl_sw, rec, **config):
    return {
        "run": f"runs/{run}",
        "config": {"strategy": strategy, "seed": seed, "run_name": run, **config},
        "span": {"from_fragment": 5, "n_fragments_expected": 10, "n_fragments_seen": 10, "complete": True},
        "metrics": {"ppl": ppl, "ppl@sw": ppl_sw, "rec": rec, "notes": []},
    }


def three_reports():
    # the oracle comes first here; the summary puts it last, as in CALM's Table 1
    return [
        report("ind-0", "independent", 0, 7.0, 7.5, 1.0, oracle=True),  # as its config.json says
        report("naive-0", "naive", 0, 10.0, 12.0, 4.0, parameters=1234),
        report("naive-1", "naive", 1, 12.0, 16.0, None, parameters=1234),
    ]


def test_summarise_runs_by_hand():
    summary = summarise_runs(three_reports())
    assert [entry["strategy"] for entry in summary] == ["naive", "independent"]
    naive, oracle = summary
    assert naive["n_runs"] == 2 and naive["seeds"] == [0, 1] and naive["runs"] == ["naive-0", "naive-1"]
    assert naive["parameters"] == 1234 and oracle["parameters"] is None
    assert not naive["oracle"] and oracle["oracle"]
    # ppl: mean (10 + 12) / 2 = 11; deviations -1, +1; sum of squares 2; / (n - 1 = 1) = 2; std sqrt(2)
    assert naive["metrics"]["ppl"]["mean"] == pytest.approx(11.0)
    assert naive["metrics"]["ppl"]["std"] == pytest.approx(math.sqrt(2))  # 1.41421...
    # ppl@sw: mean (12 + 16) / 2 = 14; deviations -2, +2; sum of squares 8; / 1 = 8; std sqrt(8)
    assert naive["metrics"]["ppl@sw"]["mean"] == pytest.approx(14.0)
    assert naive["metrics"]["ppl@sw"]["std"] == pytest.approx(math.sqrt(8))  # 2.82842...
    # rec: naive-1 has none, so the mean is naive-0's 4 alone, no std, one missing
    assert naive["metrics"]["rec"] == {"mean": 4.0, "std": None, "n": 1, "missing": 1}
    assert any("rec: no value in 1 of 2 runs (naive-1)" in note for note in naive["notes"])
    # one run: the value itself, std None
    assert oracle["metrics"]["ppl"] == {"mean": 7.0, "std": None, "n": 1, "missing": 0}
    assert oracle["notes"] == []


def test_runs_of_one_name_are_told_apart_by_their_directories():
    reports = [{"run": f"/x/{parent}/naive-seed0", "config": {"strategy": "naive", "seed": 0},
                "metrics": {"ppl": 2.0, "ppl@sw": 3.0, "rec": 1.0}} for parent in ("cmp1", "cmp2")]
    (naive,) = summarise_runs(reports)
    assert naive["runs"] == ["cmp1/naive-seed0", "cmp2/naive-seed0"]


def test_summarise_runs_none_inf_and_missing_config():
    reports = [
        report("a", "naive", 0, None, None, None),
        report("b", "naive", 0, math.inf, 9.0, 2.0),
        {"run": "runs/c", "config": {}, "span": {"complete": False, "from_fragment": 0},
         "metrics": {"ppl": 5.0, "ppl@sw": None, "rec": None}},
    ]
    naive, unknown = summarise_runs(reports)
    assert naive["metrics"]["ppl"] == {"mean": math.inf, "std": None, "n": 1, "missing": 1}
    assert naive["metrics"]["rec"] == {"mean": 2.0, "std": None, "n": 1, "missing": 1}
    assert any("not finite" in note for note in naive["notes"])
    assert any("seed(s) [0] appear in more than one run" in note for note in naive["notes"])
    assert unknown["strategy"] == "unknown" and unknown["seeds"] == [None]
    assert unknown["metrics"]["ppl@sw"] == {"mean": None, "std": None, "n": 0, "missing": 1}
    assert any("incomplete stream in c" in note for note in unknown["notes"])
    text = table1_markdown([naive, unknown])
    assert "| naive | 2 | inf | 9.00 | 2.00 | n/a |" in text
    assert "| unknown | 1 | 5.00 | n/a | n/a | n/a |" in text


def test_table1_markdown_text():
    text = table1_markdown(summarise_runs(three_reports()))
    lines = text.splitlines()
    assert lines[0] == "| strategy | runs | ppl | ppl@sw | rec | params |"
    assert lines[2] == "| naive | 2 | 11.00 ± 1.41 | 14.00 ± 2.83 | 4.00 | 1,234 |"
    assert lines[3] == "| independent (oracle) | 1 | 7.00 | 7.50 | 1.00 | n/a |"
    assert "sample standard deviation (ddof=1)" in text
    assert "Evaluated span: fragments >= 5." in text
    assert "- naive: rec: no value in 1 of 2 runs (naive-1); mean over the other 1" in text


def test_a_value_no_run_has_is_said_with_the_runs_reason():
    """Table 1 printed n/a and "ppl@sw: no value in 1 of 1 runs (naive-seed0); mean over the other 0": no why,
    though the run's report says it."""
    revisit = "no class was revisited in the evaluated span (fragments >= 5; the last fragment is never counted)"
    reports = [report("naive-0", "naive", 0, 10.0, None, None)]
    reports[0]["metrics"]["notes"] = [f"ppl@sw, rec: {revisit}", "class 'en': ppl@sw, rec n/a, never revisited"]
    (naive,) = summarise_runs(reports)
    assert naive["notes"] == [f"ppl@sw: no value in 1 of 1 runs (naive-0): {revisit}",
                              f"rec: no value in 1 of 1 runs (naive-0): {revisit}"]


def test_forgetting_table():
    reports = three_reports()
    assert forgetting_table_markdown(reports) == FORGETTING_MISSING_NOTE
    assert FORGETTING_MISSING_NOTE.count("\n") == 1 and "probe" in FORGETTING_MISSING_NOTE
    reports[1]["forgetting"] = {"forgetting": 0.5, "bwt": -0.25, "per_class": {"en": 1.0}}
    reports[2]["forgetting"] = {"forgetting": 1.5, "bwt": None}
    text = forgetting_table_markdown(reports)
    lines = text.splitlines()
    assert lines[0] == "| strategy | runs | forgetting | bwt |"
    # forgetting: mean (0.5 + 1.5) / 2 = 1; deviations -0.5, +0.5; sum of squares 0.5; std sqrt(0.5) = 0.707
    assert lines[2] == "| naive | 2/2 | 1.00 ± 0.71 | -0.25 |"
    assert lines[3] == "| independent (oracle) | 0/1 | n/a | n/a |"


def tiny_records():
    # sequences 0 0 | 1 1 1 | 2 | 3 3: switches at indices 2, 5 and 6
    sequences = [0, 0, 1, 1, 1, 2, 3, 3]
    losses = [9, 9, 5, 3, 1, 7, 4, 2]
    return [{"loss": float(loss), "domain": s % 2, "domain_name": "AB"[s % 2], "sequence": s}
            for s, loss in zip(sequences, losses)]


def test_after_switch_curves_by_hand():
    curve = after_switch_curves(tiny_records(), 4)
    # offset 0: first batch of fragments 1, 2, 3 -> (5 + 7 + 4) / 3 = 16/3
    # offset 1: fragments 1 and 3 (fragment 2 has one batch) -> (3 + 2) / 2 = 2.5
    # offset 2: fragment 1 only -> 1; offset 3: no fragment that long -> NaN
    np.testing.assert_allclose(curve[:3], [16 / 3, 2.5, 1.0])
    assert math.isnan(curve[3])
    # fragment 0 precedes the first switch and never counts
    assert np.isnan(after_switch_curves(tiny_records()[:2], 3)).all()

    second = [dict(r, loss=r["loss"] + 1.0) for r in tiny_records()]  # every loss 1 higher
    curves = strategy_after_switch({"naive": [tiny_records(), second]}, 3)["naive"]
    assert curves["n_runs"] == 2
    np.testing.assert_allclose(curves["mean"], [16 / 3 + 0.5, 3.0, 1.5])
    np.testing.assert_allclose(curves["min"], [16 / 3, 2.5, 1.0])
    np.testing.assert_allclose(curves["max"], [16 / 3 + 1, 3.5, 2.0])


def synthetic_run(seed, recovery, fragments=12, length=30):
    """Loss jumps at each switch and decays with time constant ``recovery`` batches."""
    rng = np.random.default_rng(seed)
    records = []
    for sequence in range(fragments):
        domain = sequence % 3
        for t in range(length):
            loss = 2.0 + 3.0 * math.exp(-t / recovery) + 0.2 * rng.standard_normal()
            records.append({"loss": loss, "domain": domain, "domain_name": "abc"[domain],
                            "sequence": sequence, "step": len(records)})
    return records


def assert_png(path, min_bytes=5000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes


def test_plot_after_switch(tmp_path):
    groups = {"naive": [synthetic_run(0, 6.0), synthetic_run(1, 6.0)],
              "poe": [synthetic_run(2, 2.0), synthetic_run(3, 2.0)]}
    result = plot_after_switch(groups, tmp_path / "after_switch.png", horizon=15,
                               k_label="synthetic, 30 batches per fragment")
    assert result.path == tmp_path / "after_switch.png" and result.reason is None
    assert_png(result.path)
    curves = strategy_after_switch(groups, 15)
    # faster recovery: lower loss a few batches after the switch
    assert curves["poe"]["mean"][5] < curves["naive"]["mean"][5]

    empty = plot_after_switch({"naive": [tiny_records()[:2]]}, tmp_path / "none.png")
    assert empty.path is None and "no switch" in empty.reason
    assert not (tmp_path / "none.png").exists()


def test_plot_probe_heatmap(tmp_path):
    values = [[2.1, None, None], [2.5, 1.9, None], [3.0, 2.2, 1.7]]
    result = plot_probe_heatmap(values, ["after en", "after fr", "after cs"], ["en", "fr", "cs"],
                                tmp_path / "probe.png", title="R (held-out loss)")
    assert_png(result.path, min_bytes=2000)
    assert plot_probe_heatmap([], [], [], tmp_path / "x.png", title="").path is None
    bad = plot_probe_heatmap([[1.0, 2.0]], ["s0"], ["a"], tmp_path / "x.png", title="")
    assert bad.path is None and "1 stages x 1 classes" in bad.reason


def test_plot_gate_weights(tmp_path):
    rows = synthetic_run(0, 4.0, fragments=6, length=40)
    for index, row in enumerate(rows):
        logits = np.array([math.sin(index / 15 + e) for e in range(3)]) * 3
        row["gates"] = (np.exp(logits) / np.exp(logits).sum()).tolist()
    result = plot_gate_weights(rows, tmp_path / "gates.png")
    assert_png(result.path)
    absent = plot_gate_weights(synthetic_run(0, 4.0), tmp_path / "no_gates.png")
    assert absent == (None, "no gate weights logged")
    assert not (tmp_path / "no_gates.png").exists()


def write_run(directory, records, config):
    directory.mkdir(parents=True)
    with LossLogWriter(directory / "losses.jsonl") as log:
        for record in records:
            log.write(record)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_write_comparison_writes_all_files(tmp_path):
    paths = [
        write_run(tmp_path / "naive-0", synthetic_run(0, 6.0), {"strategy": "naive", "seed": 0, "parameters": 99}),
        write_run(tmp_path / "naive-1", synthetic_run(1, 6.0), {"strategy": "naive", "seed": 1, "parameters": 99}),
        write_run(tmp_path / "poe-0", synthetic_run(2, 2.0), {"strategy": "poe", "seed": 0}),
    ]
    runs = load_runs(paths)
    runs[0][0]["metrics"]["ppl"] = math.inf  # a diverged run: written as "inf"
    runs[2][0]["probe_matrix"] = {"stages": [0, 1], "classes": ["a", "b"], "values": [[1.0, None], [1.5, 0.9]]}
    runs[2][0]["forgetting"] = {"forgetting": 0.3, "bwt": -0.3}
    out = tmp_path / "compare"
    comparison = write_comparison(runs, out)
    for name in ("table1.md", "forgetting.md", "after_switch.png", "probe_matrix_poe-0.png", "comparison.json"):
        assert (out / name).exists(), name
        assert name in comparison["files"]
    assert_png(out / "after_switch.png")
    saved = json.loads((out / "comparison.json").read_text())  # strict JSON
    naive = saved["strategies"][0]
    assert naive["strategy"] == "naive" and naive["n_runs"] == 2 and naive["parameters"] == 99
    assert naive["metrics"]["ppl"]["mean"] == "inf" and naive["metrics"]["ppl"]["std"] is None
    assert saved["strategies"][1]["metrics"]["ppl"]["std"] is None  # one poe run
    assert set(saved["after_switch"]["curves"]) == {"naive", "poe"}
    assert len(saved["after_switch"]["curves"]["naive"]["mean"]) == 15
    assert "| poe | 1/1 | 0.30 | -0.30 |" in (out / "forgetting.md").read_text()
    assert "| naive | 2 | inf |" in (out / "table1.md").read_text()
    assert saved["skipped"] == {}


def test_the_forgetting_table_names_losses_as_losses_and_counts_as_integers():
    from monitor.compare import forgetting_table_markdown

    reports = [{"config": {"strategy": "naive"}, "forgetting": {"score": "-loss", "n_stages": 5, "cur_acc": -3.39,
                                                                "forgetting": 0.25, "probe_evaluations": 24}}]
    table = forgetting_table_markdown(reports)
    header, _, row = table.splitlines()[:3]
    assert "cur_loss (nats)" in header and "cur_acc" not in header
    assert "| 5 |" in row and "5.00" not in row  # a count is an integer
    assert "| 24 |" in row and "24.00" not in row  # the probe evaluations too
    assert "3.39" in row and "-3.39" not in row  # the loss itself, sign restored
    assert "0.25" in row  # forgetting keeps its sign: positive means worse


def test_a_dollar_in_a_run_or_class_name_does_not_break_the_comparisons_figures(tmp_path):
    """A run named `tweets_$AAPL_$TSLA` with a class `cs $^$`: its probe heatmap's title and ticks were mathtext,
    and compare ended in a ValueError."""
    records = [{**record, "domain_name": "cs $^$" if record["domain"] else "tweets_$AAPL_$TSLA"}
               for record in synthetic_run(0, 6.0)]
    runs = load_runs([write_run(tmp_path / "tweets_$AAPL_$TSLA", records, {"strategy": "naive", "seed": 0})])
    runs[0][0]["probe_matrix"] = {"stages": [0, 1], "classes": ["cs $^$", "a$"], "values": [[1.0, None], [1.5, 0.9]]}
    comparison = write_comparison(runs, tmp_path / "compare")
    assert comparison["skipped"] == {}
    assert_png(tmp_path / "compare" / "probe_matrix_tweets_$AAPL_$TSLA.png", min_bytes=2000)


@pytest.fixture
def drawn(monkeypatch):
    """The figures saved during a test, as matplotlib Figures (still saved to their files)."""
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig

    def saving(self, *args, **kwargs):
        figures.append(self)
        return savefig(self, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", saving)
    return figures


def _legend_of(figure):
    """The legend's labels and handles, and whether it lies within the image."""
    legend = figure.axes[0].get_legend()
    box = legend.get_window_extent(figure.canvas.get_renderer())
    inside = box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1
    return [text.get_text() for text in legend.get_texts()], legend.legend_handles, inside


def test_many_classes_and_experts_each_get_a_legend_entry_of_their_own_within_the_image(tmp_path, drawn):
    """A class named `_other` was dropped from the legend (matplotlib skips labels that start with `_`); 22 classes
    ran off the image; past 20 the colours repeated (class20 looked like class00); with 30 experts the gate
    figure's legend showed experts 0 to 19."""
    from monitor.plots import LossCurve

    names = ["_other"] + [f"class{i:02d}" for i in range(21)]
    curve = LossCurve()
    for index in range(len(names) * 5):
        curve.update(1.0 + index % 5, index // 5, names[index // 5])
    curve.save(tmp_path / "loss.png")
    labels, handles, inside = _legend_of(drawn[-1])
    assert labels[-22:] == sorted(names) and inside
    looks = {(handle.get_color(), str(handle.get_linestyle())) for handle in handles[-22:]}
    assert len(looks) == 22

    rows = [{"gates": [1 / 30] * 30, "sequence": index // 10, "step": index} for index in range(60)]
    assert plot_gate_weights(rows, tmp_path / "gates.png").path is not None
    labels, handles, inside = _legend_of(drawn[-1])
    assert labels[:30] == [f"expert {e}" for e in range(30)] and inside
    assert len({(tuple(handle.get_facecolor()), handle.get_hatch()) for handle in handles[:30]}) == 30


def test_gate_values_that_are_not_weights_are_drawn_as_lines_not_stacked(tmp_path, drawn):
    """poe logs signed raw gate values (-0.53..1.26, rows summing to 3.57): stacked, they read as shares of 1."""
    from matplotlib.collections import PolyCollection

    signed = [{"gates": [-0.53, 1.26, 2.84], "sequence": index // 10, "step": index} for index in range(40)]
    assert plot_gate_weights(signed, tmp_path / "signed.png").path is not None
    axes = drawn[-1].axes[0]
    assert len(axes.lines) == 3 and not any(isinstance(c, PolyCollection) for c in axes.collections)
    assert axes.get_ylabel() == "gate value"
    weights = [{**row, "gates": [0.2, 0.3, 0.5]} for row in signed]
    assert plot_gate_weights(weights, tmp_path / "weights.png").path is not None
    axes = drawn[-1].axes[0]
    assert not axes.lines and sum(isinstance(c, PolyCollection) for c in axes.collections) == 3
    assert axes.get_ylabel() == "gate weight"


def test_a_pipe_in_a_strategy_name_stays_in_its_cell():
    """A run's config.json names its strategy: `a|b` split Table 1's row (and the forgetting table's)."""
    reports = [report("x-0", "a|b", 0, 10.0, 12.0, 4.0)]
    reports[0]["forgetting"] = {"forgetting": 0.3}
    assert r"| a\|b | 1 | 10.00 |" in table1_markdown(summarise_runs(reports))
    assert r"| a\|b | 1/1 | 0.30 |" in forgetting_table_markdown(reports)


def test_the_loss_curve_counts_every_switch_it_does_not_draw_and_a_short_run_gets_whole_batch_ticks(tmp_path, drawn):
    """The legend said "651+ true switches" of 661 (it counted the buckets holding one); a 1-batch run's x ticks
    were at -0.4 .. 0.4."""
    from monitor.plots import LossCurve

    curve = LossCurve(max_points=400)
    for index in range(800):  # a fragment a batch: 799 switches, in 400 buckets of 2
        curve.update(2.0, index, "ab"[index % 2], detected=index % 2 == 1)
    curve.save(tmp_path / "loss.png")
    labels, _, _ = _legend_of(drawn[-1])
    assert "799 true switches, not drawn" in labels and "400 detected switches, not drawn" in labels, labels
    single = LossCurve()
    single.update(2.0, 0, "a")
    single.save(tmp_path / "one.png")
    ticks = drawn[-1].axes[0].get_xticks()
    assert all(float(tick).is_integer() for tick in ticks), ticks


def test_the_probe_heatmap_says_what_each_stage_is_and_tilts_long_class_names(tmp_path, drawn):
    """Its rows were bare batch numbers beside "stage"; long class names ran into each other."""
    names = ["english_news", "french_news", "czech_news"]
    values = [[2.1, None, None], [2.5, 1.9, None]]
    assert plot_probe_heatmap(values, [50, 1200], names, tmp_path / "probe.png").path is not None
    axes = drawn[-1].axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()] == [
        "after english_news (batch 50)", "after french_news (batch 1,200)"]
    assert all(label.get_rotation() == 45 for label in axes.get_xticklabels())


def test_values_as_results_json_writes_them_diverged_runs_of_both_signs_and_differing_sizes():
    """results.json writes a diverged ppl as the string "inf" (or "-inf"): read back as numbers; runs
    diverged both ways have no mean (nan); a nan value is a missing one (rec: 3.0 over the other run);
    runs of two parameter counts say both, in the table too."""
    from monitor.compare import summarise_runs, table1_markdown

    def report(seed, ppl, rec, parameters):
        return {"run": f"out/s-seed{seed}", "config": {"strategy": "s", "seed": seed, "parameters": parameters},
                "metrics": {"ppl": ppl, "ppl@sw": 2.0 + seed, "rec": rec},
                "span": {"complete": True, "from_fragment": 2}}
    one_way = summarise_runs([report(0, "inf", 1.0, 100), report(1, 5.0, 1.0, 100)])[0]
    assert one_way["metrics"]["ppl"] == {"mean": math.inf, "std": None, "n": 2, "missing": 0}
    entry = summarise_runs([report(0, "inf", math.nan, 100), report(1, "-inf", 3.0, 120)])[0]
    assert math.isnan(entry["metrics"]["ppl"]["mean"]) and entry["metrics"]["ppl"]["n"] == 2
    assert entry["metrics"]["rec"] == {"mean": 3.0, "std": None, "n": 1, "missing": 1}
    assert entry["parameters"] == [100, 120] and "runs differ in parameter count: [100, 120]" in entry["notes"]
    assert "| s | 2 | nan | 2.50 ± 0.71 | 3.00 | 100–120 |" in table1_markdown([entry])


def test_runs_over_different_spans_say_so_and_repeated_figure_names_are_numbered_from_2():
    from monitor.compare import table1_markdown, unique_name

    entries = [{"strategy": name, "n_runs": 1, "from_fragment": [start], "notes": [],
                "metrics": {column: {"mean": 1.0, "std": None} for column in ("ppl", "ppl@sw", "rec")}}
               for name, start in (("a", 2), ("b", 3))]
    assert "Evaluated span: fragments >= [2, 3] (runs differ)." in table1_markdown(entries)
    assert "Evaluated span: fragments >= 2." in table1_markdown(entries[:1])
    used = {"run"}
    assert [unique_name("run", used), unique_name("run", used), unique_name("other", used)] == ["run-2", "run-3",
                                                                                                "other"]
