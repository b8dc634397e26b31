"""Labeled utterance corpora: the .jsonl directory format, the real intents build and the MultiWOZ corpus."""

from tests.figures import figure  # noqa: E402
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from producers.corpora import corpus_info
from producers.corpora.calm_dir import CorpusError
from producers.corpora.intents import LANGUAGES, build_intents_multilingual
from producers.corpora.multiwoz import DOMAINS, detokenize, utterances_from_templates
from producers.corpora.utterances import (
    Utterance,
    describe_utterance_dir,
    load_utterance_dir,
    write_utterance_dir,
)

CLASSES = {
    "fr": [
        Utterance("allume la lumière de la cuisine", "HassTurnOn"),
        Utterance("éteins tout", "HassTurnOff"),
    ],
    "cs": [Utterance("rozsviť v kuchyni", "HassTurnOn"), Utterance("line\u2028separator", "HassTurnOn")],
}


# --- the directory format --------------------------------------------------------------------


def test_write_then_load_round_trips(tmp_path):
    write_utterance_dir(tmp_path / "corpus", CLASSES)
    assert load_utterance_dir(tmp_path / "corpus") == {"cs": CLASSES["cs"], "fr": CLASSES["fr"]}
    first = json.loads((tmp_path / "corpus" / "fr.jsonl").read_text(encoding="utf-8").split("\n")[0])
    assert first == {"text": "allume la lumière de la cuisine", "label": "HassTurnOn"}


def test_load_ignores_extra_fields_and_blank_lines(tmp_path):
    write_utterance_dir(tmp_path, CLASSES)
    (tmp_path / "de.jsonl").write_text(
        '{"text": "Licht an", "label": "HassTurnOn", "slots": {"area": "Küche"}}\n\n', encoding="utf-8"
    )
    assert load_utterance_dir(tmp_path)["de"] == [Utterance("Licht an", "HassTurnOn")]


def test_describe_counts_examples_labels_characters_and_hashes(tmp_path):
    write_utterance_dir(tmp_path, CLASSES)
    described = describe_utterance_dir(tmp_path)
    data = (tmp_path / "fr.jsonl").read_bytes()
    assert described["fr"]["examples"] == 2
    assert described["fr"]["labels"] == 2
    assert described["cs"]["labels"] == 1
    assert described["fr"]["characters"] == len("allume la lumière de la cuisine") + len("éteins tout")
    assert described["fr"]["bytes"] == len(data)
    assert re.fullmatch(r"[0-9a-f]{64}", described["fr"]["sha256"])
    assert described["fr"]["file"] == "fr.jsonl"


def _corpus_with(tmp_path: Path, fr_content: bytes) -> Path:
    write_utterance_dir(tmp_path, CLASSES)
    (tmp_path / "fr.jsonl").write_bytes(fr_content)
    return tmp_path


