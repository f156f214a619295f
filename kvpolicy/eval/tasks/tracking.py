"""Variable tracking: a chain of ``VAR`` assignments hidden in filler; name every variable that
holds the value (RULER's ``variable_tracking``)."""

from __future__ import annotations

import random
import string

from .base import Parts, RngFactory, Task
from .text import distinct, filler, insert, number, paragraphs


_VT_HOPS = 4


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _build_variable_tracking(rng: RngFactory, n: int, length: int) -> Parts:
    chain_rng = rng("chain")
    names = distinct(lambda: _var_name(chain_rng), _VT_HOPS + 1)
    value = number(chain_rng, 5)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {new} = VAR {old}." for old, new in zip(names, names[1:])]
    depths = sorted(chain_rng.random() for _ in statements)
    sentences = insert(filler(rng("filler"), n), list(zip(depths, statements)))
    question = f"Find all variables that are assigned the value {value} in the text."
    prompt = (
        "Memorize and track the chain of variable assignments hidden in the following text.\n"
        f"Question: {question}\n\n{paragraphs(sentences)}\n\n"
        f"Question: {question} Answer briefly with just the variable names."
    )
    # Ending on "VAR" steers a small model to list names rather than repeat the value.
    prefix = f"According to the chain of variable assignments in the text, the variables assigned the value {value} are: VAR"
    return Parts(prompt, question, names, prefix)


TASKS = (
    Task("variable_tracking", "string_match_all", "a 4-hop chain of VAR assignments; name all 5",
         _build_variable_tracking, 64),
)
