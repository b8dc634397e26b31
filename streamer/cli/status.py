"""`streamer status RUN_DIR`: what a learner's console shows, for a learner running elsewhere.

Read from its run directory (config.json, the .lock's pid alive or not, checkpoint.pt's age, the
last line of losses.jsonl, status.json: the console's latest snapshot, written every few seconds)
and from its metrics endpoint when it serves one (the address in config.json; over HTTPS, trusting the
learner's own certificate, and with its basic-auth credentials when its --metrics-tls-cert and
--metrics-auth-file, recorded there as paths, are readable here). Torch-free.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from streamer.cli.errors import UserError
from streamer.cli.flags import positive_float

__all__ = ["add_parser", "run", "run_status"]

_SHOWN_METRICS = {  # sample name -> what it is called here
    "streamer_batches_learned_total": "batches", "streamer_tokens_per_second": "tokens/s",
    "streamer_consumer_lag_records": "lag", "streamer_queue_depth": "queue",
    "streamer_run_dead_letters": "dead letters", "streamer_checkpoint_age_seconds": "checkpoint age",
    "streamer_ready": "ready", "streamer_rolling_perplexity": "rolling ppl",
}


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="what a learner's console shows, from its run directory and metrics endpoint")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the learner's run directory (learn's default: runs/<topic>-<group>)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text (default: text)")
    p.add_argument("--timeout", type=positive_float, default=2.0,
                   help="seconds to wait for the metrics endpoint (default %(default)s s)")


def run(args) -> int:
    status = run_status(args.run_dir, timeout_s=args.timeout)  # the monitor's modules: imported here, not for --help
    if args.json:
        from monitor.files import json_safe

        print(json.dumps(json_safe(status), default=str, allow_nan=False))  # strict JSON: a diverged run's "inf"
    else:
        _print(status)
    return 0


def run_status(run_dir: Path, timeout_s: float = 2.0) -> dict:
    """Everything `streamer status` prints, as plain values."""
    from monitor.console import STATUS_FILE, read_status, snapshot_to_json
    from monitor.files import learner_process

    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise UserError(f"{run_dir} is not a run directory (no config.json): give the --run-dir of a learner")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {config_path}: {exc}") from None
    snapshot = read_status(run_dir / STATUS_FILE)
    now = time.time()
    return {
        "run_dir": str(run_dir), "learner": learner_process(run_dir),
        "config": {key: config.get(key) for key in ("topic", "group_id", "strategy", "model_name", "bootstrap_servers",
                                                    "device", "started", "run_started", "metrics_address",
                                                    "oracle")},
        "checkpoint_age_s": _age(run_dir / "checkpoint.pt", now),
        "last_batch": _last_line(run_dir / "losses.jsonl"),
        "status_age_s": _age(run_dir / STATUS_FILE, now),
        "status": None if snapshot is None else snapshot_to_json(snapshot),
        "reported": (run_dir / "results.json").is_file(),  # the run's report: it is over (compare's runs)
        "metrics": _scrape(_metrics_url(config), timeout_s, config.get("metrics_security") or {}),
    }


def _age(path: Path, now: float) -> float | None:
    try:
        return max(0.0, now - path.stat().st_mtime)
    except OSError:
        return None


def _last_line(path: Path, tail_bytes: int = 65536) -> dict | None:
    """The last complete line of the loss log (read from its end)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - tail_bytes))
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written, or the cut first line of the tail
        return {key: row.get(key) for key in ("batch", "loss", "domain_name", "time")}
    return None


def _metrics_url(config: dict) -> str | None:
    address = config.get("metrics_address")
    if address is None and config.get("metrics_port"):  # a fixed port (0: chosen at start, noted as the address)
        address = f"{config.get('metrics_host') or '127.0.0.1'}:{config['metrics_port']}"
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    scheme = "https" if (config.get("metrics_security") or {}).get("cert_file") else "http"
    return f"{scheme}://{host}:{port}/metrics"


def _scrape(url: str | None, timeout_s: float, security: dict) -> dict:
    """The shown metrics summed over their series (lag and dead letters per label), or why not. `security`:
    the learner's MetricsSecurity as config.json holds it (its certificate is trusted as its own CA; its
    credentials file is read for basic auth)."""
    if url is None:
        return {"url": None, "error": "not served (the learner ran without --metrics-port)"}
    from prometheus_client.parser import text_string_to_metric_families

    from monitor.exporter import STATUS_AGENT
    from monitor.web_security import read_credentials

    if security.get("client_ca_file"):
        return {"url": url, "error": "not read: it asks scrapers for a client certificate (--metrics-tls-client-ca)"}
    request = urllib.request.Request(url, headers={"User-Agent": STATUS_AGENT})  # not Prometheus: see the exporter
    context = None
    try:
        if security.get("cert_file"):  # its own certificate the one trusted: any name it was made for will do
            context = ssl.create_default_context(cafile=security["cert_file"])
            context.check_hostname = False
        if security.get("auth_file"):
            credentials = ":".join(read_credentials(security["auth_file"])).encode()
            request.add_header("Authorization", "Basic " + base64.b64encode(credentials).decode())
    except (OSError, ValueError) as exc:  # (a file of the learner's this user cannot read)
        return {"url": url, "error": f"not read: {exc}"}
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            text = response.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", exc)
        return {"url": url, "error": f"unreachable ({reason})"}
    values: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _SHOWN_METRICS.get(sample.name)
            if name == "lag":
                values.setdefault(name, {})[sample.labels.get("partition", "?")] = int(sample.value)
            elif name == "dead letters":
                values.setdefault(name, {})[sample.labels.get("reason", "?")] = int(sample.value)
            elif name is not None:
                values[name] = values.get(name, 0) + sample.value
    return {"url": url, "values": values}


