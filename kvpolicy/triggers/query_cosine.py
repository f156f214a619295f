from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..kernels import reference_step
from ..registry import register
from .base import Trigger


AGAINST = ("previous", "anchor")


@dataclass
class QueryCosineState:
    previous: torch.Tensor  # (batch, num_q_heads, head_dim): the query compared against
    has_previous: torch.Tensor  # (batch,) bool


@register("trigger", "query_cosine")
@dataclass
class QueryCosine(Trigger):
    """LouisKV's semantic-boundary trigger.

    Re-select when the mean over query heads of cos(q_t, q_ref) falls below ``tau``:
    consecutive queries that point the same way attend to the same KV, so the retrieved
    set is reused until the query moves. ``against="previous"`` (LouisKV) compares with the
    last step's query; ``"anchor"`` with the query of the last re-selection, so a slow drift
    that never shows between two adjacent steps still fires once it adds up.
    """

    tau: float = 0.7
    against: str = "previous"

    def validate(self) -> None:
        if not isinstance(self.tau, (int, float)) or math.isnan(self.tau) or not -1.0 <= self.tau <= 1.0:
            raise ConfigError(f"query_cosine trigger: tau must be a number in [-1, 1], got {self.tau!r}")
        if self.against not in AGAINST:
            raise ConfigError(f"query_cosine trigger: against must be one of {', '.join(AGAINST)}; got {self.against!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> QueryCosineState:
        return QueryCosineState(
            previous=torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=device),
            has_previous=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def prompt_selected(self, state: QueryCosineState, query: torch.Tensor) -> None:
        """The prompt's last query is the first step's reference (previous and anchor alike)."""
        state.previous.copy_(query.float())
        state.has_previous.fill_(True)

    def decide(self, query: torch.Tensor, state: QueryCosineState) -> torch.Tensor:
        # the layer also forces a first selection; has_previous marks exactly that step
        return reference_step.query_cosine_fire(query, state.previous, state.has_previous, self.tau,
                                                self.against == "anchor")

    def decide_fast(self, query: torch.Tensor, state: QueryCosineState, ops) -> torch.Tensor:
        if type(self).decide is not QueryCosine.decide:  # a subclass with its own decision
            return self.decide(query, state)
        return ops.query_cosine_fire(query, state.previous, state.has_previous, self.tau, self.against == "anchor")
