"""kvpolicy plugin: the ``query_drift`` trigger.

Installed, it is found through the ``kvpolicy.plugins`` entry point, so
``Policy(trigger="query_drift")`` works with no import; otherwise import this module
(or pass ``--plugin kvpolicy_query_drift`` to the CLI) before naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpolicy import ConfigError, Trigger, register

__all__ = ["QueryDrift", "QueryDriftState"]


@dataclass
class QueryDriftState:
    """Per-layer state (one per served layer, made by ``init_state`` after prefill)."""

    anchor: torch.Tensor  # (batch, num_q_heads, head_dim): the query at the sequence's last re-selection
    has_anchor: torch.Tensor  # (batch,) bool: False until the first decode step


@register("trigger", "query_drift")
@dataclass
class QueryDrift(Trigger):
    """Re-select when the mean over query heads of cos(q_t, anchor) falls below ``tau``.

    The anchor is the query of the step that last re-selected, per sequence: the retrieved
    KV was chosen for that query, so it is the one the current query must still resemble.
    LouisKV's ``query_cosine`` compares consecutive steps instead, and a query that turns a
    little at every step never trips it however far it ends up; here the turns add up.
    """

    tau: float = 0.7

    def validate(self) -> None:
        if not isinstance(self.tau, (int, float)) or math.isnan(self.tau) or not -1.0 <= self.tau <= 1.0:
            raise ConfigError(f"query_drift trigger: tau must be a number in [-1, 1], got {self.tau!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> QueryDriftState:
        # float32: cosines of bf16/fp16 queries near tau would flip on rounding
        return QueryDriftState(
            anchor=torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=device),
            has_anchor=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def decide(self, query: torch.Tensor, state: QueryDriftState) -> torch.Tensor:
        # Tensor ops only, no host reads or branches: the decode step stays CUDA-graph capturable.
        q = query.float()
        similarity = torch.nn.functional.cosine_similarity(q, state.anchor, dim=-1).mean(dim=-1)
        # The framework forces the first selection anyway, but the anchor must be taken then
        # too, so "no anchor yet" fires here as well.
        fire = (similarity < self.tau) | ~state.has_anchor
        # move the anchor only for the sequences that re-select now
        state.anchor.copy_(torch.where(fire[:, None, None], q, state.anchor))
        state.has_anchor.fill_(True)
        return fire
