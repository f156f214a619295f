"""The score-gap trigger: re-select when the held selection is no longer what the selector would pick.

Each step the unit table is scored against the query (the selector's own score: one GEMV over
the table), and the layer re-selects when an unselected unit outscores the weakest selected one
by more than ``margin`` (in attention logits: scores times ``head_dim ** -0.5``, so a margin of
``m`` tolerates an unheld unit whose tokens would get up to ``e**m`` times the attention weight
of the weakest held one). A query that still points at what was selected keeps the selection,
however far it moved; a query that now needs KV outside it fires at once, at the step that needs
it, not after (EVAL.md: the query-cosine boundary came after the tokens that needed new KV).

Which units are held is not stored per unit (a per-unit mask would have to grow with the table
inside the step): it is the selector's fill of the query that made the selection (the anchor,
kept here) over the table as it is now, recomputed each step. For the prompt's units that is
exactly the held selection; decode units opened since are the approximation.

The trigger reads its layer's unit table, selector and retrieval capacity: the layer's prefill
hands itself over (``Trigger.attach``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..registry import register
from .base import Trigger


@dataclass
class ScoreGapState:
    anchor: torch.Tensor  # (batch, num_q_heads, head_dim) float32: the query of the last re-selection
    has_anchor: torch.Tensor  # (batch,) bool
    layer: Any = None  # the PolicyLayerState served (its units, selector, store and ops)
    # (batch,) float32, the last step's largest gap over the KV heads (for calibration and tests)
    gap: torch.Tensor | None = None


def held_mask(scores_at_anchor: torch.Tensor, units, capacity: int, ops) -> torch.Tensor:
    """``(B, H, U)`` bool: the units the selector's budgeted fill takes for these scores."""
    unit_ids, _, _, _ = ops.select_budget(scores_at_anchor, units.size, units.start, units.order, capacity, None)
    mask = torch.zeros(scores_at_anchor.shape, dtype=torch.bool, device=scores_at_anchor.device)
    # unit_ids: chosen units then -1; send the -1s to a spare column that is cut off
    index = torch.where(unit_ids >= 0, unit_ids, scores_at_anchor.shape[-1])
    padded = torch.zeros(*mask.shape[:-1], mask.shape[-1] + 1, dtype=torch.bool, device=mask.device)
    padded.scatter_(-1, index, True)
    return padded[..., :-1]


def score_gap(scores: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``(B, H)``: best unheld unit's score minus the weakest held unit's (``-inf`` where nothing is
    unheld and selectable; ``+inf`` where nothing is held but something could be)."""
    finite = scores > float("-inf")
    best_unheld = scores.masked_fill(held | ~finite, float("-inf")).amax(-1)
    weakest_held = scores.masked_fill(~held | ~finite, float("inf")).amin(-1)
    return best_unheld - weakest_held


def mass_gap(scores: torch.Tensor, held: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """``(B, H)``: log of the best unheld unit's estimated attention mass over the held units' mass.

    A unit's mass is estimated as ``size * exp(score)`` (its tokens at its mean key's logit), so
    ``log(size) + score``; ``-inf`` where nothing is unheld, ``+inf`` where nothing is held.
    """
    finite = scores > float("-inf")
    log_mass = scores + torch.log(size.clamp(min=1).float())
    best_unheld = log_mass.masked_fill(held | ~finite, float("-inf")).amax(-1)
    held_mass = torch.logsumexp(log_mass.masked_fill(~held | ~finite, float("-inf")), dim=-1)
    return best_unheld - held_mass


MEASURES = ("weakest", "mass")


@register("trigger", "score_gap")
@dataclass
class ScoreGap(Trigger):
    """Re-select when an unselected unit outscores the weakest selected one by more than ``margin``
    (attention logits), in any KV head. ``margin`` is calibrated per model (``kvpolicy calibrate``).

    Needs a selector that scores a unit table (``top_budget``, ``bound``).
    """

    margin: float = 1.0
    measure: str = "weakest"

    def validate(self) -> None:
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or math.isnan(self.margin):
            raise ConfigError(f"score_gap trigger: margin must be a number, got {self.margin!r}")
        if self.measure not in MEASURES:
            raise ConfigError(f"score_gap trigger: measure must be one of {', '.join(MEASURES)}; got {self.measure!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> ScoreGapState:
        state = ScoreGapState(
            anchor=torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=device),
            has_anchor=torch.zeros(batch, dtype=torch.bool, device=device),
            gap=torch.zeros(batch, dtype=torch.float32, device=device),
        )
        return state

    def attach(self, state: ScoreGapState, layer: Any) -> None:
        """Serve ``layer`` (a ``PolicyLayerState`` after its prefill built the unit table)."""
        from ..units.table import UnitTable

        selector = layer.policy.selector
        if selector is None or not isinstance(layer.units, UnitTable):
            raise ConfigError(
                "score_gap trigger: needs a selector that scores a unit table (top_budget or bound, with pages, "
                f"kmeans or segments units); this policy has selector {type(selector).__name__} over "
                f"{type(layer.units).__name__}"
            )
        state.layer = layer

    def scores(self, query: torch.Tensor, layer: Any) -> torch.Tensor:
        """``(B, H, U)`` the layer's selector scores for ``query (B, Hq, D)``, in attention logits."""
        return layer.policy.selector.unit_scores(query, layer.units, layer.ops) * query.shape[-1] ** -0.5

    def decide(self, query: torch.Tensor, state: ScoreGapState) -> torch.Tensor:
        layer = state.layer
        if layer is None:
            raise ConfigError("score_gap trigger: its state was not attached to a layer (Trigger.attach)")
        now = self.scores(query, layer)
        held = held_mask(self.scores(state.anchor, layer), layer.units, layer.store.retrieval_capacity, layer.ops)
        if self.measure == "weakest":
            gap = score_gap(now, held)
        else:
            gap = mass_gap(now, held, layer.units.size)
        gap = gap.amax(-1)  # (B,): the worst KV head decides
        fire = (gap > self.margin) | ~state.has_anchor
        state.gap.copy_(gap.clamp(min=-1e4, max=1e4))
        state.anchor.copy_(torch.where(fire.view(-1, 1, 1), query.float(), state.anchor))
        state.has_anchor.fill_(True)
        return fire
