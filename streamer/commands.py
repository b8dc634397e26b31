"""What each `streamer` subcommand does, given parsed flags."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console

from monitor.calm import format_table
from streamer.cli_monitor import cmd_monitor  # noqa: F401  (main() dispatches to cmd_<command>)
from monitor.exporter import create_metrics, serve
from monitor.live import LiveMonitor
from monitor.report import json_safe, write_report
from monitor.view import LiveView
from producers.corpora import CORPORA, CorpusError, build_corpus, corpus_info, corpus_path, default_cache_root, list_corpora
from producers.kafka import ProduceError, ensure_topic
from producers.schedule import Schedule, ScheduleError
from producers.stream import looped, prepare_stream, produce_stream
from streamer.broker import BrokerError, EmbeddedBroker
from streamer.cli import UserError
from streamer.consumer import SourceError
from streamer.models.catalog import default_lr as catalog_default_lr

__all__ = ["KNOWN_ERRORS"]

KNOWN_ERRORS = (UserError, CorpusError, ScheduleError, SourceError, ProduceError, BrokerError)
console = Console(stderr=False)


def _sigterm_as_interrupt() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


def cmd_broker(args) -> int:
    _sigterm_as_interrupt()
    with EmbeddedBroker(port=args.port) as broker:
        print(f"broker listening on {broker.bootstrap_servers} (pid {broker.pid}); Ctrl-C stops it", flush=True)
        while broker._process.poll() is None:  # noqa: SLF001
            time.sleep(0.5)
        raise BrokerError(f"the broker on {broker.bootstrap_servers} exited unexpectedly")


def cmd_data(args) -> int:
    root = args.cache or default_cache_root()
    if args.data_command == "list":
        for entry in list_corpora(root):
            state = "built" if entry["built"] else "not built"
            print(f"{entry['name']:<22} {state:<10} {entry['description']}")
        return 0
    if args.data_command == "build":
        path = build_corpus(args.name, root, force=args.force, log=lambda m: print(m, flush=True))
        print(f"built {args.name} in {path}")
        return 0
    print(json.dumps(corpus_info(args.name, root), indent=2))
    return 0


def cmd_weights(args) -> int:
    from streamer.models.weights import WEIGHTS, build_weights, weights_root

    root = args.cache or weights_root()
    if args.weights_command == "list":
        for name, spec in sorted(WEIGHTS.items()):
            state = "built" if (root / name / "manifest.json").is_file() else "not built"
            print(f"{name:<18} {state:<10} {spec.package}=={spec.version} ({spec.license}): {spec.description}")
        return 0
    try:
        path = build_weights(args.name, root, force=args.force, log=lambda m: print(m, flush=True))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(f"built {args.name} in {path}")
    return 0


def _corpus_dir(name_or_dir: str, cache: Path | None) -> Path:
    path = Path(name_or_dir)
    if path.exists():  # a directory or a file of the user's own data
        return path
    if name_or_dir in CORPORA:
        return corpus_path(name_or_dir, cache or default_cache_root())
    raise UserError(f"--corpus {name_or_dir!r} is neither a path nor a corpus name "
                    f"(known: {', '.join(sorted(CORPORA))})")


def _schedule(args) -> Schedule:
    return Schedule(kind=args.schedule, n_fragments=args.fragments, mean_tokens=args.mean_tokens,
                    streams=args.streams, window=args.window, record_tokens=args.window, seed=args.seed,
                    order=args.order, given_order=args.given_order, permutation=args.permutation,
                    repeats=args.repeats, probe_tokens=args.probe_tokens)


def cmd_produce(args) -> int:
    corpus = _corpus_dir(args.corpus, args.cache)
    manifest_path = args.manifest or Path(f"{args.topic}.manifest.json")
    records, manifest = prepare_stream(corpus, _schedule(args), manifest_path, **_stream_options(args))
    print(f"stream: {manifest['n_fragments']} fragments, {manifest['total_batches']} batches, "
          f"{len(records)} records; manifest {manifest_path}", flush=True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    stream = looped(records, manifest) if args.loop else records
    with Progress(TextColumn("producing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[mb]:.2f} MB"),
                  console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("produce", total=None if args.loop else len(records), mb=0.0)
        sent = asyncio.run(produce_stream(
            stream, args.bootstrap_servers, args.topic,
            rate=args.rate and args.rate * args.realtime_factor,
            token_rate=args.token_rate and args.token_rate * args.realtime_factor,
            partitions=args.partitions, truth_topic=not args.no_truth_topic,
            progress=lambda n, b: progress.update(task, completed=n, mb=b / 1e6)))
    print(f"sent {sent} records to {args.topic} at {args.bootstrap_servers}")
    return 0


def _stream_options(args) -> dict:
    return {"probe_examples": args.probe_examples, "utterances": False if args.as_text else None}


def _from_fragment(spec, n_fragments: int | None) -> int:
    if spec == "all":
        return 0
    if spec == "half":
        if not n_fragments:
            raise UserError("--from-fragment half needs --manifest (the number of fragments N)")
        return n_fragments // 2
    return int(spec)


def _learn_config(args, *, bootstrap: str, topic: str, group: str, run_dir: Path, manifest: dict | None):
    from streamer.config import LearnConfig
    from streamer.models import LSTMConfig

    manifest = manifest or {}
    for key, flag in (("streams", "--streams"), ("window", "--window")):
        if key in manifest and manifest[key] != getattr(args, key):
            raise UserError(f"{flag} {getattr(args, key)} differs from the manifest's {manifest[key]}")
    config = LearnConfig(
        bootstrap_servers=bootstrap, topic=topic, group_id=group, run_dir=run_dir,
        run_name=run_dir.name, strategy=args.strategy, strategy_options=tuple(args.strategy_options),
        model_name=args.model_name, model_options=tuple(args.model_options),
        streams=args.streams, window=args.window,
        model=LSTMConfig(embedding=args.embedding, hidden=args.hidden, layers=args.layers, dropout=args.dropout),
        lr=args.lr if args.lr is not None else catalog_default_lr(args.model_name), seed=args.seed, device=args.device, max_batches=args.max_batches, minutes=args.minutes,
        idle_timeout_s=getattr(args, "idle_timeout", None), total_batches=manifest.get("total_batches"),
        total_records=manifest.get("total_records"),
        classes=tuple(manifest.get("classes", ())), n_fragments=manifest.get("n_fragments"),
        from_fragment=_from_fragment(args.from_fragment, manifest.get("n_fragments")),
        checkpoint_every_s=args.checkpoint_every, probe_every=max(0, args.probe_every),
    )
    return _fit_budget(config, getattr(args, "params", None), manifest or None)


def _fit_budget(config, params: int | None, manifest: dict | None):
    """--params N: the config with the hidden size that gives the strategy's model about N parameters."""
    if not params:
        return config
    from streamer.budget import BudgetError, fit_to_budget

    try:
        config, fitted = fit_to_budget(config, params, manifest)
    except BudgetError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:  # a bad --set or --model-opt, found while sizing
        raise UserError(str(exc)) from None
    print(f"--params {params:,}: {config.strategy} with hidden {fitted.hidden} has {fitted.parameters:,} "
          f"parameters ({fitted.relative_error:+.1%})", flush=True)
    return config


