from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import Selector


@register("selector", "top_budget")
@dataclass
class TopBudget(Selector):
    """Rank units by their mean key against the query group (LouisKV, ClusterKV, ArkVale-style).

    A unit's score is the mean over the group's query heads of ``q . mean_key``: one ranking
    per KV head, so every query head of a GQA group sees the same KV.
    """

    def score(self, query_group: torch.Tensor, units) -> torch.Tensor:
        # q . (sum / size) = (q . sum) / size: no (B, H, U, D) table of means each step
        summed = torch.einsum("bhgd,bhud->bhu", query_group, units.key_sum)
        return summed / (units.size.clamp(min=1) * query_group.shape[2])
