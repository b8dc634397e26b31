"""The Grafana dashboard as code: committed JSON in sync, queries filtered and naming real metrics."""

import argparse
import json
import re
from pathlib import Path

from monitor.dashboard import DEFAULT_PATH, build_dashboard, panel_queries, render_dashboard
from streamer.cli.monitor import add_monitor_parser, cmd_monitor
from monitor.exporter import CATALOGUE

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / DEFAULT_PATH
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"

# Metrics the dashboard may query before monitor/exporter.py's CATALOGUE declares them (names
# without the streamer_ prefix). Empty now: every planned metric (lag per partition, dead letters
# by reason, detected switches, class mean loss, checkpoint age, GPU memory, forgetting) is catalogued.
PLANNED: set[str] = set()
SELECTOR = re.compile(r"\b(streamer_[a-z_]+)(\{[^}]*\})?")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="streamer")
    add_monitor_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _known_names() -> set[str]:
    names = set()
    for name, kind, _, _ in [*CATALOGUE, *((n, "planned", (), "") for n in PLANNED)]:
        full = f"streamer_{name}"
        names.add(full)
        if kind == "histogram":
            names.update(full + suffix for suffix in ("_bucket", "_sum", "_count"))
        if full.endswith("_total"):  # a counter may be written with or without its suffix
            names.add(full[: -len("_total")])
    return names


def test_committed_dashboard_is_the_generated_one():
    assert COMMITTED.exists(), f"{DEFAULT_PATH} is missing; run `streamer monitor dashboard`"
    committed = COMMITTED.read_text(encoding="utf-8")
    assert json.loads(committed) == build_dashboard(), (
        f"{DEFAULT_PATH} differs from monitor.dashboard.build_dashboard(); run `streamer monitor dashboard`")
    assert committed == render_dashboard(), f"{DEFAULT_PATH} is not formatted as generated; run `streamer monitor dashboard`"


def test_dashboard_identity_variables_and_switch_annotations():
    dashboard = build_dashboard()
    assert (dashboard["uid"], dashboard["title"], dashboard["schemaVersion"]) == (
        "streamer", "streamer: online continual learning", 39)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"run", "strategy"}
    for name, variable in variables.items():
        assert variable["type"] == "query" and variable["multi"] and variable["includeAll"]
        assert variable["datasource"]["uid"] == "prometheus"
        assert variable["definition"].startswith("label_values(streamer_batches_learned_total")
        assert variable["definition"].endswith(f", {name})")
    # markers from the data: Prometheus queries on the switch-time gauges, on by default, two colours
    markers = [a for a in dashboard["annotations"]["list"] if a["datasource"]["uid"] == "prometheus"]
    assert [a["name"] for a in markers] == ["True switches", "Detected switches"]
    assert all(a["enable"] and a["useValueForTime"] and a["target"]["expr"] == a["expr"] for a in markers)
    assert len({a["iconColor"] for a in markers}) == 2
    assert [re.search(r'kind="(\w+)"', a["expr"]).group(1) for a in markers] == ["true", "detected"]
    assert all(a["expr"].startswith("streamer_switch_timestamp_seconds{") and a["expr"].endswith("* 1000")
               for a in markers)
    # what `streamer monitor push` posts stays reachable, off by default
    pushed = [a for a in dashboard["annotations"]["list"] if a["datasource"]["uid"] == "-- Grafana --" and not a.get("builtIn")]
    assert sorted(tuple(a["target"]["tags"]) for a in pushed) == [
        ("streamer", "switch", "detected"), ("streamer", "switch", "true")]
    assert not any(a["enable"] for a in pushed)


