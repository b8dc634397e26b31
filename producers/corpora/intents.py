"""The intents-multilingual corpus: smart-home commands in en, fr, de, es, cs.

The sentence templates of PyPI `home-assistant-intents` (Apache-2.0) are
parsed with PyPI `hassil` and expanded into sentences. Class = language,
label = intent name (HassTurnOn, HassStartTimer, ...).

Exhaustive expansion (hassil's `sample` tool) is no use here: one German
template can stand for millions of sentences, and a truncated enumeration
only ever varies the last alternatives. So each template is expanded by
seeded random walks instead: every alternative, optional, permutation and
list value is drawn at random. The lists a home supplies at run time (areas,
floors, device names) and the free-text wildcards (shopping items, timer
names, ...) are filled from the small per-language tables below. One form
per value cannot follow Czech and German declension everywhere, and the
templates are permissive matching grammars (they accept "le|la|l'" where only
one is right), so some sentences are not grammatical. Numbers are written as
digits or, where the list allows, as words (hassil's number speller).
Duplicates are dropped and each intent keeps at
most `max_per_intent` sentences, drawn with a fixed seed.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from .calm_dir import CorpusError
from .utterances import Utterance, write_utterance_dir

__all__ = ["LANGUAGES", "LICENSE", "ExpansionSettings", "expand_language", "build_intents_multilingual"]

LICENSE = "Apache-2.0"
LANGUAGES = ("en", "fr", "de", "es", "cs")
_PACKAGES = ("home-assistant-intents", "hassil")

Log = Callable[[str], None]

# Slot lists a Home Assistant instance supplies at run time, and values for the wildcard lists.
_SLOT_VALUES: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "area": ("kitchen", "living room", "bedroom", "garage"),
        "floor": ("ground floor", "first floor", "basement"),
        "name": ("ceiling light", "desk lamp", "fan", "thermostat", "garage door", "front door lock"),
        "message": ("dinner is ready", "we are leaving in five minutes"),
        "timer_name": ("pizza", "laundry", "pasta"),
        "timer_command": ("turn off the lights", "close the blinds"),
        "zone": ("work", "school", "home"),
        "search_query": ("jazz", "the beatles", "relaxing piano music"),
        "shopping_list_item": ("milk", "eggs", "batteries", "coffee"),
        "todo_list_item": ("call the plumber", "water the plants", "pay the bills"),
    },
    "fr": {
        "area": ("cuisine", "salon", "chambre", "garage"),
        "floor": ("rez-de-chaussée", "premier étage", "sous-sol"),
        "name": ("plafonnier", "lampe de bureau", "ventilateur", "thermostat", "porte du garage"),
        "message": ("le dîner est prêt", "on part dans cinq minutes"),
        "timer_name": ("pizza", "lessive", "pâtes"),
        "timer_command": ("éteins les lumières", "ferme les volets"),
        "zone": ("travail", "école", "maison"),
        "search_query": ("jazz", "les beatles", "musique de piano"),
        "shopping_list_item": ("lait", "œufs", "piles", "café"),
        "todo_list_item": ("appeler le plombier", "arroser les plantes", "payer les factures"),
    },
    "de": {
        "area": ("Küche", "Wohnzimmer", "Schlafzimmer", "Garage"),
        "floor": ("Keller", "Dachboden", "ersten Stock"),
        "name": ("Deckenlampe", "Schreibtischlampe", "Ventilator", "Thermostat", "Garagentor"),
        "message": ("das Essen ist fertig", "wir fahren in fünf Minuten los"),
        "timer_name": ("Pizza", "Wäsche", "Nudeln"),
        "timer_command": ("schalte das Licht aus", "schließe die Rollläden"),
        "zone": ("Arbeit", "Schule", "Zuhause"),
        "search_query": ("Jazz", "die Beatles", "entspannte Klaviermusik"),
        "shopping_list_item": ("Milch", "Eier", "Batterien", "Kaffee"),
        "todo_list_item": ("Klempner anrufen", "Pflanzen gießen", "Rechnungen bezahlen"),
    },
    "es": {
        "area": ("cocina", "salón", "dormitorio", "garaje"),
        "floor": ("planta baja", "primer piso", "sótano"),
        "name": ("lámpara del techo", "lámpara de mesa", "ventilador", "termostato", "puerta del garaje"),
        "message": ("la cena está lista", "salimos en cinco minutos"),
        "timer_name": ("pizza", "colada", "pasta"),
        "timer_command": ("apaga las luces", "cierra las persianas"),
        "zone": ("trabajo", "escuela", "casa"),
        "search_query": ("jazz", "los beatles", "música de piano"),
        "shopping_list_item": ("leche", "huevos", "pilas", "café"),
        "todo_list_item": ("llamar al fontanero", "regar las plantas", "pagar las facturas"),
    },
    "cs": {
        "area": ("kuchyň", "obývák", "ložnice", "garáž"),
        "floor": ("prvním", "druhém", "horním"),
        "name": ("lampa", "lustr", "ventilátor", "termostat", "garážová vrata"),
        "message": ("večeře je hotová", "za pět minut odcházíme"),
        "timer_name": ("pizza", "prádlo", "těstoviny"),
        "timer_command": ("zhasni světla", "zatáhni žaluzie"),
        "zone": ("práce", "škola", "domov"),
        "search_query": ("jazz", "Beatles", "klavírní hudba"),
        "shopping_list_item": ("mléko", "vejce", "baterie", "kávu"),
        "todo_list_item": ("zavolat instalatéra", "zalít květiny", "zaplatit účty"),
    },
}


@dataclass(frozen=True)
class ExpansionSettings:
    """How templates become sentences; recorded in the manifest."""

    walks_per_template: int = 40  # random walks per template; repeats are dropped
    max_per_intent: int = 300  # sentences kept per intent, drawn with the seed
    seed: str = "intents-multilingual"


def build_intents_multilingual(out_dir: Path, log: Log) -> dict[str, Any]:
    """Write en/fr/de/es/cs `.jsonl` class files into out_dir; return their provenance."""
    intents_module = _import_packages()
    settings = ExpansionSettings()
    classes = {}
    counts = {}
    for language in LANGUAGES:
        data = intents_module.get_intents(language)
        if data is None:
            raise CorpusError(
                f"home-assistant-intents {_version('home-assistant-intents')} has no '{language}' intents; "
                "install another version: pip install home-assistant-intents hassil"
            )
        utterances = expand_language(data, language, settings)
        classes[language] = utterances
        intents = sorted({utterance.label for utterance in utterances})
        counts[language] = {"examples": len(utterances), "intents": len(intents), "intent_names": intents}
        log(f"{language}: {len(utterances)} sentences for {len(intents)} intents")
    write_utterance_dir(out_dir, classes)
    return {
        "license": LICENSE,
        "sources": [
            {"package": package, "version": _version(package), "license": LICENSE} for package in _PACKAGES
        ],
        "expansion": asdict(settings),
        "slot_values": _SLOT_VALUES,
        "counts": counts,
    }


def expand_language(data: dict[str, Any], language: str, settings: ExpansionSettings) -> list[Utterance]:
    """Sentences for every intent of one language's home-assistant-intents data, sorted by intent."""
    from hassil.intents import Intents

    parsed = Intents.from_dict(data)
    filled = {name: _text_list(values) for name, values in _SLOT_VALUES[language].items()}
    utterances = []
    for intent_name in sorted(parsed.intents):
        rng = random.Random(f"{settings.seed}:{language}:{intent_name}")
        sentences: dict[str, None] = {}  # insertion-ordered set
        for block in parsed.intents[intent_name].data:
            # the home's lists and the wildcard values replace the package's placeholders
            lists = {**parsed.slot_lists, **block.slot_lists, **filled}
            rules = {**parsed.expansion_rules, **block.expansion_rules}
            walker = _Walker(lists, rules, language, rng)
            for sentence in block.sentences:
                for _ in range(settings.walks_per_template):
                    text = walker.walk(sentence.expression).strip()
                    if text:
                        sentences[text] = None
        chosen = list(sentences)
        if len(chosen) > settings.max_per_intent:
            chosen = rng.sample(chosen, settings.max_per_intent)
        utterances += [Utterance(text=text, label=intent_name) for text in chosen]
    return utterances


