from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import reference
from ..registry import register
from .base import Selector


@register("selector", "bound")
@dataclass
class Bound(Selector):
    """Quest's upper bound: ``sum_d max(q_d * min_d, q_d * max_d)`` over a unit's key box.

    The bound holds for any key in the unit; over a GQA group the largest bound of its
    query heads is taken, so the unit is kept if any head of the group could need it.
    """

    # ``select`` computes this score with the ``unit_scores`` kernel op
    score_method: ClassVar[str] = "bound"

    def score(self, query_group: torch.Tensor, units) -> torch.Tensor:
        # relu(q) . max + min(q, 0) . min, largest over the group; see reference.key_bound_scores
        return reference.key_bound_scores(query_group, units.key_min, units.key_max, units.selectable)