def test_every_panel_names_its_unit_and_the_top_panel_shows_the_worst_batch():
    panels = [p for p in build_dashboard()["panels"] if p["type"] != "row"]
    for panel in panels:
        units = [panel["fieldConfig"]["defaults"]["unit"]] + [
            prop["value"] for o in panel["fieldConfig"]["overrides"] for prop in o["properties"] if prop["id"] == "unit"]
        assert all(unit and unit not in ("none", "short") for unit in units), (panel["title"], units)
    top = panels[0]
    assert top["type"] == "timeseries" and top["fieldConfig"]["defaults"]["unit"] == "suffix: nats"
    exprs = [t["expr"] for t in top["targets"]]
    assert exprs[0].startswith("histogram_quantile(0.99, sum by (le, run, strategy, class) (irate(streamer_batch_loss_nats_bucket{")
    assert exprs[0].endswith(">= 0")  # an inactive class (NaN) draws no line
    assert any('phase="steady"' in e for e in exprs)


def test_every_panel_has_targets_filtered_by_run_and_strategy():
    dashboard = build_dashboard()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "prometheus" for t in panel["targets"])
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
    queries = panel_queries(dashboard)
    assert len(queries) == sum(len(p["targets"]) for p in panels)
    for title, expr, _ in queries:
        selectors = SELECTOR.findall(expr)
        assert selectors, (title, expr)
        for metric, matchers in selectors:
            assert 'run=~"$run"' in matchers and 'strategy=~"$strategy"' in matchers, (title, metric, expr)
        if "rate(" in expr:
            assert "[$__rate_interval]" in expr, (title, expr)


def test_queries_use_only_catalogued_or_planned_metrics():
    known = _known_names()
    used = {metric for _, expr, _ in panel_queries() for metric, _ in SELECTOR.findall(expr)}
    unknown = sorted(used - known)
    assert not unknown, f"not in monitor.exporter.CATALOGUE nor PLANNED: {unknown}"


def test_only_the_run_dependent_panels_are_optional():
    optional = {title for title, _, is_optional in panel_queries() if is_optional}
    assert optional == {"Forgetting per class", "GPU memory", "Detector precision, recall and delay"}


def test_expected_panels_and_queries():
    queries = panel_queries()
    by_title = {}
    for title, expr, _ in queries:
        by_title.setdefault(title, []).append(expr)
    assert any(e.startswith("exp(streamer_loss_after_switch_mean{") for e in by_title["ppl and ppl@sw per class"])
    latency = by_title["Step latency (p50, p95)"]
    assert sorted(re.search(r"histogram_quantile\(([\d.]+)", e).group(1) for e in latency) == ["0.5", "0.5", "0.95", "0.95"]
    assert {m for e in latency for m in re.findall(r"streamer_\w+_bucket", e)} == {
        "streamer_predict_seconds_bucket", "streamer_learn_seconds_bucket"}
    assert "by (run, strategy, reason)" in by_title["Dead letters by reason"][0]


def test_the_forgetting_panel_shows_a_classifiers_accuracy_drop_as_a_ratio_and_a_loss_increase_in_nats():
    """The panel said "Loss increase" in nats for every run, but a classifier's probes score accuracy and
    its forgetting is a drop in accuracy (monitor.tracker.RunTracker.probed): a classifier run (one that
    exports streamer_accuracy) is drawn as a ratio, any other's in nats, and the description names both."""
    panel = next(p for p in build_dashboard()["panels"] if p["title"] == "Forgetting per class")
    units = {o["matcher"]["options"]: prop["value"] for o in panel["fieldConfig"]["overrides"]
             for prop in o["properties"] if prop["id"] == "unit"}
    by_unit = {units.get(t["refId"], panel["fieldConfig"]["defaults"]["unit"]): t["expr"] for t in panel["targets"]}
    assert set(by_unit) == {"suffix: nats", "percentunit"}, by_unit
    classifier = 'on (run, strategy) streamer_accuracy{run=~"$run", strategy=~"$strategy"}'
    accuracy_drop, loss_increase = by_unit["percentunit"], by_unit["suffix: nats"]
    assert accuracy_drop.startswith("streamer_forgetting{") and f"and {classifier}" in accuracy_drop
    assert loss_increase.startswith("streamer_forgetting{") and f"unless {classifier}" in loss_increase
    assert "loss" in panel["description"] and "accuracy" in panel["description"]