def _print(status: dict) -> None:
    from monitor.view import duration

    learner, config = status["learner"], status["config"]
    if learner["running"]:
        state = f"learner running (pid {learner['pid']})"
    else:
        state = "no learner running" + (f" (pid {learner['pid']} is gone)" if learner["pid"] else "")
    print(f"{status['run_dir']}: {state}")
    started, run_started = config.get("started"), config.get("run_started")

    def at(when: float) -> str:
        return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))
    print(f"topic {config['topic']}, group {config['group_id']}, strategy {config['strategy']}, "
          f"model {config['model_name']}, broker {config['bootstrap_servers']}, device {config['device']}"
          + (f"; started {at(started)}" if started else "")
          + (f" (the run: {at(run_started)})" if started and run_started and run_started < started - 1 else ""))
    age = status["checkpoint_age_s"]
    print("checkpoint: " + (f"written {duration(age)} ago" if age is not None
                            else "none (the run is over: its report is results.json)"
                            if status.get("reported") and not learner["running"]
                            else "none yet"))
    last = status["last_batch"]
    if last:
        when = f" at {time.strftime('%H:%M:%S', time.localtime(last['time']))}" if last.get("time") else ""
        print(f"loss log: {last['batch'] + 1:,} batches; the last{when}: loss {last['loss']:.3f}, "
              f"class {last['domain_name']}")
    else:
        print("loss log: no batch yet")
    _print_metrics(status["metrics"], last["batch"] + 1 if last else None)
    _print_console(status)


def _print_metrics(metrics: dict, logged: int | None = None) -> None:
    """The scraped values in one line; `logged`: the loss log's batches (a crash's restart starts the
    counters at 0, and the batch counter then counts this learner's own)."""
    from monitor.view import duration

    if "values" not in metrics:
        print(f"metrics: {metrics['url'] + ' ' if metrics['url'] else ''}{metrics['error']}")
        return
    values = metrics["values"]
    formats = {"batches": "{:,.0f}", "tokens/s": "{:,.0f}", "rolling ppl": "{:.2f}", "queue": "{:.0f}",
               "ready": "{:.0f}"}
    parts = [f"{name} {fmt.format(values[name])}" for name, fmt in formats.items() if name in values]
    if "batches" in values and logged is not None and values["batches"] < logged:
        parts[0] += " (since this learner's start: a restart after a crash starts the counters at 0)"
    if "checkpoint age" in values:
        parts.append(f"checkpoint age {duration(values['checkpoint age'])}")
    for name in ("lag", "dead letters"):
        shown = {key: count for key, count in values.get(name, {}).items() if count or name == "lag"}
        if shown:  # (every dead-letter reason is exported, at 0 until its first)
            parts.append(f"{name} " + ", ".join(f"{key} {count:,}" for key, count in sorted(shown.items())))
    print(f"metrics {metrics['url']}: " + "; ".join(parts))


def _print_console(status: dict) -> None:
    """The console's last snapshot: the live view's panel on a terminal, its plain line elsewhere."""
    from rich.console import Console

    from monitor.console import snapshot_from_json
    from monitor.view import duration, plain_line, render

    if status["status"] is None:  # (why not, it cannot tell: an offline run's, or one removed)
        print("console: no status.json (the run's report is results.json)"
              if status.get("reported") else "console: no status.json yet (the learner writes it every few seconds)")
        return
    # the checkpoint's age now, not when the snapshot was written; none without checkpoint.pt (compare deletes a
    # finished run's: its snapshot's age was shown, stale, below "checkpoint: none")
    snapshot = snapshot_from_json(status["status"])  # (one written before snapshots said `oracle`: config.json's)
    snapshot = replace(snapshot, checkpoint_age_s=status["checkpoint_age_s"],
                       oracle=snapshot.oracle or bool(status["config"].get("oracle")))
    stale = "" if status["learner"]["running"] else " (its last state: the learner is not running)"
    print(f"console, written {duration(status['status_age_s'])} ago{stale}:")
    console = Console(highlight=False)
    if console.is_terminal:
        console.print(render(snapshot))
    else:
        print(plain_line(snapshot))
