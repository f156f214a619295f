"""A needle-in-a-haystack prompt generated locally: the demo's and the accuracy tests' long context.

The haystack is short, varied sentences drawn from a seeded RNG (no dataset, no download); the
needle is a five-digit passkey placed at a chosen depth; the question is asked both before and
after the document, inside the tokenizer's chat template. With full attention the embedded
SmolLM2-135M-Instruct (float32, greedy) answers it at 2K and 4K tokens for every seed and depth
tried, so a policy that loses the answer there has dropped KV that mattered. At 8K (the model's
whole context) it misses early needles (depth 0.1: 5 of 8 seeds right; 0.5 and 0.9: 8 of 8), so
keep pass/fail checks at 4K or below.

Example::

    from kvpolicy.models import load_model
    from kvpolicy.demo import needle_prompt, answer_is_correct

    model, tok = load_model()
    demo = needle_prompt(tok, target_tokens=4096, seed=0, depth=0.5)
    out = model.generate(demo.input_ids, attention_mask=demo.attention_mask,
                         max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, demo.num_tokens:], skip_special_tokens=True)
    assert answer_is_correct(text, demo)
"""

from __future__ import annotations

import bisect
import functools
import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy.errors import ConfigError

__all__ = ["DemoPrompt", "answer_is_correct", "needle_prompt"]

# Varied sentences rather than one repeated line: a repeated line is trivially compressible, so a
# retrieval policy would look better on it than on real text.
_SUBJECTS = (
    "The old farmer", "A young painter", "The tired baker", "My neighbour", "The teacher",
    "A small child", "The ship captain", "Our cousin", "The quiet student", "A travelling musician",
    "The shop owner", "The gardener", "A retired doctor", "The night guard", "The village cook",
    "A curious fox", "The postman", "An elderly poet",
)
_VERBS = (
    "walked to", "looked at", "painted", "cleaned", "visited", "talked about", "dreamed of",
    "fixed", "counted", "carried", "watched", "described", "sketched", "forgot about",
    "returned to", "waited near",
)
_OBJECTS = (
    "the wooden bridge", "a red barn", "the distant hills", "an empty market", "the river bank",
    "a broken fence", "the crowded harbour", "a field of wheat", "the stone tower",
    "a quiet library", "the apple orchard", "a narrow street", "the frozen lake",
    "an old lighthouse", "the green valley", "a dusty road",
)
_TIMES = (
    "in the morning", "after lunch", "before sunset", "on a rainy day", "during the winter",
    "at dawn", "late at night", "in early spring", "on Sunday", "after the storm", "every summer",
    "at noon",
)

_NEEDLE = "The secret passkey is {answer}. Remember it. {answer} is the passkey."
_QUESTION = "What is the secret passkey? Answer with the number only."
# The question comes first as well as last, so the model reads the document knowing what to look
# for. (With the question only at the end SmolLM2 scored the same at 4K; a bare repeated-sentence
# haystack with "What is the pass key?" failed outright.)
_TEMPLATE = (
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
    tokenizer: Any, target_tokens: int = 4096, seed: int = 0, depth: float = 0.5
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
    needle = _NEEDLE.format(answer=answer)
    # Every sentence is at least 4 tokens, so this many always overshoots the target.
    sentences = [_sentence(rng) for _ in range(target_tokens // 4 + 8)]

    @functools.lru_cache(maxsize=None)
    def render(count: int) -> tuple[str, list[int], list[tuple[int, int]] | None]:
        at = round(depth * count)
        document = " ".join(sentences[:at] + [needle] + sentences[at:count])
        return _tokenize(tokenizer, _TEMPLATE.format(question=_QUESTION, document=document))

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
        question=_QUESTION,
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


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TIMES)}."


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
