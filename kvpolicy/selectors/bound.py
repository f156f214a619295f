from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import Selector


@register("selector", "bound")
@dataclass
class Bound(Selector):
    """Quest's upper bound: ``sum_d max(q_d * min_d, q_d * max_d)`` over a unit's key box.

    The bound holds for any key in the unit; over a GQA group the largest bound of its
    query heads is taken, so the unit is kept if any head of the group could need it.
    """

    def score(self, query_group: torch.Tensor, units) -> torch.Tensor:
        q = query_group.unsqueeze(3)  # (B, H, G, 1, D)
        low = units.key_min.unsqueeze(2)
        high = units.key_max.unsqueeze(2)
        # empty units have +-inf bounds; they are masked by the caller, keep them finite here
        bound = torch.maximum(q * low, q * high).nan_to_num(0.0, posinf=0.0, neginf=0.0).sum(-1)
        return bound.amax(dim=2)
