"""`streamer monitor dashboard|push`: the command-line side of monitor/dashboard.py and
monitor/grafana_push.py (argparse and credentials from the environment live here, not in monitor/)."""

from __future__ import annotations

import sys
from pathlib import Path

from monitor import grafana_push
from monitor.dashboard import DEFAULT_PATH, render_dashboard, write_dashboard
from streamer.settings import grafana_credentials_environment

__all__ = ["add_monitor_parser", "cmd_monitor"]


def add_monitor_parser(subparsers) -> None:
    """Add `monitor dashboard` and `monitor push` to the `streamer` subparsers."""
    p = subparsers.add_parser("monitor", help="Grafana dashboard as code; push it and switch annotations")
    msub = p.add_subparsers(dest="monitor_command", required=True, metavar="{dashboard,push}")
    q = msub.add_parser("dashboard", help="write the Grafana dashboard JSON (or --check the committed one)")
    q.add_argument("--out", type=Path, default=DEFAULT_PATH, help=f"where to write it (default {DEFAULT_PATH})")
    q.add_argument("--check", action="store_true", help="exit 1 when the file differs from the generated dashboard")
    q = msub.add_parser("push", help="upload the dashboard to Grafana and annotate switches from a run's loss log")
    q.add_argument("--grafana-url", required=True, help="e.g. http://localhost:3000")
    q.add_argument("--run-dir", type=Path, help="post one annotation per true and detected switch in DIR/losses.jsonl "
                                                "(default: none; only the dashboard is uploaded)")
    q.add_argument("--follow", action="store_true",
                   help="keep tailing losses.jsonl until the run's learner stops (its status.json says stopped and "
                        "no learner holds the run; a crashed learner's restart is followed) or Ctrl-C")
    q.add_argument("--credentials-file", type=Path,
                   help="JSON or KEY=VALUE lines: GRAFANA_TOKEN, or GRAFANA_USER and GRAFANA_PASSWORD "
                        "(default: those environment variables)")


def _check(path: Path) -> int:
    try:
        current = path.read_text(encoding="utf-8")
    except OSError:
        current = None
    if current != render_dashboard():
        state = "is missing" if current is None else "differs from build_dashboard()"
        print(f"streamer monitor: {path} {state}; run `streamer monitor dashboard --out {path}`", file=sys.stderr)
        return 1
    print(f"{path} is up to date")
    return 0


def _push(args) -> int:
    credential = grafana_push.load_credentials(grafana_credentials_environment(), args.credentials_file)
    if args.follow and args.run_dir is None:
        raise ValueError("--follow needs --run-dir")
    try:
        summary = grafana_push.push(args.grafana_url, credential, run_dir=args.run_dir, follow=args.follow,
                                    log=lambda message: print(message, flush=True))
    except KeyboardInterrupt:  # the way to stop --follow
        print("streamer monitor: stopped following", file=sys.stderr)
        return 0
    print(summary)
    return 0


def cmd_monitor(args) -> int:
    """`streamer monitor dashboard|push`; errors are one line on stderr and exit status 2."""
    try:
        if args.monitor_command == "dashboard":
            if args.check:
                return _check(args.out)
            print(f"wrote {write_dashboard(args.out)}")
            return 0
        return _push(args)
    except (grafana_push.PushError, ValueError, OSError) as exc:
        print(f"streamer monitor: error: {exc}", file=sys.stderr)
        return 2
