"""`streamer monitor push` against a local stand-in for Grafana's HTTP API."""

import argparse
import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor import grafana_push
from streamer.cli.monitor import add_monitor_parser, cmd_monitor
from monitor.grafana_push import PushError, load_credentials, push

T0 = 1_700_000_000.25  # epoch seconds of the first batch


class FakeGrafana:
    """Records every request and answers like Grafana's HTTP API does."""

    def __init__(self):
        self.requests = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append({"method": self.command, "path": self.path,
                                      "headers": dict(self.headers.items()), "json": body})
                return body

            def do_GET(self):
                self._record()
                if self.path == "/api/health":
                    self._answer(200, {"commit": "abc", "database": "ok", "version": "11.2.0"})
                else:
                    self._answer(404, {"message": "Not found"})

            def do_POST(self):
                self._record()
                if self.path == "/api/dashboards/db":
                    self._answer(200, {"id": 1, "status": "success", "uid": "streamer", "url": "/d/streamer/streamer",
                                       "version": 1, "slug": "streamer"})
                elif self.path == "/api/annotations":
                    self._answer(200, {"id": len(fake.annotations()), "message": "Annotation added"})
                else:
                    self._answer(404, {"message": "Not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def annotations(self):
        return [r["json"] for r in self.requests if r["method"] == "POST" and r["path"] == "/api/annotations"]

    def dashboards(self):
        return [r for r in self.requests if r["method"] == "POST" and r["path"] == "/api/dashboards/db"]


@pytest.fixture
def grafana():
    fake = FakeGrafana()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def _lines(fragments=(("en", 0), ("fr", 1), ("en", 0)), per_fragment=4, detected_at=(5,)):
    lines = []
    for sequence, (name, domain) in enumerate(fragments):
        for i in range(per_fragment):
            batch = sequence * per_fragment + i
            line = {"loss": 2.0 + i * 0.1, "domain": domain, "domain_name": name, "sequence": sequence,
                    "batch": batch, "tokens": 200, "time": round(T0 + batch * 0.5, 3)}
            if batch in detected_at:
                line["detected_switch"] = True
            lines.append(line)
    return lines


def _write_log(run_dir, lines, mode="w"):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "losses.jsonl", mode, encoding="utf-8") as file:
        file.writelines(json.dumps(line) + "\n" for line in lines)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="streamer")
    add_monitor_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _clear_env(monkeypatch):
    for key in ("GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD"):
        monkeypatch.delenv(key, raising=False)


def test_push_uploads_the_dashboard_and_annotates_each_switch_once(grafana, tmp_path, monkeypatch, capsys):
    _clear_env(monkeypatch)
    monkeypatch.setenv("GRAFANA_TOKEN", "t0ken")
    run_dir = tmp_path / "run"
    _write_log(run_dir, _lines())
    argv = ["monitor", "push", "--grafana-url", grafana.url, "--run-dir", str(run_dir)]
    assert cmd_monitor(_parse(argv)) == 0
    assert "2 true switches, 1 detected" in capsys.readouterr().out

    assert [r["path"] for r in grafana.requests][:2] == ["/api/health", "/api/dashboards/db"]
    assert all(r["headers"]["Authorization"] == "Bearer t0ken" for r in grafana.requests)
    (upload,) = grafana.dashboards()
    assert upload["json"]["overwrite"] is True
    assert upload["json"]["dashboard"]["uid"] == "streamer" and upload["json"]["dashboard"]["panels"]

    annotations = grafana.annotations()
    true_switches = [a for a in annotations if "true" in a["tags"]]
    detected = [a for a in annotations if "detected" in a["tags"]]
    assert len(annotations) == 3 and len(true_switches) == 2 and len(detected) == 1
    for a in annotations:  # Grafana's POST /api/annotations body
        assert a["dashboardUID"] == "streamer"
        assert isinstance(a["time"], int) and a["timeEnd"] == a["time"]
        assert isinstance(a["tags"], list) and all(isinstance(t, str) for t in a["tags"]) and a["text"]
        assert a.get("panelId") is None
    assert [a["time"] for a in true_switches] == [int(round((T0 + 4 * 0.5) * 1000)), int(round((T0 + 8 * 0.5) * 1000))]
    assert [a["tags"] for a in true_switches] == [["streamer", "switch", "true", "class:fr"],
                                                  ["streamer", "switch", "true", "class:en"]]
    assert "en -> fr" in true_switches[0]["text"] and "fr -> en" in true_switches[1]["text"]
    assert detected[0]["tags"] == ["streamer", "switch", "detected"]
    assert detected[0]["time"] == int(round((T0 + 5 * 0.5) * 1000))

    # the same file again in the same process: the dashboard again, no annotation twice
    assert cmd_monitor(_parse(argv)) == 0
    assert len(grafana.dashboards()) == 2 and len(grafana.annotations()) == 3
    # lines appended later: only the new switch
    _write_log(run_dir, _lines(fragments=(("en", 0), ("fr", 1), ("en", 0), ("cs", 2)), per_fragment=4,
                               detected_at=())[12:], mode="a")
    assert cmd_monitor(_parse(argv)) == 0
    new = grafana.annotations()[3:]
    assert [a["tags"][-1] for a in new] == ["class:cs"]


