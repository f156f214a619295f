"""Aggregation: the most frequent words of a long list (RULER's ``common_words``: a numbered word
list where a few words are much more frequent; ``frequent_words``: Zipf-distributed coded text)."""

from __future__ import annotations

import functools
import random
import string
from typing import Iterable

from .base import Parts, RngFactory, Task
from .text import ADJECTIVES, ANIMALS, NOUNS, VERBS, distinct


_CWE_TOP_K = 5
_CWE_VOCAB = tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS) | set(ANIMALS)))
_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)


@functools.lru_cache(maxsize=4)
def _inside_others(vocab: tuple[str, ...]) -> frozenset[str]:
    """The words of ``vocab`` that are a substring of another word of it ("art" of "party")."""
    return frozenset(word for word in vocab if any(word != other and word in other for other in vocab))


def _unambiguous(candidates: Iterable[str], inside: frozenset[str], text: str, count: int) -> list[str]:
    """The first ``count`` candidates that are not in ``inside`` (see ``_inside_others``) nor a substring of ``text``.

    A reply that names another word, or echoes the instructions, then never matches an answer.
    """
    text = text.lower()
    out = []
    for word in candidates:
        if word in text or word in inside:
            continue
        out.append(word)
        if len(out) == count:
            return out
    raise AssertionError("not enough unambiguous words")  # the embedded lists have plenty


def _build_common_words(rng: RngFactory, n: int, length: int) -> Parts:
    k = _CWE_TOP_K
    question = f"What are the {k} most common words in the list?"
    prefix = f"The top {k} words that appear most often in the list are:"
    words_rng = rng("words")
    vocab = list(_CWE_VOCAB)
    words_rng.shuffle(vocab)
    echo = f"{_CWE_INTRO} {question} {prefix} answer briefly with just the words"
    common = _unambiguous(vocab, _inside_others(_CWE_VOCAB), echo, k)
    rare_pool = [word for word in vocab if word not in common]
    rare = [rare_pool[i % len(rare_pool)] for i in range(n)]
    rare_max = -(-n // len(rare_pool))
    # Common words stand out at every size: at least 3x the most frequent rare word.
    freq = max(6, length // 200, 3 * rare_max)
    items = rare + common * freq
    rng("order").shuffle(items)
    listing = "\n".join(f"{i + 1}. {word}" for i, word in enumerate(items))
    prompt = f"{_CWE_INTRO}\nQuestion: {question}\n\n{listing}\n\nQuestion: {question} Answer briefly with just the words."
    return Parts(prompt, question, common, prefix)


_FWE_ALPHA = 2.0
_FWE_VOCAB = 200
_FWE_MIN_WORDS = 60


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def _zipf_counts(total: int, size: int, alpha: float) -> list[int]:
    """Counts for ranks 1..size summing to ``total``, proportional to rank**-alpha (largest remainder)."""
    weights = [rank**-alpha for rank in range(1, size + 1)]
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(size), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _build_frequent_words(rng: RngFactory, n: int, length: int) -> Parts:
    question = "What are the three most frequently appeared words in the coded text?"
    intro = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words."
    )
    prefix = "According to the coded text above, the three most frequently appeared words are:"
    words_rng = rng("words")
    vocab = distinct(lambda: _pseudo_word(words_rng), _FWE_VOCAB)
    echo = f"{intro} {question} {prefix} answer briefly with just the three words"
    top = _unambiguous(vocab, _inside_others(tuple(vocab)), echo, 3)
    ranked = top + [word for word in vocab if word not in top]
    counts = _zipf_counts(n + _FWE_MIN_WORDS, len(ranked), _FWE_ALPHA)
    items = [word for word, count in zip(ranked, counts) for _ in range(count)]
    rng("order").shuffle(items)
    text = "\n".join(" ".join(items[i : i + 16]) for i in range(0, len(items), 16))
    prompt = f"{intro}\nQuestion: {question}\n\n{text}\n\nQuestion: {question} Answer briefly with just the three words."
    return Parts(prompt, question, top, prefix)


TASKS = (
    Task("common_words", "string_match_all", f"a word list; give the {_CWE_TOP_K} most common words",
         _build_common_words, 48),
    Task("frequent_words", "string_match_all", "Zipf-distributed coded words; give the 3 most frequent",
         _build_frequent_words),
)
