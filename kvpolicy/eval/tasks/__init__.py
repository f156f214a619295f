"""RULER-style synthetic long-context tasks, generated locally from fixed seeds.

Nothing is downloaded: every haystack, needle, word list and fact comes from a seeded
``random.Random`` and the small word lists below. A sample is sized in tokens of the tokenizer it
is made for: the chat-templated prompt (see ``build_chat``) is filled with haystack until it is
just under ``length`` tokens (within ``TOLERANCE``, 3 %, below it).

Example::

    from kvpolicy.eval.tasks import TASKS, build_chat, make_sample, score
    from kvpolicy.models import load_model

    model, tok = load_model("smollm2")
    sample = make_sample("niah_single", tok, length=2048, seed=0)
    inputs = build_chat(tok, sample)
    out = model.generate(**inputs, max_new_tokens=TASKS[sample.task].max_new_tokens, do_sample=False)
    prediction = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(score(sample.task, prediction, sample.answers))  # 0.0 .. 100.0

Tasks (the keys of ``TASKS``), after RULER (Hsieh et al., 2024):

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {7 digits}." in
  varied filler sentences; asks for the number of {key}.
- ``niah_multikey``: the target needle among 3 distractor needles with other keys.
- ``niah_multivalue``: one key with 4 values at 4 depths; all 4 must be given.
- ``niah_multiquery``: 4 keys asked at once; all 4 values must be given.
- ``variable_tracking``: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) hidden in
  filler; asks for every variable that holds 12345 (all 5 names).
- ``common_words``: a numbered word list where 5 words are much more frequent; asks for them.
- ``frequent_words``: "coded text" of pseudo-words drawn Zipf(2); asks for the 3 most frequent.
- ``qa``: a document of facts about fictional entities ("The capital of Verlandia is Morsk."),
  every relation mixed; one question about one of them.

Every prompt states the question before the haystack and again after it, and asks for a brief
answer; ``build_chat`` then opens the assistant's reply with RULER's answer prefix ("The special
magic number for {key} mentioned in the provided text is"), which tiny models need.
``Task.max_new_tokens`` is enough for a whole answer (64 for the four-number and five-name ones).

Scoring follows RULER: ``string_match_all`` (the share of answers found in the prediction,
case-insensitive) for all tasks but ``qa``, which uses ``string_match_part`` (100 if any answer
is found). Scores are in [0, 100].
"""

from __future__ import annotations

import operator
import random
from typing import Any, Callable, Iterable, Sequence

from kvpolicy.errors import ConfigError, UnknownNameError

from . import aggregation, needles, qa, tracking
from .base import (METRICS, RngFactory, Sample, Task, build_chat, chat_text, count_tokens, string_match_all,
                   string_match_part)

__all__ = [
    "TASKS",
    "TOLERANCE",
    "METRICS",
    "Sample",
    "Task",
    "build_chat",
    "chat_text",
    "count_tokens",
    "get_task",
    "make_sample",
    "make_samples",
    "score",
    "string_match_all",
    "string_match_part",
]

TOLERANCE = 0.03
"""A sample's chat-templated prompt is at most ``length`` and at least ``(1 - TOLERANCE) * length`` tokens."""

# in the order of RULER's list: needles, tracking, aggregation, QA
TASKS: dict[str, Task] = {
    task.name: task for family in (needles, tracking, aggregation, qa) for task in family.TASKS
}


def get_task(name: str) -> Task:
    """The task named ``name``; ``UnknownNameError`` (a ``ConfigError``) lists the known ones."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise UnknownNameError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def _rng_factory(task: str, seed: int) -> RngFactory:
    # String seeds are hashed with SHA-512: the same on every run and platform, whatever PYTHONHASHSEED.
    return lambda stream: random.Random(f"kvpolicy.eval/{task}/{seed}/{stream}")


def _fit(tokens_at: Callable[[int], int], length: int, describe: str) -> int:
    """The largest ``n`` with ``tokens_at(n) <= length``, for ``tokens_at`` (nearly) increasing in ``n``."""
    base = tokens_at(0)
    if base > length:
        raise ConfigError(f"{describe}: length {length} is too small; the prompt without filler already takes {base} tokens")
    limit = 4 * length + 16  # every unit of filler is at least one token
    # Two secant steps from a small probe, then a bracket and a bisection.
    guess = 16
    for _ in range(2):
        grown = tokens_at(guess) - base
        guess = min(limit, max(1, int(guess * (length - base) / max(grown, 1))))
    step = max(1, guess // 100)
    if tokens_at(guess) <= length:
        lo, hi = guess, guess + step
        while hi < limit and tokens_at(hi) <= length:
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, limit)
        if tokens_at(hi) <= length:
            raise ConfigError(f"{describe}: the prompt does not grow with its filler; cannot reach {length} tokens")
    else:
        lo, hi = max(0, guess - step), guess
        while lo > 0 and tokens_at(lo) > length:
            hi, step = lo, step * 2
            lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens_at(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def _as_int(value: Any, what: str) -> int:
    """``value`` as a plain int (numpy integers too); not a bool, a float or a string."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    return operator.index(value)


def make_sample(task: str, tokenizer: Any, length: int, seed: int = 0) -> Sample:
    """Generate one ``task`` sample whose chat-templated prompt just fits in ``length`` tokens.

    The same ``(task, length, seed)`` and tokenizer always give the same sample. The prompt
    (``build_chat``'s output, answer prefix included) has between ``(1 - TOLERANCE) * length``
    and ``length`` tokens; keep ``length`` within the model's context. Raises ``ConfigError`` for
    an unknown task (listing the known ones) or a ``length`` too small to hold the task.
    """
    spec = get_task(task)
    length = _as_int(length, "length")
    if length < 1:
        raise ConfigError(f"length must be a positive number of tokens, got {length!r}")
    seed = _as_int(seed, "seed")
    rng = _rng_factory(task, seed)
    built: dict[int, Sample] = {}

    def sample_at(n: int) -> Sample:
        if n not in built:
            parts = spec.build(rng, n, length)
            sample = Sample(task, parts.prompt, parts.answers, length, seed, parts.question, parts.answer_prefix)
            sample.tokens = count_tokens(tokenizer, sample)
            built[n] = sample
        return built[n]

    n = _fit(lambda n: sample_at(n).tokens, length, f"task {task!r}")
    return sample_at(n)


def make_samples(
    tokenizer: Any, length: int, seeds: Iterable[int] = (0, 1, 2), tasks: Iterable[str] | None = None
) -> list[Sample]:
    """One sample per task (all of ``TASKS`` by default) and seed, task-major."""
    names = list(TASKS) if tasks is None else list(tasks)
    for name in names:
        get_task(name)
    seeds = list(seeds)
    return [make_sample(name, tokenizer, length, seed) for name in names for seed in seeds]


def score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """Score one prediction for ``task`` with that task's metric; a float in [0, 100]."""
    return METRICS[get_task(task).metric](prediction, answers)