def _learner_stopped(run_dir, activity="stopped"):
    """The status.json a learner writes as it stops (or, with another `activity`, while it runs)."""
    from monitor.console import ConsoleSnapshot, write_status

    write_status(run_dir / "status.json", ConsoleSnapshot(
        run="run", strategy="naive", batches=12, total_batches=None, last_loss=None, rolling_ppl=None,
        recent_losses=(), recent_switches=(), current_class=None, overall={}, per_class={}, from_fragment=0,
        switches=2, detected_switches=1, tokens_per_s=0.0, lag=0, queue_depth=0, dead_letters={}, elapsed_s=1.0,
        activity=activity))


def test_follow_tails_the_log_until_the_learner_stops(grafana, tmp_path):
    """Until the learner's status.json says stopped: the results.json of an earlier stop (a resumed run's) or
    of a report ended a follow at once, while the learner went on."""
    run_dir = tmp_path / "run"
    lines = _lines()
    _write_log(run_dir, lines[:6])
    (run_dir / "results.json").write_text("{}")  # an earlier stop's, and the resumed learner's status
    _learner_stopped(run_dir, activity="consuming")
    with open(run_dir / "losses.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps(lines[6])[:10])  # half a line: not read until it is whole
    seen = []
    done = threading.Event()

    def log(message):
        seen.append(message)
        if "fr -> en" in message:
            done.set()

    def finish_the_run():
        with open(run_dir / "losses.jsonl", "a", encoding="utf-8") as file:
            file.write(json.dumps(lines[6])[10:] + "\n")
        _write_log(run_dir, lines[7:], mode="a")
        done.wait(5)
        _learner_stopped(run_dir)

    writer = threading.Timer(0.2, finish_the_run)
    writer.start()
    summary = push(grafana.url, "tok", run_dir=run_dir, follow=True, poll_s=0.02, log=log)
    writer.join()
    assert (summary.true_switches, summary.detected_switches, summary.lines) == (2, 1, 12)
    assert len(grafana.annotations()) == 3


def _switches(tail):
    return [payload["text"] for payload in tail.poll()]


def test_a_restarted_learner_posts_no_switch_twice_and_a_new_run_posts_its_own(tmp_path):
    """A resume cuts the log back to its checkpoint and writes those batches again (other times); a crash
    before the first checkpoint writes the log anew. A follow took either for a new run and posted every
    switch up to the crash again. A new run (--fresh: another run_started) is posted anew."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"run_started": 1.0}))
    lines = _lines(fragments=(("en", 0), ("fr", 1), ("en", 0), ("cs", 2)), detected_at=())
    _write_log(run_dir, lines[:10])
    tail = grafana_push.SwitchTail(run_dir / "losses.jsonl")
    assert _switches(tail) == ["switch en -> fr (fragment 1, batch 4)", "switch fr -> en (fragment 2, batch 8)"]
    again = [{**line, "time": line["time"] + 100} for line in lines]
    _write_log(run_dir, lines[:6])  # cut back to a checkpoint at batch 6 (in place, as trim_loss_log) ...
    assert _switches(tail) == []
    _write_log(run_dir, again[6:14], mode="a")  # ... and learned again, further
    assert _switches(tail) == ["switch en -> cs (fragment 3, batch 12)"]
    _write_log(run_dir, again[:3])  # a crash before the first checkpoint: the log anew
    assert _switches(tail) == []
    _write_log(run_dir, again[3:16], mode="a")
    assert _switches(tail) == []
    (run_dir / "losses.jsonl").unlink()  # learn --fresh: another run in the directory
    (run_dir / "config.json").write_text(json.dumps({"run_started": 2.0}))
    _write_log(run_dir, lines[:6])
    assert _switches(tail) == ["switch en -> fr (fragment 1, batch 4)"]


def test_the_rotated_files_of_a_log_are_read_and_a_rotation_between_polls_loses_no_line(tmp_path):
    """A daemon's log past 100 MB goes on in losses.jsonl after losses.1.jsonl; push read only losses.jsonl."""
    run_dir = tmp_path / "run"
    lines = _lines(fragments=(("en", 0), ("fr", 1), ("en", 0), ("cs", 2)), detected_at=())
    _write_log(run_dir, lines[:6])
    (run_dir / "losses.jsonl").rename(run_dir / "losses.1.jsonl")
    _write_log(run_dir, lines[6:9])
    tail = grafana_push.SwitchTail(run_dir / "losses.jsonl")
    assert _switches(tail) == ["switch en -> fr (fragment 1, batch 4)", "switch fr -> en (fragment 2, batch 8)"]
    _write_log(run_dir, lines[9:13], mode="a")  # the live file grows, then is rotated before the next poll
    (run_dir / "losses.jsonl").rename(run_dir / "losses.2.jsonl")
    _write_log(run_dir, lines[13:])
    assert _switches(tail) == ["switch en -> cs (fragment 3, batch 12)"]
    assert tail.lines == 16 and tail.through == 15
    # rotated right after a poll read the live file to its end (the writer rotates before a line): read on
    run_dir = tmp_path / "again"
    _write_log(run_dir, lines[:9])
    tail = grafana_push.SwitchTail(run_dir / "losses.jsonl")
    assert len(_switches(tail)) == 2
    (run_dir / "losses.jsonl").rename(run_dir / "losses.1.jsonl")
    _write_log(run_dir, lines[9:])
    assert _switches(tail) == ["switch en -> cs (fragment 3, batch 12)"] and tail.through == 15
    # a run that writes no status.json (compare's multitask) is over once its results.json is there
    assert not grafana_push._learner_stopped(run_dir)
    (run_dir / "results.json").write_text("{}")
    assert grafana_push._learner_stopped(run_dir)


def test_basic_auth_from_a_credentials_file(grafana, tmp_path, monkeypatch):
    _clear_env(monkeypatch)
    for name, text in (("creds.json", json.dumps({"GRAFANA_USER": "admin", "GRAFANA_PASSWORD": "s3cret"})),
                       ("creds.env", "# grafana\nGRAFANA_USER=admin\nexport GRAFANA_PASSWORD='s3cret'\n")):
        path = tmp_path / name
        path.write_text(text)
        assert load_credentials({}, path) == ("admin", "s3cret")
    assert cmd_monitor(_parse(["monitor", "push", "--grafana-url", grafana.url, "--credentials-file", str(path)])) == 0
    expected = "Basic " + base64.b64encode(b"admin:s3cret").decode()
    assert {r["headers"]["Authorization"] for r in grafana.requests} == {expected}
    assert grafana.annotations() == []


def test_missing_credentials_is_one_line_naming_the_variables(tmp_path, monkeypatch, capsys):
    _clear_env(monkeypatch)
    assert cmd_monitor(_parse(["monitor", "push", "--grafana-url", "http://127.0.0.1:9"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamer monitor: error: ") and err.count("\n") == 1
    assert all(name in err for name in ("GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD"))
    with pytest.raises(PushError, match="GRAFANA_TOKEN"):
        load_credentials({"GRAFANA_USER": "only-a-user"})


def test_unreachable_grafana_is_one_line_naming_the_url(monkeypatch, capsys):
    _clear_env(monkeypatch)
    monkeypatch.setenv("GRAFANA_TOKEN", "t0ken")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert cmd_monitor(_parse(["monitor", "push", "--grafana-url", url])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"streamer monitor: error: cannot reach Grafana at {url}") and err.count("\n") == 1
    # the cause, not urllib3's wrapper cut at 200 characters ("...HTTPConnection object at 0x...>: Failed to esta)")
    assert err.endswith("Connection refused)\n") and "HTTPConnection" not in err


def test_a_connect_timeout_is_said_by_its_cause_not_by_urllib3s_wrapper():
    """A firewalled or wrong address times out: urllib3 says ConnectTimeoutError(<...HTTPConnection object at
    0x...>, 'CAUSE'), with a comma where a refused connection has a colon, and the line ended at the object
    (helper-119). The exception is the one requests raises, built from urllib3's own classes (no connect
    timeout can be made to happen here)."""
    import requests
    from urllib3.connection import HTTPConnection
    from urllib3.connectionpool import HTTPConnectionPool
    from urllib3.exceptions import ConnectTimeoutError, MaxRetryError

    host = "grafana.monitoring.internal"
    reason = ConnectTimeoutError(HTTPConnection(host, 3000), f"Connection to {host} timed out. (connect timeout=10)")
    timeout = requests.exceptions.ConnectTimeout(MaxRetryError(HTTPConnectionPool(host, 3000), "/api/health",
                                                               reason=reason))
    assert "HTTPConnection object at 0x" in str(timeout)
    assert grafana_push._short(timeout) == f"Connection to {host} timed out. (connect timeout=10)"


def test_switch_annotations_need_a_previous_line_and_a_time():
    first = {"sequence": 0, "domain_name": "en", "time": T0}
    assert grafana_push.switch_annotations(None, first) == []
    assert grafana_push.switch_annotations(first, {"sequence": 1, "domain_name": "fr"}) == []
    (only,) = grafana_push.switch_annotations(first, {"sequence": 1, "domain_name": "fr", "time": T0 + 1})
    assert only["time"] == int(round((T0 + 1) * 1000)) and only["tags"][-1] == "class:fr"