def _default_run_dir(strategy: str) -> Path:
    return Path("runs") / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{strategy}"


async def _learn_with_view(config, args, producer=None, manifest=None):
    """Run the learner (and optionally `producer()`, a coroutine factory) under the live view."""
    from streamer.learner import build_strategy, learn, resolve_device

    try:  # fails early, before the broker and the view, on a bad --device, --set or --model-opt
        prepared = build_strategy(config, resolve_device(config.device), manifest)
        built = prepared[1]
    except ValueError as exc:
        raise UserError(str(exc)) from None
    metrics = create_metrics() if args.metrics_port is not None else None
    if metrics is not None:
        server, _ = serve(metrics, args.metrics_port, args.metrics_host)
        port = server.server_address[1]
        print(f"metrics: http://{args.metrics_host}:{port}/metrics", flush=True)
    monitor = LiveMonitor(run=config.run_name, strategy=config.strategy, classes=config.classes,
                          k=10, from_fragment=config.from_fragment, total_batches=config.max_batches or config.total_batches,
                          metrics=metrics, detector=args.detector)
    view = LiveView(console=Console(force_terminal=False) if args.no_view else console)
    last = [0.0]

    def on_step():
        now = time.monotonic()
        if now - last[0] >= 0.25:
            last[0] = now
            view.update(monitor.snapshot())

    if producer is not None:  # the topic must exist before the consumer subscribes
        await ensure_topic(config.bootstrap_servers, config.topic)
    try:
        with view:
            probe_set = None
            if manifest and not args.no_probe:
                from streamer.probe import load_probe_set

                probe_set = load_probe_set(manifest, rows=config.streams, window=config.window, encode=built.encode)
            tasks = [asyncio.create_task(learn(config, monitor, on_step, probe_set, manifest, prepared))]
            if producer is not None:
                tasks.append(asyncio.create_task(producer()))
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
            view.update(monitor.snapshot(), force=True)
    finally:
        if metrics is not None:
            server.shutdown()
    return results[0]


