"""What the learning commands (learn, demo, compare) share: corpora, run directories, the learner
under its live view, and the report written even when a run is interrupted."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from producers.corpora import CORPORA, CorpusMissing, build_corpus, corpus_path
from streamer.cli.errors import UserError
from streamer.config import LearnConfig, RunSummary
from streamer.settings import cache_root
from streamer.spin import in_passing

__all__ = ["sigterm_as_interrupt", "sigterm_before_learning", "unwind_on_sigterm", "signals_deferred", "corpus_dir",
           "ensure_corpus", "default_run_dir", "default_manifest_path", "prepare_and_say", "stream_notes",
           "learn_under_view", "run_with_report_on_interrupt"]


def sigterm_as_interrupt() -> None:
    """SIGTERM stops a command the way Ctrl-C does (reports are still written), and Ctrl-C does so even
    where the command inherited SIGINT ignored (a background job of a script, some test runners'
    workers): Python keeps an inherited SIG_IGN, and `streamer broker` then ran on after a SIGINT."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def sigterm_before_learning() -> None:
    """Until the learner takes SIGTERM over (it stops after the step in flight, checkpoints and leaves
    the group), a SIGTERM ends `streamer learn` with one line and status 143: nothing has been learned
    in this process yet, so there is nothing to save. Without it the signal's default action ended the
    process without a word in its first seconds (imports, the manifest, the model, the checkpoint).

    During an import the process ends at once (os._exit): torch's C++ initialisation calls back into Python,
    and a SystemExit raised there crossed C++ frames: "terminate called after throwing an instance of
    'pybind11::error_already_set'" and about 90 lines of stack (1 of 28 SIGTERMs 3 s after a start). Not
    once something is set aside that only the unwinding puts back (unwind_on_sigterm: --fresh's old run)."""
    def handler(signum, frame):
        print("streamer learn: SIGTERM before learning began: stopped, nothing learned and nothing to save",
              file=sys.stderr, flush=True)
        if _importing() and not _UNWIND:
            sys.stdout.flush()
            os._exit(128 + signum)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


_UNWIND: list[str] = []  # what a SIGTERM before learning must unwind for (sigterm_before_learning)


def unwind_on_sigterm(why: str) -> None:
    """From here on a SIGTERM before learning raises SystemExit even during an import: `why` (--fresh's old
    run, moved aside) is put back only by the unwinding."""
    _UNWIND.append(why)


