"""What every task family shares: the ``Sample`` a task makes, the ``Task`` that names its builder
and metric, the chat rendering of a sample, and RULER's two metrics."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvpolicy.errors import ConfigError


@dataclass
class Sample:
    """One generated task instance.

    ``prompt`` is the user message; ``answers`` every string the reply should contain (for
    ``qa``, any one of them); ``length`` the target size in tokens and ``seed`` the seed it was
    made from; ``question`` the question alone. ``answer_prefix`` is the start of the assistant's
    reply that ``build_chat`` appends after the generation prompt (RULER's answer prefix; it
    steers small models to answer at once); ``tokens`` the size of ``build_chat``'s output for the
    tokenizer the sample was made with.
    """

    task: str
    prompt: str
    answers: list[str]
    length: int
    seed: int
    question: str
    answer_prefix: str = ""
    tokens: int = 0

    @property
    def metric(self) -> str:
        """The name of the metric that scores this sample (``string_match_all`` or ``string_match_part``)."""
        from . import get_task

        return get_task(self.task).metric


RngFactory = Callable[[str], random.Random]


@dataclass
class Parts:
    """What a family's builder makes: the user's message, the question alone, the expected answers and
    the start of the reply (RULER's answer prefix)."""

    prompt: str
    question: str
    answers: list[str]
    answer_prefix: str


@dataclass(frozen=True)
class Task:
    """A task: its name, the RULER metric that scores it, its builder, and how many tokens to generate."""

    name: str
    metric: str
    description: str
    build: Callable[[RngFactory, int, int], Parts]
    max_new_tokens: int = 32
    """Enough new tokens for a complete answer (SmolLM2 spends one token per digit)."""


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer: Any, sample: Sample, *, answer_prefix: bool = True) -> str:
    """The text ``build_chat`` tokenizes: the chat template applied to ``sample.prompt`` as one user
    message with the generation prompt, then ``sample.answer_prefix`` (when ``answer_prefix``).
    Without a chat template: the prompt, a newline, then the answer prefix."""
    prefix = sample.answer_prefix if answer_prefix else ""
    if _has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.prompt}], tokenize=False, add_generation_prompt=True
        )
        return text + prefix
    return sample.prompt + "\n" + prefix


def build_chat(tokenizer: Any, sample: Sample, *, answer_prefix: bool = True) -> dict[str, Any]:
    """``{"input_ids", "attention_mask"}`` tensors of shape ``(1, tokens)`` for ``model.generate``.

    Applies the tokenizer's chat template (one user message, ``add_generation_prompt=True``)
    and appends the sample's answer prefix; a tokenizer without a chat template gets the plain
    prompt with its usual special tokens (BOS).
    """
    text = chat_text(tokenizer, sample, answer_prefix=answer_prefix)
    encoded = tokenizer(text, add_special_tokens=not _has_chat_template(tokenizer), return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def count_tokens(tokenizer: Any, sample: Sample, *, answer_prefix: bool = True) -> int:
    """How many tokens ``build_chat(tokenizer, sample)`` produces (without building tensors)."""
    text = chat_text(tokenizer, sample, answer_prefix=answer_prefix)
    return len(tokenizer(text, add_special_tokens=not _has_chat_template(tokenizer))["input_ids"])


def _check_answers(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        answers = [answers]
    answers = list(answers)
    if not answers:
        raise ConfigError("answers must hold at least one expected string, got none")
    return answers


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: 100 * the share of ``answers`` contained in ``prediction`` (case-insensitive)."""
    answers = _check_answers(answers)
    pred = prediction.lower()
    return 100.0 * sum(answer.lower() in pred for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_part``: 100 if any of ``answers`` is contained in ``prediction`` (case-insensitive), else 0."""
    answers = _check_answers(answers)
    pred = prediction.lower()
    return 100.0 if any(answer.lower() in pred for answer in answers) else 0.0


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}
