"""Upload the dashboard to a Grafana the user already runs; optionally post switch annotations.

The dashboard needs neither: in the compose stack Grafana provisions it from
deploy/grafana/, and its switch markers come from Prometheus annotation queries on
streamer_switch_timestamp_seconds (monitor/dashboard.py), with no extra process and
no credentials. `streamer monitor push` is for a Grafana outside the stack: it uploads
the dashboard (POST /api/dashboards/db, overwrite) through grafana-client, after GET
/api/health so an unreachable Grafana is one clear line. With a run directory it also
posts one annotation per switch of the run's loss log (POST /api/annotations), for
runs Prometheus never scraped; the dashboard's "Pushed ... (monitor push)" annotation
queries, off by default, draw them by tag: ["streamer", "switch", "true",
"class:<new class>"] for a true switch (the `sequence` changes between consecutive
lines) and ["streamer", "switch", "detected"] for a line with ``"detected_switch": true``.

A switch is posted once per process: each (Grafana URL, loss log) pair keeps the
byte offset and the last record it has read, so a second push of the same file,
or a --follow that re-reads it, posts only new switches.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PushError", "PushSummary", "SwitchTail", "load_credentials", "push", "switch_annotations"]

CREDENTIAL_KEYS = ("GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD")
ENV_HINT = "set GRAFANA_TOKEN, or GRAFANA_USER and GRAFANA_PASSWORD (environment or --credentials-file)"
POLL_S = 1.0


class PushError(RuntimeError):
    """Grafana cannot be reached, refuses us, or the run directory is unusable; one line."""


def _read_credentials_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PushError(f"cannot read credentials file {path}: {exc.strerror or exc}") from None
    if text.lstrip().startswith("{"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PushError(f"credentials file {path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
        if not isinstance(values, dict):
            raise PushError(f"credentials file {path} must hold a JSON object")
        return {str(k): str(v) for k, v in values.items()}
    values = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep:
            raise PushError(f"credentials file {path} line {number}: expected KEY=VALUE")
        values[key.strip()] = value.strip().strip("'\"")
    return values


def load_credentials(environ: Mapping[str, str], credentials_file: Path | None = None) -> str | tuple[str, str]:
    """A bearer token or (user, password): from `credentials_file` when given, else from `environ`."""
    source = _read_credentials_file(credentials_file) if credentials_file is not None else environ
    values = {key: source.get(key, "") for key in CREDENTIAL_KEYS}
    if values["GRAFANA_TOKEN"]:
        return values["GRAFANA_TOKEN"]
    if values["GRAFANA_USER"] and values["GRAFANA_PASSWORD"]:
        return values["GRAFANA_USER"], values["GRAFANA_PASSWORD"]
    where = f"in {credentials_file}" if credentials_file is not None else "in the environment"
    raise PushError(f"no Grafana credentials {where}: {ENV_HINT}")


def switch_annotations(previous: dict | None, record: dict) -> list[dict]:
    """Annotation payloads (Grafana's POST /api/annotations body) for `record`, given the line before it."""
    if "time" not in record:
        return []
    time_ms = int(round(float(record["time"]) * 1000))  # the loss log's time is epoch seconds
    batch = record.get("batch", "?")
    new_class = record.get("domain_name", record.get("domain"))
    annotations = []
    if previous is not None and record.get("sequence") != previous.get("sequence"):
        old_class = previous.get("domain_name", previous.get("domain"))
        annotations.append({
            "time": time_ms, "timeEnd": time_ms,
            "tags": ["streamer", "switch", "true", f"class:{new_class}"],
            "text": f"switch {old_class} -> {new_class} (fragment {record.get('sequence')}, batch {batch})",
        })
    if record.get("detected_switch") is True:
        annotations.append({
            "time": time_ms, "timeEnd": time_ms, "tags": ["streamer", "switch", "detected"],
            "text": f"drift detector: switch detected at batch {batch} (true class {new_class})",
        })
    return annotations


@dataclass
class SwitchTail:
    """Reads a growing losses.jsonl from where it stopped; only whole lines count."""

    path: Path
    offset: int = 0
    lines: int = 0
    previous: dict | None = None
    skipped: int = field(default=0)

    def poll(self) -> list[dict]:
        """Annotation payloads for the lines written since the last poll."""
        try:
            with open(self.path, "rb") as file:
                if file.seek(0, 2) < self.offset:  # truncated: a new run in the same directory
                    self.offset, self.previous = 0, None
                file.seek(self.offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        annotations = []
        for raw in chunk[: end + 1].splitlines():
            self.lines += 1
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict) or "sequence" not in record:
                self.skipped += 1
                continue
            annotations.extend(switch_annotations(self.previous, record))
            self.previous = record
        self.offset += end + 1
        return annotations


@dataclass
class PushSummary:
    url: str
    dashboard_url: str | None = None
    true_switches: int = 0
    detected_switches: int = 0
    lines: int = 0

    def __str__(self) -> str:
        where = self.dashboard_url or "/d/streamer"
        return (f"dashboard streamer uploaded to {self.url} ({where}); annotations posted: "
                f"{self.true_switches} true switches, {self.detected_switches} detected; "
                f"{self.lines} loss log lines read")


_TAILS: dict[tuple[str, str], SwitchTail] = {}  # per process: never post a switch twice


def _api(url: str, credential: str | tuple[str, str], timeout: float):
    from grafana_client import GrafanaApi

    try:
        return GrafanaApi.from_url(url, credential=credential, timeout=timeout)
    except (ValueError, TypeError) as exc:
        raise PushError(f"bad Grafana URL {url!r}: {exc}") from None


def _call(url: str, what: str, request: Callable[[], object]):
    """Run one grafana-client request; its failures become one-line PushErrors naming `url`."""
    import niquests
    from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

    try:
        return request()
    except GrafanaUnauthorizedError:
        raise PushError(f"Grafana at {url} refused the credentials (401) while {what}; {ENV_HINT}") from None
    except GrafanaClientError as exc:
        raise PushError(f"Grafana at {url} rejected {what}: {exc.message}") from None
    except GrafanaException as exc:
        if exc.status_code:
            raise PushError(f"Grafana at {url} failed {what}: {exc.message}") from None
        raise PushError(f"cannot reach Grafana at {url} ({_short(exc)})") from None
    except niquests.exceptions.RequestException as exc:
        raise PushError(f"cannot reach Grafana at {url} ({_short(exc)})") from None


def _short(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def push(url: str, credential: str | tuple[str, str], *, run_dir: Path | None = None, follow: bool = False,
         dashboard: dict | None = None, poll_s: float = POLL_S, timeout: float = 5.0,
         log: Callable[[str], None] = lambda message: None) -> PushSummary:
    """Upload the dashboard; then post switch annotations from `run_dir`/losses.jsonl.

    With `follow`, keep tailing the log every `poll_s` seconds until `run_dir`/results.json
    exists (the learner writes it at the end); Ctrl-C (KeyboardInterrupt) also stops it.
    """
    from monitor.dashboard import DASHBOARD_UID, build_dashboard

    api = _api(url, credential, timeout)
    _call(url, "the health check", lambda: api.client.GET("/health"))
    body = {"dashboard": dashboard if dashboard is not None else build_dashboard(), "overwrite": True,
            "message": "streamer monitor push"}
    answer = _call(url, "the dashboard upload", lambda: api.dashboard.update_dashboard(body))
    summary = PushSummary(url=url, dashboard_url=(answer or {}).get("url") if isinstance(answer, dict) else None)
    log(f"dashboard {DASHBOARD_UID} uploaded to {url}")
    if run_dir is None:
        return summary
    run_dir = Path(run_dir)
    losses = run_dir / "losses.jsonl"
    if not follow and not losses.is_file():
        raise PushError(f"no losses.jsonl in {run_dir}")
    key = (url.rstrip("/"), str(losses.resolve()))
    tail = _TAILS.setdefault(key, SwitchTail(losses))
    while True:
        finished = (run_dir / "results.json").exists()  # checked before reading: the last lines are in
        for payload in tail.poll():
            _call(url, "an annotation", lambda p=payload: api.annotations.add_annotation(
                dashboard_uid=DASHBOARD_UID, time_from=p["time"], time_to=p["timeEnd"], tags=p["tags"], text=p["text"]))
            if "detected" in payload["tags"]:
                summary.detected_switches += 1
            else:
                summary.true_switches += 1
            log(f"annotation: {payload['text']}")
        summary.lines = tail.lines
        if not follow or finished:
            return summary
        time.sleep(poll_s)
