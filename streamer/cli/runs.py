"""What the learning commands (learn, demo, compare) share: corpora, run directories, the learner
under its live view, and the report written even when a run is interrupted."""

from __future__ import annotations

import signal
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console

from monitor.report import write_report
from producers.corpora import CORPORA, CorpusMissing, build_corpus, corpus_path
from streamer.cli.errors import UserError
from streamer.config import LearnConfig, RunSummary
from streamer.settings import cache_root

__all__ = ["sigterm_as_interrupt", "corpus_dir", "ensure_corpus", "default_run_dir", "learn_under_view",
           "run_with_report_on_interrupt"]


def sigterm_as_interrupt() -> None:
    """SIGTERM stops a command the way Ctrl-C does (reports are still written)."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


def corpus_dir(name_or_dir: str, cache: Path | None) -> Path:
    """--corpus: a path of the user's own data, or a built corpus of the cache."""
    path = Path(name_or_dir)
    if path.exists():  # a directory or a file of the user's own data
        return path
    if name_or_dir in CORPORA:
        return corpus_path(name_or_dir, cache or cache_root())
    raise UserError(f"--corpus {name_or_dir!r} is neither a path nor a corpus name "
                    f"(known: {', '.join(sorted(CORPORA))})")


def ensure_corpus(name_or_dir: str, cache: Path | None) -> Path:
    """Like corpus_dir, but a known corpus that is not built yet is built first (demo, compare)."""
    if name_or_dir in CORPORA:
        root = cache or cache_root()
        try:
            return corpus_path(name_or_dir, root)
        except CorpusMissing:
            print(f"building corpus {name_or_dir} into {root} (first run only)", flush=True)
            return build_corpus(name_or_dir, root, log=lambda m: print(m, flush=True))
    return corpus_dir(name_or_dir, cache)


def default_run_dir(strategy: str) -> Path:
    return Path("runs") / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{strategy}"


async def learn_under_view(config: LearnConfig, *, manifest: dict | None = None, producer=None,
                           resume: dict | None = None, from_beginning: bool = False) -> RunSummary:
    """The learner (and optionally `producer()`, a coroutine factory) under the live view; SIGTERM and
    SIGINT stop it cleanly (streamer.learner.run's stop_signals). `resume`: a checkpoint to continue."""
    from streamer import learner

    try:  # fails early, before the broker and the view, on a bad --device, --set or --model-opt
        prepared = learner.build_strategy(config, learner.resolve_device(config.device), manifest)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return await learner.run(config, manifest=manifest, prepared=prepared, producer=producer, console=Console(),
                             log=lambda message: print(message, flush=True), resume=resume,
                             from_beginning=from_beginning, stop_signals=(signal.SIGINT, signal.SIGTERM))


def run_with_report_on_interrupt(run_dir: Path, main):
    """Run `main()`; on Ctrl-C still write the report of what was learned, then re-raise."""
    try:
        return main()
    except KeyboardInterrupt:
        if (run_dir / "losses.jsonl").exists() and (run_dir / "losses.jsonl").stat().st_size:
            write_report(run_dir)
            print(f"streamer: interrupted; report of the batches learned so far in {run_dir}", file=sys.stderr)
        raise
