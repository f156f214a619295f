from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import reference
from ..registry import register
from .base import Selector


@register("selector", "top_budget")
@dataclass
class TopBudget(Selector):
    """Rank units by their mean key against the query group (LouisKV, ClusterKV, ArkVale-style).

    A unit's score is the mean over the group's query heads of ``q . mean_key``: one ranking
    per KV head, so every query head of a GQA group sees the same KV.
    """

    # ``select`` computes this score with the ``unit_scores`` kernel op
    score_method: ClassVar[str] = "mean"

    def score(self, query_group: torch.Tensor, units) -> torch.Tensor:
        # (sum_g q_g) . key_mean / G; see reference.mean_key_scores
        return reference.mean_key_scores(query_group, units.key_mean)
