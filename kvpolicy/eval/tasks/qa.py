"""Question answering over a synthetic document: facts about fictional entities, each named once;
one question about one of them (RULER's ``qa``, scored by ``string_match_part``)."""

from __future__ import annotations

import random
from typing import Callable, Sequence

from .base import Parts, RngFactory, Task
from .text import ADJECTIVES, ANIMALS, NOUNS, cap, insert, paragraphs

_PROFESSIONS = sorted(set("""
architect baker carpenter chemist dentist diplomat engineer farmer firefighter geologist jeweler
journalist lawyer librarian locksmith mechanic musician navigator nurse painter pharmacist pilot
plumber potter sculptor surgeon tailor teacher translator veterinarian
""".split()))


# QA: facts about fictional entities, each entity named once in the document.
_ONSETS = ("b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou")
_CODAS = ("", "", "", "", "n", "r", "l", "s", "m", "th")


def _syllables(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(count))


def _country(rng: random.Random) -> str:
    return cap(_syllables(rng, 2) + rng.choice(("ia", "land", "mark", "ovia", "ara", "istan")))


def _city(rng: random.Random) -> str:
    return cap(_syllables(rng, 2) + rng.choice(("", "", "burg", "ford", "ova", "heim", "port")))


def _person(rng: random.Random) -> str:
    return f"{cap(_syllables(rng, 2))} {cap(_syllables(rng, 2))}"


def _company(rng: random.Random) -> str:
    kind = rng.choice(("Industries", "Works", "Labs", "Trading Company", "Mills", "Shipping"))
    return f"{cap(_syllables(rng, 2))} {kind}"


def _title(rng: random.Random) -> str:
    return f"The {cap(rng.choice(ADJECTIVES))} {cap(rng.choice(NOUNS))} of {cap(_syllables(rng, 2))}"


# relation -> (fact, question, [(slot, generator, unique)]); the answer is the last slot.
_RELATIONS: dict[str, tuple[str, str, tuple[tuple[str, Callable[[random.Random], str], bool], ...]]] = {
    "capital": ("The capital of {a} is {b}.", "What is the capital of {a}?", (("a", _country, True), ("b", _city, True))),
    "founder": ("{a} was founded by {b}.", "Who founded {a}?", (("a", _company, True), ("b", _person, True))),
    "author": ('The novel "{a}" was written by {b}.', 'Who wrote the novel "{a}"?', (("a", _title, True), ("b", _person, True))),
    "mayor": ("The mayor of {a} is {b}.", "Who is the mayor of {a}?", (("a", _city, True), ("b", _person, True))),
    "birthplace": ("{a} was born in {b}.", "In which city was {a} born?", (("a", _person, True), ("b", _city, True))),
    "animal": (
        "The national animal of {a} is the {b}.",
        "What is the national animal of {a}?",
        (("a", _country, True), ("b", lambda r: r.choice(ANIMALS), False)),
    ),
    "profession": (
        "{a} works as a {b}.",
        "What is the profession of {a}?",
        (("a", _person, True), ("b", lambda r: r.choice(_PROFESSIONS), False)),
    ),
    "river": (
        "The {a} River flows through the city of {b}.",
        "Which city does the {a} River flow through?",
        (("a", lambda r: cap(_syllables(r, 2)), True), ("b", _city, True)),
    ),
}
_RELATION_NAMES = tuple(_RELATIONS)


def _fact(rng: random.Random, relation: str, taken: set[str], avoid: Sequence[str] = ()) -> tuple[str, str, str, str]:
    """``(fact, question, answer, lead)`` with fresh names: none in ``taken`` (which is updated),
    none containing a string of ``avoid`` (the gold fact's names, so no distractor name holds them).
    ``lead`` is the fact up to its answer ("The capital of Verlandia is")."""
    template, question, slots = _RELATIONS[relation]
    values: dict[str, str] = {}
    for slot, make, unique in slots:
        while True:
            value = make(rng)
            low = value.lower()
            if not unique or (low not in taken and not any(bad in low for bad in avoid)):
                break
        if unique:
            taken.add(low)
        values[slot] = value
    answer_slot = slots[-1][0]
    lead = template[: template.index("{" + answer_slot + "}")].rstrip().format(**values)
    return template.format(**values), question.format(**values), values[answer_slot], lead


def _build_qa(rng: RngFactory, n: int, length: int) -> Parts:
    gold_rng = rng("gold")
    relation = gold_rng.choice(_RELATION_NAMES)
    taken: set[str] = set()
    gold_fact, question, answer, lead = _fact(gold_rng, relation, taken)
    depth = gold_rng.random()
    facts_rng = rng("facts")
    # Distractors of every relation, the question's own among them (about 1 in 8).
    avoid = sorted(taken)  # the gold fact's names
    facts = [
        _fact(facts_rng, facts_rng.choice(_RELATION_NAMES), taken, avoid)[0]
        for _ in range(n)
    ]
    facts = insert(facts, [(depth, gold_fact)])
    instruction = "Answer the question based on the given document. Only give me the answer and do not output any other words."
    prompt = (
        f"{instruction}\nQuestion: {question}\n\nThe following is the given document.\n\n{paragraphs(facts, 5)}\n\n"
        f"{instruction}\n\nQuestion: {question} Answer briefly."
    )
    return Parts(prompt, question, [answer], f"Answer: {lead}")


TASKS = (Task("qa", "string_match_part", "facts about fictional entities; answer one question", _build_qa),)
