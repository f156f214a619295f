"""Long-output fidelity: how closely a policy tracks full attention over a long generation.

Full attention generates ``new_tokens`` tokens from a prompt. Along that output each policy is
measured two ways:
  teacher-forced  fed full attention's tokens; per-token KL(full || policy) of the next-token
                  distributions and top-1 agreement (the policy would pick full's token);
  free-running    generating on its own; the share of positions where its token equals full's,
                  and how many tokens it writes before its first divergence (position-wise
                  agreement mostly measures where that first divergence falls).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..policy import Policy
from . import decode as decoding
from .defaults import FIDELITY_NEW_TOKENS
from .tasks import build_chat, make_sample

LONG_OUTPUT_INSTRUCTION = "Retell the document above in your own words, in detail, paragraph by paragraph."


@dataclass
class Fidelity:
    preset: str
    budget: int | None
    new_tokens: int
    kl_mean: float
    top1_agreement: float
    free_agreement: float
    free_prefix: int  # tokens equal to full's before the first divergence
    reselect_share: float | None


def long_output_prompt(tokenizer, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A ``length``-token synthetic document with an instruction that asks for a long reply."""
    sample = make_sample("qa", tokenizer, length, seed)
    if sample.question not in sample.prompt:
        raise ValueError("the qa task's prompt no longer contains its question; update long_output_prompt")
    sample = replace(sample, prompt=sample.prompt.replace(sample.question, LONG_OUTPUT_INSTRUCTION), answer_prefix="")
    return build_chat(tokenizer, sample)


def _kl(full_logits: list[torch.Tensor], policy_logits: list[torch.Tensor]) -> tuple[float, float]:
    full = torch.stack(full_logits).float().log_softmax(-1)
    ours = torch.stack(policy_logits).float().log_softmax(-1)
    kl = (full.exp() * (full - ours)).sum(-1)
    top1 = (full.argmax(-1) == ours.argmax(-1)).float()
    return kl.mean().item(), top1.mean().item()


def measure(model, prefilled: decoding.Prefilled, policies: list[Policy], new_tokens: int = FIDELITY_NEW_TOKENS) -> list[Fidelity]:
    """Fidelity of each policy against full attention's greedy ``new_tokens``-token output."""
    from ..presets import preset

    reference = decoding.decode(model, prefilled, preset("full"), new_tokens, keep_logits=True)
    results = []
    for policy in policies:
        forced = decoding.decode(model, prefilled, policy, new_tokens, forced=reference.tokens, keep_logits=True)
        kl, top1 = _kl(reference.logits, forced.logits)
        free = decoding.decode(model, prefilled, policy, new_tokens)
        same = [a == b for a, b in zip(free.tokens, reference.tokens)]
        prefix = same.index(False) if False in same else len(same)
        results.append(Fidelity(policy.name, policy.budget, new_tokens, kl, top1, sum(same) / new_tokens, prefix,
                                forced.reselect_share))
    return results