def _message(path: Path) -> str:
    with pytest.raises(CorpusError) as caught:
        load_utterance_dir(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_directory_is_reported(tmp_path):
    assert _message(tmp_path / "nowhere") == (
        f"utterance directory {tmp_path / 'nowhere'} does not exist or is not a directory"
    )


def test_fewer_than_two_classes_is_reported(tmp_path):
    write_utterance_dir(tmp_path, {"fr": CLASSES["fr"]})
    (tmp_path / "notes.txt").write_text("not a class", encoding="utf-8")
    assert _message(tmp_path) == (
        f"utterance directory {tmp_path} needs at least 2 class files named <class>.jsonl (found 1: fr.jsonl)"
    )


def test_empty_class_is_reported(tmp_path):
    path = _corpus_with(tmp_path, b"\n  \n")
    assert _message(path) == f"class file {path / 'fr.jsonl'} has no examples; every class needs at least one"


def test_undecodable_bytes_are_reported_with_file_and_offset(tmp_path):
    path = _corpus_with(tmp_path, b'{"text": "caf\xe9", "label": "x"}\n')
    assert _message(path) == (
        f"class file {path / 'fr.jsonl'} is not valid UTF-8: "
        "byte 0xe9 at byte offset 13 (invalid continuation byte)"
    )


def test_bad_json_is_reported_with_file_and_line(tmp_path):
    path = _corpus_with(tmp_path, b'{"text": "a", "label": "x"}\n{"text": "b", "label": \n')
    assert _message(path).startswith(f"{path / 'fr.jsonl'}:2: not a JSON object (")
    path = _corpus_with(tmp_path, b'["a", "x"]\n')
    assert _message(path) == f"{path / 'fr.jsonl'}:1: not a JSON object (found list)"


def test_missing_or_wrong_fields_are_reported_with_file_and_line(tmp_path):
    path = _corpus_with(tmp_path, b'{"text": "a", "label": "x"}\n\n{"text": "b"}\n')
    assert _message(path) == (
        f'{path / "fr.jsonl"}:3: field "label" is missing; each line needs "text" and "label"'
    )
    path = _corpus_with(tmp_path, b'{"text": 3, "label": "x"}\n')
    assert _message(path) == (
        f'{path / "fr.jsonl"}:1: field "text" is not a string; each line needs "text" and "label"'
    )


# --- MultiWOZ text handling, on a hand-made template table ------------------------------------


def test_detokenize_joins_multiwoz_tokens():
    assert detokenize("I ' m after a hotel , please .   Thanks !") == "I'm after a hotel, please. Thanks!"
    assert detokenize("I do n't know ; it 's christ 's college ?") == "I don't know; it's christ's college?"


def test_templates_become_domain_classes_with_filled_placeholders():
    templates = {f"{domain.title()}-Inform": {"none;": [f"I need the {domain} ."]} for domain in DOMAINS}
    templates["Hotel-Inform"]["Stay;"] = ["#HOTEL-INFORM-STAY# nights .", "#HOTEL-INFORM-STAY# nights ."]
    templates["Taxi-Request"] = {"none;": ["What car is it ?"]}
    templates["general-thank"] = {"none;": ["Thanks !"]}
    classes, counts = utterances_from_templates(templates, {"hotel": {"stay": ["3"]}})
    assert classes["hotel"] == [
        Utterance("I need the hotel.", "Hotel-Inform"),
        Utterance("3 nights.", "Hotel-Inform"),
    ]
    assert classes["taxi"] == [
        Utterance("I need the taxi.", "Taxi-Inform"),
        Utterance("What car is it?", "Taxi-Request"),
    ]
    assert counts["dropped_acts"] == {"general-thank": 1}
    assert counts["duplicates"] == 1


# --- the real corpora: intents built here from installed packages, MultiWOZ by ./dev setup --


def _build(builder, tmp_path_factory, name):
    out_dir = tmp_path_factory.mktemp(name)
    messages = []
    started = time.monotonic()
    provenance = builder(out_dir, messages.append)
    seconds = time.monotonic() - started
    figure(f"\n{name}: built in {seconds:.1f} s; " + "; ".join(messages))
    return out_dir, provenance


@pytest.fixture(scope="module")
def intents_corpus(tmp_path_factory):
    return _build(build_intents_multilingual, tmp_path_factory, "intents-multilingual")


@pytest.fixture(scope="module")
def multiwoz_corpus(built_corpus):
    """The corpus ./dev setup built (its build downloads the ConvLab-3 archive)."""
    path = built_corpus("multiwoz-domains")
    return path, corpus_info("multiwoz-domains", path.parent)


def test_intents_build_has_five_languages_of_many_intents(intents_corpus):
    out_dir, provenance = intents_corpus
    classes = load_utterance_dir(out_dir)
    described = describe_utterance_dir(out_dir)
    assert sorted(classes) == sorted(LANGUAGES)
    for language, utterances in classes.items():
        labels = Counter(utterance.label for utterance in utterances)
        figure(
            f"intents {language}: {len(utterances)} examples, {len(labels)} intents, "
            f"{described[language]['characters']:,} characters, {described[language]['bytes']:,} bytes"
        )
        assert len(labels) >= 35  # measured: en 42, fr 41, de 42, es 38, cs 41
        assert len(utterances) >= 5000  # measured: 6,288 (cs) to 10,895 (de)
        assert all(re.fullmatch(r"Hass[A-Z][A-Za-z]+", label) for label in labels)
        assert len(set(utterances)) == len(utterances), f"duplicate examples in {language}"
        assert all(utterance.text == utterance.text.strip() and utterance.text for utterance in utterances)
        assert not any("{" in utterance.text or "<" in utterance.text for utterance in utterances)
    assert {"HassTurnOn", "HassTurnOff", "HassStartTimer"} <= {u.label for u in classes["cs"]}
    versions = {source["package"]: source["version"] for source in provenance["sources"]}
    assert set(versions) == {"home-assistant-intents", "hassil"} and "unknown" not in versions.values()
    assert provenance["license"] == "Apache-2.0"


def test_intents_build_is_deterministic(intents_corpus):
    out_dir, _ = intents_corpus
    from home_assistant_intents import get_intents

    from producers.corpora.intents import ExpansionSettings, expand_language

    again = expand_language(get_intents("cs"), "cs", ExpansionSettings())
    assert again == load_utterance_dir(out_dir)["cs"]


def test_multiwoz_build_has_seven_domains_labeled_with_their_acts(multiwoz_corpus):
    out_dir, provenance = multiwoz_corpus
    classes = load_utterance_dir(out_dir)
    described = describe_utterance_dir(out_dir)
    assert sorted(classes) == sorted(DOMAINS)
    for domain, utterances in classes.items():
        acts = Counter(utterance.label for utterance in utterances)
        figure(
            f"multiwoz {domain}: {len(utterances)} examples, acts {dict(acts)}, "
            f"{described[domain]['characters']:,} characters"
        )
        assert all(act.startswith(f"{domain.title()}-") for act in acts), acts
        assert len(set(utterances)) == len(utterances), f"duplicate examples in {domain}"
        assert not any(re.search(r"#[A-Z]+-[A-Z]+-[A-Z]+#", utterance.text) for utterance in utterances)
    for domain in ("hotel", "restaurant", "train"):
        assert len(classes[domain]) >= 5000  # measured: hotel 7,918, restaurant 6,580, train 5,273
    for domain in ("attraction", "taxi", "hospital", "police"):
        assert len(classes[domain]) >= 300  # measured: 5,072, 1,471, 467, 316
    assert set(provenance["dropped_acts"]) == {"general-bye", "general-greet", "general-thank"}
    assert provenance["placeholders_left_unfilled"] == 0
    assert provenance["sources"][0]["version"] == "3.0.1"


def test_intents_build_names_the_packages_when_they_are_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "home_assistant_intents", None)  # makes the import fail
    with pytest.raises(CorpusError, match=r"pip install home-assistant-intents hassil$"):
        build_intents_multilingual(tmp_path, print)