def _finish(summary, manifest_path: Path | None) -> dict:
    print(f"{summary.batches} batches, {summary.tokens} tokens in {summary.seconds:.1f}s "
          f"({summary.tokens / max(summary.seconds, 1e-9):,.0f} tokens/s); stopped: {summary.stop_reason}"
          + (f"; dead letters {summary.dead_letters}" if summary.dead_letters else "")
          + (f"; {summary.probes} probe evaluations took {summary.probe_seconds:.1f}s" if summary.probes else ""))
    report = write_report(summary.run_dir)
    span = report["span"]
    print(f"\nCALM metrics over the paper's span (fragments >= {span['from_fragment']} "
          f"of {span['n_fragments_expected']}):\n")
    print(format_table(report["metrics"]))
    print("\nWhole stream (fragments >= 0):\n")
    print(format_table(report["whole_stream"]))
    print(f"run directory: {summary.run_dir} (losses.jsonl, results.json, loss_curve.png, checkpoint.pt)")
    return report


def run_with_report_on_interrupt(run_dir: Path, main):
    """Run `main()`; on Ctrl-C still write the report of what was learned, then re-raise."""
    try:
        return main()
    except KeyboardInterrupt:
        if (run_dir / "losses.jsonl").exists() and (run_dir / "losses.jsonl").stat().st_size:
            write_report(run_dir)
            print(f"streamer: interrupted; report of the batches learned so far in {run_dir}", file=sys.stderr)
        raise


def cmd_learn(args) -> int:
    _sigterm_as_interrupt()
    manifest = None
    if args.manifest:
        try:
            manifest = json.loads(args.manifest.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read manifest {args.manifest}: {exc}") from None
    run_dir = args.run_dir or _default_run_dir(args.strategy)
    config = _learn_config(args, bootstrap=args.bootstrap_servers, topic=args.topic, group=args.group,
                           run_dir=run_dir, manifest=manifest)
    if manifest is not None:
        (run_dir).mkdir(parents=True, exist_ok=True)
        (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    summary = run_with_report_on_interrupt(
        run_dir, lambda: asyncio.run(_learn_with_view(config, args, manifest=manifest)))
    _finish(summary, args.manifest)
    return 0


def cmd_demo(args) -> int:
    from streamer.demo import run_demo

    _sigterm_as_interrupt()
    return run_demo(args)


def cmd_report(args) -> int:
    for path in args.paths:
        if not path.exists():
            raise UserError(f"{path} does not exist (give a run directory or a losses.jsonl file)")
    if len(args.paths) > 1:
        return _compare(args)
    path = args.paths[0]
    try:
        report = write_report(path, args.out, k=args.k, from_fragment=args.from_fragment)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json_safe({**report["metrics"], **{key: report.get(key) for key in (
            "span", "run", "whole_stream", "detection", "forgetting", "probe_matrix", "config")}}), default=str))
    else:
        print(f"## {path}\n")
        print(format_table(report["metrics"]))
    return 0


def _compare(args) -> int:
    """Several runs: per-run reports in <out>/<run>/, then Table 1, the forgetting table and figures."""
    from monitor.compare import load_runs, write_comparison

    out = args.out or Path("report")
    try:
        for path in args.paths:
            write_report(path, out / path.name, k=args.k, from_fragment=args.from_fragment)
        comparison = write_comparison(load_runs(args.paths, k=args.k, from_fragment=args.from_fragment), out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json_safe(comparison), default=str))
        return 0
    print((out / "table1.md").read_text())
    print((out / "forgetting.md").read_text())
    for name, reason in comparison.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    print(f"written to {out}: table1.md, forgetting.md, after_switch.png, comparison.json and one folder per run")
    return 0


def cmd_compare(args) -> int:
    from streamer.compare import run_compare

    _sigterm_as_interrupt()
    return run_compare(args)
