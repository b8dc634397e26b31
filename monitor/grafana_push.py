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

A switch is posted once per process: each (Grafana URL, loss log) pair keeps where
it read to and the last batch it read, so a second push of the same file, a --follow
that re-reads it, or one across a restart of the learner (which learns the batches
after its checkpoint again), posts only new switches.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from monitor.files import learner_process
from monitor.losslog import loss_log_files

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
    """Reads a growing loss log (its rotated files too: monitor.losslog) from where it stopped; only
    whole lines count.

    A log written again from an earlier point is read again from the file that held the point read: a
    resume cuts the log back to its checkpoint and learns those batches again, a crash before the first
    checkpoint starts it over. A batch at or before the last one read (`through`) is not posted again (a
    follow posted each switch up to a kill -9 twice); another run in the directory (a new
    ``run_started`` in its config.json: ``learn --fresh``) is posted anew."""

    path: Path
    lines: int = 0
    previous: dict | None = None
    skipped: int = 0
    through: int = -1  # the last batch read: its switches are posted
    _at: tuple | None = None  # (device, inode, offset, last line read) of the file read last
    _run: object = None  # the run's run_started (config.json)

    def poll(self) -> list[dict]:
        """Annotation payloads for the lines written since the last poll."""
        run = _run_started(self.path.parent)
        if run is not None and self._run is not None and run != self._run:
            self.previous, self.through, self._at = None, -1, None
        self._run = run if run is not None else self._run
        files = [file for file in loss_log_files(self.path) if file.is_file()]
        first, offset = self._where(files)
        annotations: list[dict] = []
        for file in files[first:]:
            try:
                with open(file, "rb") as handle:
                    identity = os.fstat(handle.fileno())
                    handle.seek(offset)
                    chunk = handle.read()
            except FileNotFoundError:  # rotated or cut meanwhile: the next poll finds it
                break
            end = chunk.rfind(b"\n")
            if end < 0:  # nothing whole yet: a line being written ends the live file; a rotated file read to its
                if file == files[-1]:  # end goes on to the next (it stopped there, and the follow with it)
                    break
                offset = 0
                continue
            lines = chunk[: end + 1].splitlines()
            for raw in lines:
                annotations.extend(self._read(raw))
            self._at = (identity.st_dev, identity.st_ino, offset + end + 1, lines[-1])
            offset = 0
        return annotations

    def _where(self, files: list[Path]) -> tuple[int, int]:
        """(file index, offset) to read on from: after the last line read when it is still there, else
        the start of the file that held it (cut back in place), else of the oldest file."""
        if self._at is None:
            return 0, 0
        device, inode, offset, last = self._at
        for index, file in enumerate(files):
            try:
                with open(file, "rb") as handle:
                    identity = os.fstat(handle.fileno())
                    if (identity.st_dev, identity.st_ino) != (device, inode):
                        continue
                    handle.seek(max(0, offset - len(last) - 1))
                    same = handle.read(len(last) + 1) == last + b"\n"
            except FileNotFoundError:
                continue
            return (index, offset) if same else (index, 0)
        return 0, 0

    def _read(self, raw: bytes) -> list[dict]:
        self.lines += 1
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or "sequence" not in record:
            self.skipped += 1
            return []
        batch = record.get("batch")
        numbered = isinstance(batch, int) and not isinstance(batch, bool)
        if numbered and batch <= self.through:  # learned again after a restart: posted already
            self.previous = record
            return []
        annotations = switch_annotations(self.previous, record)
        self.previous = record
        if numbered:
            self.through = batch
        return annotations


def _run_started(run_dir: Path):
    """The run's start (config.json's run_started; a resumed run keeps it), or None."""
    try:
        return json.loads((run_dir / "config.json").read_text(encoding="utf-8")).get("run_started")
    except (OSError, ValueError, AttributeError):
        return None


def _learner_stopped(run_dir: Path) -> bool:
    """Whether the run's learner has stopped: no live learner holds the directory, and its status.json
    says stopped (a learner killed with -9 left another activity there: a follow waits for its restart),
    or, for a run without one, its results.json is written."""
    from monitor.console import STATUS_FILE, read_status

    if learner_process(run_dir)["running"]:
        return False
    status = read_status(run_dir / STATUS_FILE)
    if status is None:  # a run that writes none (compare's multitask) is over once its report is written
        return (run_dir / "results.json").exists()
    return status.activity == "stopped"


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
    """The cause where urllib3 wraps one ("...(Caused by NewConnectionError('<...HTTPConnection object at
    0x...>: CAUSE'))", or ConnectTimeoutError(<...>, 'CAUSE')): cut at 200 characters, it ended at "Failed
    to esta", or at the object, before the cause), else the first line; at most 200 characters."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    cause = re.search(r"object at 0x[0-9a-fA-F]+>(?:: |, [\"'])(.*?)[\"']\)+$", text)
    return (cause.group(1) if cause else text)[:200]


def push(url: str, credential: str | tuple[str, str], *, run_dir: Path | None = None, follow: bool = False,
         dashboard: dict | None = None, poll_s: float = POLL_S, timeout: float = 5.0,
         log: Callable[[str], None] = lambda message: None) -> PushSummary:
    """Upload the dashboard; then post switch annotations from `run_dir`/losses.jsonl.

    With `follow`, keep tailing the log every `poll_s` seconds until the run's learner stops (no learner
    holds the directory and its status.json says stopped; results.json, the sign before, is there from
    an earlier stop of a resumed run, or from a report); Ctrl-C (KeyboardInterrupt) also stops it.
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
        finished = _learner_stopped(run_dir)  # checked before reading: the last lines are in
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
