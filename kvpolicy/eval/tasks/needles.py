"""Needles in a haystack: one or more "special magic number" needles in varied filler sentences
(RULER's ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``)."""

from __future__ import annotations

import random
from typing import Sequence

from .base import Parts, RngFactory, Task
from .text import ADJECTIVES, NOUNS, distinct, filler, insert, number, paragraphs


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


_NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
_NIAH_KEYS = 4  # multikey: 1 target + 3 distractors; multiquery: 4 queried keys
_NIAH_VALUES = 4  # multivalue


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_prompt(question: str, sentences: list[str], brief: str) -> str:
    return f"{_NIAH_INTRO}\nQuestion: {question}\n\n{paragraphs(sentences)}\n\nQuestion: {question} {brief}"


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _build_niah(rng: RngFactory, n: int, *, keys: int, values: int, queried: int) -> Parts:
    needles_rng = rng("needles")
    key_list = distinct(lambda: _key(needles_rng), keys)
    numbers = distinct(lambda: number(needles_rng, 7), keys * values)
    needles: list[tuple[float, str]] = []
    values_of: dict[str, list[str]] = {}
    for i, key in enumerate(key_list):
        values_of[key] = numbers[i * values : (i + 1) * values]
        for value in values_of[key]:
            needles.append((needles_rng.random(), _needle(key, value)))
    asked = key_list[:queried]
    answers = [value for key in asked for value in values_of[key]]
    sentences = insert(filler(rng("filler"), n), needles)
    if queried == 1 and values == 1:
        question = f"What is the special magic number for {asked[0]} mentioned in the provided text?"
        brief = "Answer briefly with just the number."
        prefix = f"The special magic number for {asked[0]} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {_join_keys(asked)} mentioned in the provided text?"
        brief = "Answer briefly with just the numbers."
        prefix = f"The special magic numbers for {_join_keys(asked)} mentioned in the provided text are"
    return Parts(_niah_prompt(question, sentences, brief), question, answers, prefix)


def _build_niah_single(rng: RngFactory, n: int, length: int) -> Parts:
    return _build_niah(rng, n, keys=1, values=1, queried=1)


def _build_niah_multikey(rng: RngFactory, n: int, length: int) -> Parts:
    return _build_niah(rng, n, keys=_NIAH_KEYS, values=1, queried=1)


def _build_niah_multivalue(rng: RngFactory, n: int, length: int) -> Parts:
    return _build_niah(rng, n, keys=1, values=_NIAH_VALUES, queried=1)


def _build_niah_multiquery(rng: RngFactory, n: int, length: int) -> Parts:
    return _build_niah(rng, n, keys=_NIAH_KEYS, values=1, queried=_NIAH_KEYS)


TASKS = (
    Task("niah_single", "string_match_all", "one needle (key, 7-digit number) in filler; give the number",
         _build_niah_single),
    Task("niah_multikey", "string_match_all", "the target needle among 3 distractor keys; give its number",
         _build_niah_multikey),
    Task("niah_multivalue", "string_match_all", "one key with 4 numbers at 4 depths; give all 4",
         _build_niah_multivalue, 64),
    Task("niah_multiquery", "string_match_all", "4 keys asked at once; give all 4 numbers", _build_niah_multiquery, 64),
)
