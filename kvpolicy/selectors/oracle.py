from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import Selector


@register("selector", "oracle")
@dataclass
class Oracle(Selector):
    """The exact upper bound: units ranked by the attention mass the query group gives them.

    Over single-token units (``pages(size=1)``) this is the true top-budget selection of each
    step (the ``oracle`` preset): softmax of ``q . k / sqrt(d)`` per query head over the
    retrievable tokens, summed over the GQA group. It reads every key each step, so it is a
    yardstick for evaluation, not a method to deploy.
    """

    def score(self, query_group: torch.Tensor, units) -> torch.Tensor:
        dim = query_group.shape[-1]
        logits = torch.einsum("bhgd,bhud->bhgu", query_group, units.mean_keys()) * dim**-0.5
        logits = logits.masked_fill(~units.selectable.unsqueeze(2), float("-inf"))
        return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)
