"""Needles in a haystack: one or more "special magic number" needles in varied filler sentences
(RULER's ``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``), and the
passkey prompt of ``kvpolicy run``'s demo and the accuracy tests (``needle_prompt``: one passkey
in a haystack of its own, tokenized, with the needle's token span).

The passkey prompt keeps its own haystack and template: the demo's accuracy figures (SmolLM2
answers at 2K and 4K for every seed and depth tried; see ``kvpolicy.demo``) were measured on it.
"""

from __future__ import annotations

import bisect
import functools
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvpolicy.errors import ConfigError

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


# ----------------------------------------------------------------------------------------------
# The passkey prompt (kvpolicy run's demo)
# ----------------------------------------------------------------------------------------------

# Varied sentences rather than one repeated line: a repeated line is trivially compressible, so a
# retrieval policy would look better on it than on real text.
_PASSKEY_SUBJECTS = (
    "The old farmer", "A young painter", "The tired baker", "My neighbour", "The teacher",
    "A small child", "The ship captain", "Our cousin", "The quiet student", "A travelling musician",
    "The shop owner", "The gardener", "A retired doctor", "The night guard", "The village cook",
    "A curious fox", "The postman", "An elderly poet",
)
_PASSKEY_VERBS = (
    "walked to", "looked at", "painted", "cleaned", "visited", "talked about", "dreamed of",
    "fixed", "counted", "carried", "watched", "described", "sketched", "forgot about",
    "returned to", "waited near",
)
_PASSKEY_OBJECTS = (
    "the wooden bridge", "a red barn", "the distant hills", "an empty market", "the river bank",
    "a broken fence", "the crowded harbour", "a field of wheat", "the stone tower",
    "a quiet library", "the apple orchard", "a narrow street", "the frozen lake",
    "an old lighthouse", "the green valley", "a dusty road",
)
_PASSKEY_TIMES = (
    "in the morning", "after lunch", "before sunset", "on a rainy day", "during the winter",
    "at dawn", "late at night", "in early spring", "on Sunday", "after the storm", "every summer",
    "at noon",
)

DEMO_TOKENS = 4096  # the demo prompt's length (kvpolicy run --demo-tokens)
_PASSKEY_NEEDLE = "The secret passkey is {answer}. Remember it. {answer} is the passkey."
_PASSKEY_QUESTION = "What is the secret passkey? Answer with the number only."
# The question comes first as well as last, so the model reads the document knowing what to look
# for. (With the question only at the end SmolLM2 scored the same at 4K; a bare repeated-sentence
# haystack with "What is the pass key?" failed outright.)
_PASSKEY_TEMPLATE = (
    "{question}\n\nBelow is a long text. The passkey is hidden in it.\n\n"
    "<text>\n{document}\n</text>\n\n{question}"
)


