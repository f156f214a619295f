from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..kernels import reference_step
from ..registry import register
from .base import Decision, Trigger


@dataclass
class IntervalState:
    steps: torch.Tensor  # (batch,) decode steps seen by this layer


@register("trigger", "interval")
@dataclass
class Interval(Trigger):
    """Re-select every ``n`` decode steps (the first step always selects, unless the policy's
    first selection was the prompt's: then steps ``n - 1``, ``2n - 1``, ...)."""

    n: int = 16

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"interval trigger: n must be an integer >= 1, got {self.n!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> IntervalState:
        return IntervalState(steps=torch.zeros(batch, dtype=torch.long, device=device))

    def prompt_selected(self, state: IntervalState, query: torch.Tensor) -> None:
        """The prompt's selection counts as the one before the first step: the next is ``n`` later."""
        state.steps.fill_(1)

    def decide(self, query: torch.Tensor, state: IntervalState) -> torch.Tensor:
        return reference_step.interval_fire(state.steps, self.n)

    def decide_fast(self, query: torch.Tensor, state: IntervalState, ops) -> torch.Tensor:
        if type(self).decide is not Interval.decide:  # a subclass with its own decision
            return self.decide(query, state)
        return ops.interval_fire(state.steps, self.n)

    def decide_and_note(self, query: torch.Tensor, state: IntervalState, ops, decision: Decision) -> None:
        """The fire and the note in one launch (``interval_decision``)."""
        if type(self).decide is not Interval.decide:
            return super().decide_and_note(query, state, ops, decision)
        ops.interval_decision(state.steps, self.n, *decision)
