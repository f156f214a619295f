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
from kvpolicy.kernels.reference_step import query_cosine_fire

__all__ = ["QueryDrift", "QueryDriftState"]


@dataclass
class QueryDriftState:
    """Per-layer state (one per served layer, made by ``init_state`` after prefill)."""

    anchor: torch.Tensor  # (batch, num_q_heads, head_dim): the query at the sequence's last re-selection
    has_anchor: torch.Tensor  # (batch,) bool: False until the first decode step
    age: torch.Tensor  # (batch,) long: decode steps since the sequence last re-selected


@register("trigger", "query_drift")
@dataclass
class QueryDrift(Trigger):
    """Re-select when the mean over query heads of cos(q_t, anchor) falls below ``tau``, or
    when the selection is ``max_age`` steps old.

    The anchor is the query of the step that last re-selected, per sequence: the retrieved
    KV was chosen for that query, so it is the one the current query must still resemble
    (the built-in ``query_cosine(tau, against="anchor")``, whose op this trigger calls).
    What the built-ins lack is ``max_age``: a bound on how long a selection is kept whatever
    the query says, so tokens generated since it was made get their chance to be retrieved.
    ``max_age=None`` (the default) keeps the anchor comparison alone.
    """

    tau: float = 0.7
    max_age: int | None = None

    def validate(self) -> None:
        if not isinstance(self.tau, (int, float)) or math.isnan(self.tau) or not -1.0 <= self.tau <= 1.0:
            raise ConfigError(f"query_drift trigger: tau must be a number in [-1, 1], got {self.tau!r}")
        if self.max_age is not None and (isinstance(self.max_age, bool) or not isinstance(self.max_age, int)
                                         or self.max_age < 1):
            raise ConfigError(f"query_drift trigger: max_age must be an integer >= 1 (steps) or None, "
                              f"got {self.max_age!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> QueryDriftState:
        # float32: cosines of bf16/fp16 queries near tau would flip on rounding
        return QueryDriftState(
            anchor=torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=device),
            has_anchor=torch.zeros(batch, dtype=torch.bool, device=device),
            age=torch.zeros(batch, dtype=torch.long, device=device),
        )

    def decide(self, query: torch.Tensor, state: QueryDriftState) -> torch.Tensor:
        # Tensor ops only, no host reads or branches: the decode step stays CUDA-graph capturable.
        # The framework forces the first selection anyway, but the anchor must be taken then too,
        # so "no anchor yet" fires as well; the anchor moves only where the cosine fired.
        fire = query_cosine_fire(query, state.anchor, state.has_anchor, self.tau, True)
        if self.max_age is not None:
            old = state.age >= self.max_age - 1
            # a selection made because it was old is made for this query: it becomes the anchor
            state.anchor.copy_(torch.where((old & ~fire)[:, None, None], query.float(), state.anchor))
            fire = fire | old
        state.age.copy_(torch.where(fire, torch.zeros_like(state.age), state.age + 1))
        return fire