@dataclass
class DemoPrompt:
    """One needle-in-a-haystack prompt, tokenized and ready for ``model.generate``.

    ``input_ids`` and ``attention_mask`` are ``(1, num_tokens)`` long tensors on the CPU; ``answer``
    is the passkey (digits); ``needle_span`` is the ``[start, end)`` token range of the needle
    sentence in ``input_ids`` (``None`` when the tokenizer cannot report offsets).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    answer: str
    question: str
    num_tokens: int
    text: str = ""
    depth: float = 0.5
    needle_span: tuple[int, int] | None = None


def needle_prompt(
    tokenizer: Any, target_tokens: int = DEMO_TOKENS, seed: int = 0, depth: float = 0.5
) -> DemoPrompt:
    """Build a passkey-retrieval prompt of at most ``target_tokens`` tokens, a sentence short at most.

    ``seed`` fixes the passkey and the filler text; ``depth`` in [0, 1] is where the needle sits in
    the document (0 = first sentence, 1 = last). The prompt goes through the tokenizer's chat
    template with ``add_generation_prompt=True`` when it has one, else it ends with ``"Answer:"``.

    Example::

        demo = needle_prompt(tok, target_tokens=2048, seed=3, depth=0.9)
        demo.num_tokens   # <= 2048, >= ~2030
        demo.answer       # e.g. "27611"
    """
    if not 0.0 <= float(depth) <= 1.0:
        raise ConfigError(f"depth must be in [0, 1] (0 = start of the document, 1 = end), got {depth}")
    if int(target_tokens) != target_tokens or target_tokens <= 0:
        raise ConfigError(f"target_tokens must be a positive integer, got {target_tokens!r}")
    target_tokens = int(target_tokens)

    rng = random.Random(seed)
    answer = str(rng.randint(10000, 99999))
    needle = _PASSKEY_NEEDLE.format(answer=answer)
    # Every sentence is at least 4 tokens, so this many always overshoots the target.
    sentences = [_passkey_sentence(rng) for _ in range(target_tokens // 4 + 8)]

    @functools.lru_cache(maxsize=None)
    def render(count: int) -> tuple[str, list[int], list[tuple[int, int]] | None]:
        at = round(depth * count)
        document = " ".join(sentences[:at] + [needle] + sentences[at:count])
        return _tokenize(tokenizer, _PASSKEY_TEMPLATE.format(question=_PASSKEY_QUESTION, document=document))

    base = len(render(0)[1])
    if base > target_tokens:
        raise ConfigError(
            f"target_tokens={target_tokens} is too small: the question, needle and template alone take "
            f"{base} tokens"
        )
    # Sentence lengths predict the total to within a few tokens (merges across the joins are the
    # error); correct the prediction by what a render measures, so a handful of renders suffice.
    pieces = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
    lengths = [len(ids) for ids in pieces]
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + length)

    def most_that_fit(budget: int) -> int:
        return max(0, bisect.bisect_right(cumulative, budget) - 1)

    count, slack = most_that_fit(target_tokens - base), 0
    for _ in range(4):
        slack = len(render(count)[1]) - (base + cumulative[count])
        better = most_that_fit(target_tokens - base - slack)
        if better == count:
            break
        count = better
    while count > 0 and len(render(count)[1]) > target_tokens:
        count -= 1
    text, ids, offsets = render(count)

    ids_tensor = torch.tensor([ids], dtype=torch.long)
    return DemoPrompt(
        input_ids=ids_tensor,
        attention_mask=torch.ones_like(ids_tensor),
        answer=answer,
        question=_PASSKEY_QUESTION,
        num_tokens=len(ids),
        text=text,
        depth=float(depth),
        needle_span=_span(text, needle, offsets),
    )


def answer_is_correct(answer_text: str, demo: DemoPrompt) -> bool:
    """True when ``answer_text`` states the passkey as a whole number.

    ``"71,432"`` counts for 71432; ``"714320"`` does not.

    Example::

        answer_is_correct("The secret passkey is 60494.", demo)  # True when demo.answer == "60494"
    """
    joined = re.sub(r"(?<=\d)[,\s](?=\d)", "", answer_text)
    return demo.answer in re.findall(r"\d+", joined)


def _passkey_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_PASSKEY_SUBJECTS)} {rng.choice(_PASSKEY_VERBS)} {rng.choice(_PASSKEY_OBJECTS)} {rng.choice(_PASSKEY_TIMES)}."


def _tokenize(tokenizer: Any, content: str) -> tuple[str, list[int], list[tuple[int, int]] | None]:
    """The rendered prompt, its ids and (for fast tokenizers) each id's character span."""
    if getattr(tokenizer, "chat_template", None):
        # Render, then tokenize without adding specials: the same ids apply_chat_template(tokenize=True)
        # gives, plus the offsets that locate the needle.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        add_special = False
    else:
        text = f"{content}\n\nAnswer:"
        add_special = True
    try:
        encoded = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
        offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError):  # slow tokenizers report no offsets
        encoded = tokenizer(text, add_special_tokens=add_special)
        offsets = None
    return text, list(encoded["input_ids"]), offsets


def _span(text: str, needle: str, offsets: list[tuple[int, int]] | None) -> tuple[int, int] | None:
    if offsets is None:
        return None
    start_char = text.find(needle)
    end_char = start_char + len(needle)
    tokens = [i for i, (a, b) in enumerate(offsets) if b > start_char and a < end_char and b > a]
    return (tokens[0], tokens[-1] + 1) if tokens else None