class _Walker:
    """Draws one sentence from a hassil expression by random choices."""

    def __init__(self, lists: dict[str, Any], rules: dict[str, Any], language: str, rng: random.Random):
        from hassil import expression, intents, util

        self._ex = expression
        self._range_list = intents.RangeSlotList
        self._text_list = intents.TextSlotList
        self._normalize = util.normalize_whitespace
        self._lists = lists
        self._rules = rules
        self._language = language
        self._rng = rng

    def walk(self, expression: Any) -> str:
        ex = self._ex
        if isinstance(expression, ex.TextChunk):
            return expression.original_text
        if isinstance(expression, ex.Alternative):  # also optionals: one item is empty text
            return self.walk(self._rng.choice(expression.items))
        if isinstance(expression, ex.Permutation):
            items = list(expression.items)
            self._rng.shuffle(items)
            return self._normalize("".join(self.walk(item) for item in items)).strip()
        if isinstance(expression, ex.Sequence):
            return self._normalize("".join(self.walk(item) for item in expression.items))
        if isinstance(expression, ex.ListReference):
            return self._list_value(expression.list_name)
        if isinstance(expression, ex.RuleReference):
            rule = self._rules.get(expression.rule_name)
            if rule is None:
                missing = expression.rule_name
                raise CorpusError(f"hassil template refers to a missing expansion rule <{missing}>")
            return self.walk(rule.expression)
        raise CorpusError(f"hassil template holds an expression this builder does not know: {expression!r}")

    def _list_value(self, name: str) -> str:
        slot_list = self._lists.get(name)
        if isinstance(slot_list, self._text_list) and slot_list.values:
            return self.walk(self._rng.choice(slot_list.values).text_in)
        if isinstance(slot_list, self._range_list):
            number = self._rng.randrange(slot_list.start, slot_list.stop + 1, slot_list.step)
            if slot_list.words and (not slot_list.digits or self._rng.random() < 0.5):
                spellings = _number_words(number, slot_list.words_language or self._language)
                return self._rng.choice(spellings) if spellings else str(number)
            return str(number)
        raise CorpusError(f"hassil template refers to slot list {{{name}}}, which has no values to draw from")


@lru_cache(maxsize=None)
def _number_words(number: int, language: str) -> tuple[str, ...]:
    """Every spelling (case, gender, ...) hassil's number speller gives a number, sorted."""
    from hassil.numbers import get_rbnf_engine

    return tuple(sorted(set(get_rbnf_engine(language).format_number(number).text_by_ruleset.values())))


def _text_list(values: tuple[str, ...]) -> Any:
    from hassil.intents import TextSlotList

    return TextSlotList.from_strings(values, allow_template=False)


def _import_packages() -> Any:
    """The home_assistant_intents module, after checking hassil imports too."""
    try:
        import hassil.intents  # noqa: F401
        import home_assistant_intents
    except ImportError:
        raise CorpusError(
            "building intents-multilingual needs the home-assistant-intents and hassil packages: "
            "pip install home-assistant-intents hassil"
        ) from None
    return home_assistant_intents


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"