def test_cli_writes_and_checks_the_dashboard(tmp_path, capsys):
    out = tmp_path / "grafana" / "streamer.json"
    assert cmd_monitor(_parse(["monitor", "dashboard", "--out", str(out)])) == 0
    assert out.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8")
    assert cmd_monitor(_parse(["monitor", "dashboard", "--check", "--out", str(out)])) == 0
    out.write_text(out.read_text(encoding="utf-8").replace("Perplexity of the run", "Perplexity of a run"), encoding="utf-8")
    capsys.readouterr()
    assert cmd_monitor(_parse(["monitor", "dashboard", "--check", "--out", str(out)])) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differs" in err and "streamer monitor dashboard" in err
    assert cmd_monitor(_parse(["monitor", "dashboard", "--check", "--out", str(tmp_path / "none.json")])) == 1
    assert "is missing" in capsys.readouterr().err


def _key_lines(path: Path) -> dict[str, str]:
    """`key: value` pairs of a small YAML file, ignoring nesting (PyYAML is not a dependency)."""
    pairs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\s*(?:- )?([A-Za-z]+):\s*(.*?)\s*$", line)
        if match and not line.lstrip().startswith("#"):
            pairs[match.group(1)] = match.group(2)
    return pairs


def test_provisioning_files_name_the_datasource_and_dashboard_folder():
    datasource = PROVISIONING / "datasources" / "prometheus.yml"
    dashboards = PROVISIONING / "dashboards" / "streamer.yml"
    for path in (datasource, dashboards):
        text = path.read_text(encoding="utf-8")
        assert "\t" not in text, f"{path}: YAML must not contain tabs"
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        ds = yaml.safe_load(datasource.read_text())["datasources"][0]
        provider = yaml.safe_load(dashboards.read_text())["providers"][0]
        assert (ds["uid"], ds["type"], ds["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
        assert (provider["type"], provider["options"]["path"]) == ("file", "/var/lib/grafana/dashboards")
    ds_keys, provider_keys = _key_lines(datasource), _key_lines(dashboards)
    assert ds_keys["apiVersion"] == "1" and "datasources" in ds_keys
    assert (ds_keys["uid"], ds_keys["type"], ds_keys["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
    assert provider_keys["apiVersion"] == "1" and "providers" in provider_keys
    assert (provider_keys["type"], provider_keys["path"]) == ("file", "/var/lib/grafana/dashboards")


def test_legends_and_groupings_name_labels_the_metrics_have():
    labels = {f"streamer_{name}": set(names) for name, _, names, _ in CATALOGUE}
    labels.update({f"{name}{suffix}": names | ({"le"} if suffix == "_bucket" else set())
                   for name, names in list(labels.items()) for suffix in ("_bucket", "_sum", "_count")})
    for panel in build_dashboard()["panels"]:
        for target in panel.get("targets", []):
            metrics = {m for m, _ in SELECTOR.findall(target["expr"]) if m in labels}
            available = set().union(*(labels[m] for m in metrics)) if metrics else set()
            used = set(re.findall(r"{{(\w+)}}", target["legendFormat"]))
            for group in re.findall(r"by \(([^)]*)\)", target["expr"]):
                used |= {label.strip() for label in group.split(",")}
            assert used <= available, (panel["title"], target["expr"], used - available)


def test_the_default_path_is_the_checkouts_from_any_folder(tmp_path, monkeypatch, capsys):
    """Run from another folder, `monitor dashboard --check` said the committed file was missing (and
    without --check it wrote a new deploy/ tree there)."""
    monkeypatch.chdir(tmp_path)
    assert cmd_monitor(_parse(["monitor", "dashboard", "--check"])) == 0
    assert capsys.readouterr().out == f"{COMMITTED} is up to date\n" and list(tmp_path.iterdir()) == []
