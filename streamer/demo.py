"""`streamer demo`: broker, producer, learner, exporter and live view, then a report."""

from __future__ import annotations

import time

from producers.corpora import CORPORA, CorpusMissing, build_corpus, corpus_path, default_cache_root
from producers.stream import prepare_stream, produce_stream
from streamer.broker import EmbeddedBroker

__all__ = ["run_demo"]


def _ensure_corpus(args):
    from streamer.commands import _corpus_dir

    if args.corpus in CORPORA:
        root = args.cache or default_cache_root()
        try:
            return corpus_path(args.corpus, root)
        except CorpusMissing:
            print(f"building corpus {args.corpus} into {root} (first run only)", flush=True)
            return build_corpus(args.corpus, root, log=lambda m: print(m, flush=True))
    return _corpus_dir(args.corpus, args.cache)


def run_demo(args) -> int:
    import asyncio

    from streamer.commands import (_default_run_dir, _finish, _learn_config, _learn_with_view, _schedule,
                                   _stream_options, run_with_report_on_interrupt)

    corpus = _ensure_corpus(args)
    run_dir = args.run_dir or _default_run_dir(args.strategy)
    manifest_path = run_dir / "manifest.json"
    records, manifest = prepare_stream(corpus, _schedule(args), manifest_path, **_stream_options(args))
    print(f"stream: {manifest['n_fragments']} fragments of {', '.join(manifest['classes'])}, "
          f"{manifest['total_batches']} batches of {args.streams}x{args.window} bytes", flush=True)
    topic = f"demo-{int(time.time())}"

    def run(bootstrap: str):
        config = _learn_config(args, bootstrap=bootstrap, topic=topic, group=f"{topic}-learner",
                               run_dir=run_dir, manifest=manifest)
        def producer():
            return produce_stream(records, bootstrap, topic)

        return asyncio.run(_learn_with_view(config, args, producer=producer, manifest=manifest))

    def run_somewhere():
        if args.bootstrap_servers:
            return run(args.bootstrap_servers)
        with EmbeddedBroker() as broker:
            print(f"embedded broker on {broker.bootstrap_servers}", flush=True)
            return run(broker.bootstrap_servers)

    summary = run_with_report_on_interrupt(run_dir, run_somewhere)
    _finish(summary, manifest_path)
    return 0