@contextlib.contextmanager
def signals_deferred():
    """A Ctrl-C or SIGTERM inside the block takes effect when it ends: files moved one by one (--fresh's old
    run set aside, or put back) are never left half in one place and half in the other. A second Ctrl-C
    during the put-back had left the old run split, and the plain command then refused the directory.
    The signal's own handler runs after the block, as if it had come then. In the main thread only (the
    only one Python signal handlers run in); elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    handlers = {number: signal.signal(number, lambda signum, frame: caught.append(signum))
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    for number in dict.fromkeys(caught):
        handler = handlers[number]
        if callable(handler):
            handler(number, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), number)


def _importing() -> bool:
    """Whether a module is being imported (its spec says so while its code runs: CPython's import lock)."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for module in list(sys.modules.values()))


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


def prepare_and_say(corpus: Path, schedule, manifest_path: Path | None, log=print, **options):
    """producers.stream.prepare_stream, with what it decided said in one line each (stream_notes), and a
    probe split too large for the data named with the flag that changes it."""
    from producers.schedule import ScheduleError
    from producers.stream import prepare_stream

    try:
        records, manifest = prepare_stream(corpus, schedule, manifest_path, **options)
    except ScheduleError as exc:
        if "probe split" not in str(exc):
            raise
        flag = "--probe-examples" if "utterances" in str(exc) else "--probe-tokens"
        raise UserError(f"{exc}: give a smaller {flag}, or {flag} 0 for no probe split") from None
    for note in stream_notes(manifest, records):
        log(note)
    return records, manifest


def stream_notes(manifest: dict, records) -> list[str]:
    """What the stream builder decided that the user did not ask for: data recycled to fill the stream
    (how many times over, per class) and the held-out probe split (how much, and the flag that turns it off)."""
    notes = []
    if manifest.get("level") == "utterance":
        seen, distinct = {}, {}
        for record in records:
            if record.truth is not None:
                name = record.truth.class_name
                seen[name] = seen.get(name, 0) + 1
                distinct.setdefault(name, set()).add((record.text, record.truth.label))
        times = {name: seen[name] / len(distinct[name]) for name in seen if seen[name] > len(distinct[name])}
        unit, fewer = "utterances", "--lambda (utterances per fragment)"
    else:  # each of the b streams reads its own 1/b of a class's text, wrapping when it runs out
        streams = max(1, int(manifest.get("streams") or 1))
        times = {name: 1 + wraps / streams for name, wraps in (manifest.get("wrapped") or {}).items() if wraps}
        unit, fewer = "text", "--lambda (bytes per fragment)"
    if times:
        worst = max(times, key=times.get)
        notes.append(f"recycled: the stream needs more {unit} than the data has, so each class is read "
                     f"{'more than once' if len(times) > 1 else 'again'} (up to {times[worst]:,.1f} times over, "
                     f"class {worst}; {len(times)} of {len(manifest.get('classes', ()))} classes recycled); fewer "
                     f"--fragments or a smaller {fewer} stream less")
    probe = manifest.get("probe") or {}
    held = probe.get("classes") or {}
    if held:
        if probe.get("examples"):
            amount, flag = f"{probe['examples']} utterances", "--probe-examples 0"
        else:
            amount, flag = f"{probe.get('tokens')} bytes", "--probe-tokens 0"
            sizes = [entry.get("bytes") for entry in held.values() if isinstance(entry, dict)]
            if sizes and all(isinstance(n, int) for n in sizes) and max(sizes) > 1.5 * (probe.get("tokens") or 0):
                # whole lines: calm-multidomain's articles took 56,105 bytes of encyclopedia for 5000
                amount = (f"the last whole lines, {min(sizes):,} to {max(sizes):,} bytes "
                          f"(--probe-tokens {probe.get('tokens')}),")
        where = f" into {probe['dir']}" if probe.get("dir") else ""
        notes.append(f"probe split: {amount} of each of {len(held)} classes held out{where}, never streamed, "
                     f"to measure forgetting ({flag} turns it off)")
    return notes


def default_manifest_path(topic: str, cache: Path | None = None) -> Path:
    """Where `produce` writes a topic's manifest unless --manifest says, and where `learn` looks for it:
    under the cache (never the current directory), `<cache>/streams/<topic>.manifest.json`."""
    return (cache or cache_root()) / "streams" / f"{topic}.manifest.json"


def default_run_dir(strategy: str) -> Path:
    return Path("runs") / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{strategy}"


async def learn_under_view(config: LearnConfig, *, manifest: dict | None = None, producer=None,
                           resume: dict | None = None, from_beginning: bool = False,
                           before_run: Callable[[], None] | None = None) -> RunSummary:
    """The learner (and optionally `producer()`, a coroutine factory) under the live view; SIGTERM and
    SIGINT stop it cleanly (streamer.learner.run's stop_signals). `resume`: a checkpoint to continue.
    `before_run()`: called once the strategy is built, before the learner starts (--fresh's move)."""
    from rich.console import Console

    from streamer import learner

    try:  # fails early, before the broker and the view, on a bad --device, --set or --model-opt
        prepared = in_passing(learner.build_strategy, config, learner.resolve_device(config.device), manifest)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if before_run is not None:
        before_run()
    return await learner.run(config, manifest=manifest, prepared=prepared, producer=producer, console=Console(),
                             log=lambda message: print(message, flush=True), resume=resume,
                             from_beginning=from_beginning, stop_signals=(signal.SIGINT, signal.SIGTERM))


def run_with_report_on_interrupt(run_dir: Path, main):
    """Run `main()`; on Ctrl-C still write the report of what was learned, then re-raise."""
    from monitor.report import write_report  # river and scipy: loaded by the commands that report

    try:
        return main()
    except KeyboardInterrupt:
        if (run_dir / "losses.jsonl").exists() and (run_dir / "losses.jsonl").stat().st_size:
            write_report(run_dir)
            print(f"streamer: interrupted; report of the batches learned so far in {run_dir}", file=sys.stderr)
        raise
