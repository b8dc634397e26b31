"""The Prometheus config, recording rules and alerts under deploy/prometheus, checked by promtool.

promtool and prometheus come from Debian's prometheus package, which `./dev setup`
installs; without them these tests fail with one line naming `./dev setup`.
"""

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.prometheus_util import query, start_prometheus, stop

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
CONFIG = DEPLOY / "prometheus.yml"
RULES = DEPLOY / "rules.yml"
RULES_TEST = DEPLOY / "rules_test.yml"


@pytest.fixture(scope="module")
def promtool(prometheus_binaries):
    """promtool(*args) -> the completed run, in deploy/prometheus."""
    _, binary = prometheus_binaries

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [binary, *args], cwd=DEPLOY, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60
        )
    return run


def test_config_is_valid_and_loads_the_rules(promtool):
    result = promtool("check", "config", str(CONFIG))
    assert result.returncode == 0, result.stdout
    assert "1 rule files found" in result.stdout


def test_rules_are_valid(promtool):
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout


def test_rule_unit_tests_pass(promtool):
    result = promtool("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout
    assert "SUCCESS" in result.stdout


def alert_names(rules_text: str) -> set[str]:
    return set(re.findall(r"^\s*-\s*alert:\s*(\w+)\s*$", rules_text, flags=re.MULTILINE))


def alert_cases(test_text: str) -> tuple[set[str], set[str]]:
    """(alerts expected to fire, alerts expected silent) in a promtool test file.

    PyYAML is not a dependency, so this reads the layout rules_test.yml keeps:
    `alertname: X` directly above `exp_alerts: []` (silent) or `exp_alerts:`
    followed by a list (firing).
    """
    firing, silent = set(), set()
    for name, rest in re.findall(r"^\s*alertname:\s*(\w+)\s*\n\s*exp_alerts:(.*)$", test_text, flags=re.MULTILINE):
        (silent if rest.strip() == "[]" else firing).add(name)
    return firing, silent


def test_every_alert_has_a_firing_and_a_silent_case():
    names = alert_names(RULES.read_text(encoding="utf-8"))
    assert names >= {
        "StreamerSwitchSpike",
        "StreamerLearnerStalled",
        "StreamerConsumerLagGrowing",
        "StreamerLossNotFinite",
        "StreamerExporterDown",
    }
    firing, silent = alert_cases(RULES_TEST.read_text(encoding="utf-8"))
    assert names - firing == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested silent"
    assert firing | silent <= names, "rules_test.yml tests alerts that rules.yml lacks"


def test_every_alert_has_severity_summary_and_description():
    blocks = re.split(r"^\s*-\s*(?=alert:|record:)", RULES.read_text(encoding="utf-8"), flags=re.MULTILINE)
    alerts = [block for block in blocks if block.startswith("alert:")]
    assert len(alerts) == len(alert_names(RULES.read_text(encoding="utf-8")))
    for block in alerts:
        for field in ("severity:", "summary:", "description:"):
            assert field in block, f"{block.splitlines()[0]} lacks {field}"


def test_a_running_prometheus_loads_the_rules_and_misses_the_exporter(prometheus_binaries, tmp_path):
    """No streamer target at all: the absent() branch of StreamerExporterDown goes pending."""
    config = f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {RULES}
"""
    process, base_url = start_prometheus(config, tmp_path)
    try:
        deadline = time.monotonic() + 15
        pending = []
        while not pending and time.monotonic() < deadline:
            pending = query(base_url, 'ALERTS{alertname="StreamerExporterDown"}')
            time.sleep(0.2)
        assert [alert["metric"]["alertstate"] for alert in pending] == ["pending"]
        assert pending[0]["metric"]["job"] == "streamer"
        assert query(base_url, "streamer:batches_per_second") == []
    finally:
        stop(process)
    assert process.returncode is not None


def test_a_running_prometheus_keeps_the_process_start_that_learner_stalled_reads(prometheus_binaries, tmp_path):
    """StreamerLearnerStalled stays silent while the learner's process is under 2 minutes old (a restart
    that re-joins its group with a batch queued): it reads the start from streamer_batches_learned_created,
    which prometheus_client exports beside the counter; this Prometheus must keep that series."""
    from monitor.exporter import create_metrics, serve
    from monitor.sink import PrometheusSink

    metrics = create_metrics()
    PrometheusSink(metrics, "r", "naive")  # the learner's sink exports the counter at 0 from its start
    server, _ = serve(metrics, 0)
    config = f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{RULES}]
scrape_configs:
  - job_name: streamer
    static_configs: [{{targets: ["127.0.0.1:{server.server_address[1]}"]}}]
"""
    process, base_url = start_prometheus(config, tmp_path)
    try:
        deadline, age = time.monotonic() + 15, []
        while not age and time.monotonic() < deadline:
            age = query(base_url, 'time() - streamer_batches_learned_created{run="r",strategy="naive"}')
            time.sleep(0.2)
        assert age and 0 <= float(age[0]["value"][1]) < 60, age
        assert "streamer_batches_learned_created" in RULES.read_text(encoding="utf-8")
    finally:
        stop(process)
        server.shutdown()


def test_the_readme_counts_the_alerts_rules_yml_has():
    """The README's compose table said "the six alerts below" when rules.yml had seven."""
    readme = (DEPLOY.parents[1] / "README.md").read_text(encoding="utf-8")
    words = ("one two three four five six seven eight nine ten eleven twelve").split()
    counts = {word: n for n, word in enumerate(words, start=1)} | {str(n): n for n in range(1, 13)}
    said = [counts[word.lower()] for word in re.findall(r"\b(\w+) alerts\b", " ".join(readme.split()))
            if word.lower() in counts]
    assert all(n == len(alert_names(RULES.read_text(encoding="utf-8"))) for n in said), said


def test_the_readme_says_what_each_alert_says():
    readme = (DEPLOY.parents[1] / "README.md").read_text(encoding="utf-8")
    paragraph = readme.split("Prometheus alerts (`deploy/prometheus/rules.yml`")[1].split("\n\n")[0]
    rules = RULES.read_text(encoding="utf-8")
    assert alert_names(rules) == set(re.findall(r"\b(Streamer[A-Za-z]+)\s+\(", paragraph))
    # the numbers in the alerts' expressions and texts are the README's
    assert "> 1.2 * streamer_previous_fragment_loss_nats" in rules
    assert "1.2 x the mean loss of the class's previous fragment" in " ".join(paragraph.split())
    assert "learned no batch for 2 minutes" in rules and "[2m]" in rules and "no batch learned for 2 minutes" in paragraph
    assert "consumer lag\nabove zero" in paragraph or "consumer lag above zero" in paragraph.replace("\n", " ")
    assert "streamer_queue_depth) > 0" in rules and "queue depth above zero" in " ".join(paragraph.split())
