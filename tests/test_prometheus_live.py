"""A real Prometheus scrapes a real learner on the embedded broker; every dashboard panel's
query returns data through Prometheus's HTTP API, and the switch spike shows."""

import asyncio
import threading
import time

from aiokafka import AIOKafkaProducer

from monitor.dashboard import panel_queries
from monitor.exporter import create_metrics, serve
from monitor.live import LiveMonitor
from producers.kafka import produce
from streamer.config import LearnConfig
from streamer.learner import run as run_learner
from tests.helpers import TINY, small_stream
from tests.prometheus_util import query, query_range, start_prometheus, stop

CORPUS = {"en": "hello world, how are you today " * 400, "fr": "bonjour le monde, ça va bien " * 400,
          "cs": "ahoj světe, jak se dnes máš " * 400}
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


class SlowMonitor(LiveMonitor):
    """Stretches the run (266 batches) over several 1-s scrapes, and at the `hold_at` counts of
    learned batches holds until Prometheus has scraped that count: a scrape that comes late or
    times out on a loaded host (the exporter shares the learner's GIL) cannot merge the run's
    values into one or two samples."""

    def __init__(self, *, base: str, hold_at=(), **kwargs):
        super().__init__(**kwargs)
        self.base, self.hold_at, self.seen = base, set(hold_at), 0

    def observe(self, result):
        time.sleep(0.01)
        line = super().observe(result)
        self.seen += 1
        if self.seen in self.hold_at:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                scraped = query(self.base, 'streamer_batches_learned_total{run="live"}')
                if scraped and float(scraped[0]["value"][1]) >= self.seen:
                    break
                time.sleep(0.1)
        return line


def _substitute(expr: str) -> str:
    """Grafana's template variables, as the dashboard would fill them for 'All'."""
    return (expr.replace("$__rate_interval", "1m").replace("$__interval", "5s")
            .replace("$run", ".*").replace("$strategy", ".*"))


def test_every_panel_query_returns_data_from_a_scraped_run(broker, tmp_path, prometheus_binaries):
    # 8 fragments, e c e f c e c f: 5 revisits; the last revisit of cs ends the run 1.09 times
    # above cs's mean loss, so the spike is in the final values that are scraped for 3 s
    records, manifest = small_stream(CORPUS, fragments=8, mean_tokens=600, streams=3, window=10, seed=4)

    async def produce_with_a_bad_record():
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
        await producer.start()
        await producer.send_and_wait("scraped-live", key=b"0", value=b"\xff broken")
        await producer.stop()
        await produce(records, broker.bootstrap_servers, "scraped-live")
    asyncio.run(produce_with_a_bad_record())

    metrics = create_metrics()
    server, _ = serve(metrics, 0)
    port = server.server_address[1]
    rules = (ROOT / "deploy/prometheus/rules.yml").read_text()
    (tmp_path / "rules.yml").write_text(rules)
    config = f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{tmp_path / 'rules.yml'}]
scrape_configs:
  - job_name: streamer
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""
    process, base = start_prometheus(config, tmp_path)
    try:
        learn_config = LearnConfig(
            bootstrap_servers=broker.bootstrap_servers, topic="scraped-live", group_id="scraped-live-g",
            run_dir=tmp_path / "run", run_name="live", streams=3, window=10, model=TINY, device="cpu",
            total_batches=manifest["total_batches"], classes=tuple(manifest["classes"]), idle_timeout_s=30)
        total = manifest["total_batches"]
        monitor = SlowMonitor(run="live", strategy="naive", classes=learn_config.classes, metrics=metrics,
                              base=base, hold_at=(total // 3, 2 * total // 3))
        started = time.time()
        thread = threading.Thread(target=lambda: asyncio.run(run_learner(learn_config, monitor=monitor)))
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive()
        time.sleep(3)  # a few scrapes of the final values
        # the run itself was scraped several times: the counter moved between scrapes
        moved = query(base, 'changes(streamer_batches_learned_total{run="live"}[5m])')
        assert moved and float(moved[0]["value"][1]) >= 2, moved

        missing = []  # over the run's time range, as the dashboard draws them
        for title, expr, optional in panel_queries():
            if optional:
                continue
            if not query_range(base, _substitute(expr), started, time.time(), 1):
                missing.append(f"{title}: {expr}")
        assert not missing, "panels without data:\n" + "\n".join(missing)

        # the spike: right after a revisit the loss is above the class's mean loss
        peaks = query(base, 'max_over_time(streamer:switch_spike_ratio:by_class{run="live"}[5m])')
        assert peaks and max(float(p["value"][1]) for p in peaks) > 1.0
        after = query(base, 'max_over_time(streamer_loss_after_switch_mean{run="live",class="all"}[5m])')
        overall = query(base, 'avg_over_time(streamer_batch_loss{run="live"}[5m])')
        assert float(after[0]["value"][1]) > min(float(o["value"][1]) for o in overall)
    finally:
        stop(process)
        server.shutdown()
