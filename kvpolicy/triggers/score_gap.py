"""The score-gap trigger: re-select when the held selection is no longer what the selector would pick.

Each step the unit table is scored against the query (the selector's own score: one GEMV over
the table), and the layer re-selects when an unselected unit outscores the weakest selected one
by more than ``margin`` (in attention logits: scores times ``head_dim ** -0.5``, so a margin of
``m`` tolerates an unheld unit whose tokens would get up to ``e**m`` times the attention weight
of the weakest held one). A query that still points at what was selected keeps the selection,
however far it moved; a query that now needs KV outside it fires at once, at the step that needs
it, not after (EVAL.md: the query-cosine boundary came after the tokens that needed new KV).

Which units are held is kept in the trigger's state, as unit ids (at most one a retrieved row, so
a fixed ``(B, H, R)`` list that never grows with the table): the selector's ``Selection`` of each
re-selection (``Trigger.selected``), then, each step, the decode unit that took the token which
left the local window: added where the retrieved buffer admitted that token (it had room, or the
policy's ``admit="evict"`` gave it a selected row), dropped where it did not (a unit some of whose
tokens are not attended is not held). A selected unit whose rows ``admit="evict"`` gave up to
leaving tokens is dropped too (the buffer's rows follow the selection's order, so the row where
each listed unit ends says when it loses one). A step scores the
table once, at its own query; the held mask is a scatter of that list.

The trigger reads its layer's unit table, selector and retrieval capacity: the layer's prefill
hands itself over (``Trigger.attach``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..registry import register
from .base import Trigger


@dataclass
class ScoreGapState:
    has_selection: torch.Tensor  # (batch,) bool: a selection was made (``selected``)
    layer: Any = None  # the PolicyLayerState served (its units, selector, store and ops)
    # (batch,) float32, the last step's largest gap over the KV heads (for calibration and tests)
    gap: torch.Tensor | None = None
    # the rest is made by ``attach``, sized by the layer's KV heads and retrieval capacity R
    held: torch.Tensor | None = None  # (B, H, R) long: the held units' ids, -1 elsewhere
    held_count: torch.Tensor | None = None  # (B, H) long: entries of ``held`` written since the selection
    # what the table and the retrieved buffer looked like at the last look, to see what the
    # last step's leaving token did: the open decode unit (B,), its size and the buffer's fill (B, H)
    seen_open: torch.Tensor | None = None
    seen_size: torch.Tensor | None = None
    seen_admitted: torch.Tensor | None = None
    # (B, H, R) long: the buffer row where each listed unit of the selection ends (its rows are the
    # selection's, in order); 0 for units listed since (never given up by ``admit="evict"``)
    held_end: torch.Tensor | None = None
    units_at_selection: torch.Tensor | None = None  # (B,) long: decode units opened by the last selection
    above: Any = None  # the PolicyLayerState of the preceding served layer, for ``follow``


def held_units_mask(held: torch.Tensor, capacity: int) -> torch.Tensor:
    """``(B, H, capacity)`` bool: True at the unit ids listed in ``held (B, H, K)`` (-1: none)."""
    index = torch.where(held >= 0, held, capacity)  # the -1s go to a spare column that is cut off
    padded = torch.zeros(*held.shape[:-1], capacity + 1, dtype=torch.bool, device=held.device)
    padded.scatter_(-1, index, True)
    return padded[..., :-1]


def _open_unit_size(units) -> torch.Tensor:
    """``(B, H)`` the size of each sequence's open decode unit (unit 0's where none is open)."""
    batch, heads = units.size.shape[:2]
    index = units.open_unit.clamp(min=0).view(batch, 1, 1).expand(batch, heads, 1)
    return units.size.gather(2, index)[..., 0]


def score_gap(scores: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``(B, H)``: best unheld unit's score minus the weakest held unit's (``-inf`` where nothing is
    unheld and selectable; ``+inf`` where nothing is held but something could be)."""
    finite = scores > float("-inf")
    best_unheld = scores.masked_fill(held | ~finite, float("-inf")).amax(-1)
    weakest_held = scores.masked_fill(~held | ~finite, float("inf")).amin(-1)
    nothing_held = ~(held & finite).any(-1)
    return torch.where(nothing_held, best_unheld.masked_fill(best_unheld > float("-inf"), float("inf")),
                       best_unheld - weakest_held)


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
LEAVING = ("unheld", "ignored")


@register("trigger", "score_gap")
@dataclass
class ScoreGap(Trigger):
    """Re-select when an unselected unit outscores the weakest selected one by more than ``margin``
    (attention logits), in any KV head. ``margin`` is calibrated per model (``kvpolicy calibrate``).

    Needs a selector that scores a unit table (``top_budget``, ``bound``).
    """

    margin: float = 1.0
    measure: str = "weakest"
    # in a layer whose preceding served layer re-selected at this step (per sequence), the margin is
    # ``margin - follow``: 0 ignores the other layers, ``inf`` re-selects whenever the layer above did
    follow: float = 0.0
    # the tokens that leave the local window while the selection is kept, with no room left in the
    # retrieved buffer, are not attended. "unheld": their units are unheld, so they can fire (what
    # is attended); "ignored": they neither fire nor count as held (units opened since the
    # selection, and the selection's units that took such tokens, stay as they were), as LouisKV
    # reuses its selection until the next boundary whatever left the window meanwhile
    leaving: str = "unheld"

    def validate(self) -> None:
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or math.isnan(self.margin):
            raise ConfigError(f"score_gap trigger: margin must be a number, got {self.margin!r}")
        if self.measure not in MEASURES:
            raise ConfigError(f"score_gap trigger: measure must be one of {', '.join(MEASURES)}; got {self.measure!r}")
        if self.leaving not in LEAVING:
            raise ConfigError(f"score_gap trigger: leaving must be one of {', '.join(LEAVING)}; got {self.leaving!r}")
        if not isinstance(self.follow, (int, float)) or isinstance(self.follow, bool) or not self.follow >= 0:
            raise ConfigError(f"score_gap trigger: follow must be a number >= 0 (inf: always), got {self.follow!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> ScoreGapState:
        return ScoreGapState(
            has_selection=torch.zeros(batch, dtype=torch.bool, device=device),
            gap=torch.zeros(batch, dtype=torch.float32, device=device),
        )

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
        # the layer above is the one attached just before, in this prefill: lower index, same batch
        above = getattr(self, "_last_attached", lambda: None)()
        if above is not None and above.layer is not None and above.layer.layer_idx < layer.layer_idx and \
                above.has_selection.shape == state.has_selection.shape and \
                above.has_selection.device == state.has_selection.device:
            state.above = above.layer
        else:
            state.above = None
        object.__setattr__(self, "_last_attached", weakref.ref(state))  # weak: the cache may go
        units, device = layer.units, layer.units.size.device
        batch, heads = units.size.shape[:2]
        # a unit held has a token in a retrieved row, so R ids cover every selection
        room = max(layer.store.retrieval_capacity, 1)
        state.held = torch.full((batch, heads, room), -1, dtype=torch.long, device=device)
        state.held_count = torch.zeros(batch, heads, dtype=torch.long, device=device)
        state.seen_open = units.open_unit.clone()
        state.seen_size = _open_unit_size(units)
        state.seen_admitted = layer.store.admitted.clone()
        state.held_end = torch.zeros(batch, heads, room, dtype=torch.long, device=device)
        state.units_at_selection = units.decode_units.clone()

    def selected(self, state: ScoreGapState, selection: Any, reselect: torch.Tensor) -> None:
        """The rows that re-selected hold exactly ``selection.unit_ids`` (the fetch made it so);
        the table and buffer as they are now (after this step's leaving token) are the new baseline."""
        ids = selection.unit_ids
        room = state.held.shape[-1]
        if ids.shape[-1] >= room:
            ids = ids[..., :room]  # chosen units come first; past R there are only -1s
        else:
            ids = torch.nn.functional.pad(ids, (0, room - ids.shape[-1]), value=-1)
        rows = reselect.view(-1, 1)
        state.held.copy_(torch.where(rows.unsqueeze(-1), ids, state.held))
        state.held_count.copy_(torch.where(rows, (ids >= 0).sum(-1), state.held_count))
        units, store = state.layer.units, state.layer.store
        state.seen_open.copy_(torch.where(reselect, units.open_unit, state.seen_open))
        state.seen_size.copy_(torch.where(rows, _open_unit_size(units), state.seen_size))
        state.seen_admitted.copy_(torch.where(rows, store.admitted, state.seen_admitted))
        # sizes as the selector filled them (the leaving token was filed before it ran)
        sizes = units.size.gather(2, ids.clamp(min=0)).masked_fill(ids < 0, 0)
        ends = torch.cumsum(sizes, dim=-1).clamp(max=store.retrieval_capacity)
        state.held_end.copy_(torch.where(rows.unsqueeze(-1), ends.masked_fill(ids < 0, 0), state.held_end))
        state.units_at_selection.copy_(torch.where(reselect, units.decode_units, state.units_at_selection))
        state.has_selection.logical_or_(reselect)

    def _follow_leaving_token(self, state: ScoreGapState) -> None:
        """Bring ``held`` up to date with the token that left the local window since the last look:
        the open decode unit took it (the table grew) and the retrieved buffer admitted it (its fill
        grew) or not. In place, device only."""
        units, store = state.layer.units, state.layer.store
        unit = units.open_unit  # (B,)
        size = _open_unit_size(units)
        admitted_now = store.admitted
        moved = (unit != state.seen_open).view(-1, 1)
        appended = (unit >= 0).view(-1, 1) & (moved | (size != state.seen_size))  # (B, H)
        admitted = admitted_now > state.seen_admitted
        listed = state.held == unit.view(-1, 1, 1)  # (B, H, R)
        add = appended & admitted & ~listed.any(-1)
        room = state.held.shape[-1]
        position = state.held_count.clamp(max=room - 1).unsqueeze(-1)
        current = state.held.gather(2, position)
        state.held.scatter_(2, position, torch.where(add.unsqueeze(-1), unit.view(-1, 1, 1).expand_as(current), current))
        end_now = state.held_end.gather(2, position)
        state.held_end.scatter_(2, position, torch.where(add.unsqueeze(-1), 0, end_now))
        if state.layer.policy.admit == "evict":
            # selected units whose last rows a leaving token took: rows [kept, ...) are no longer
            # the selection's (a branch on the policy's spec, not on a tensor)
            state.held.masked_fill_(state.held_end > store.kept.unsqueeze(-1), -1)
        state.held_count.add_(add.long())
        if self.leaving == "unheld":
            # a token of a held unit that was not admitted: the unit is no longer all attended
            drop = (appended & ~admitted).unsqueeze(-1) & listed
            state.held.masked_fill_(drop, -1)
        state.seen_open.copy_(unit)
        state.seen_size.copy_(size)
        state.seen_admitted.copy_(admitted_now)

    def scores(self, query: torch.Tensor, layer: Any) -> torch.Tensor:
        """``(B, H, U)`` the layer's selector scores for ``query (B, Hq, D)``, in attention logits."""
        return layer.policy.selector.unit_scores(query, layer.units, layer.ops) * query.shape[-1] ** -0.5

    def held_mask(self, state: ScoreGapState) -> torch.Tensor:
        """``(B, H, U)`` bool over the layer's unit table: the units the layer holds now."""
        return held_units_mask(state.held, state.layer.units.capacity)

    def decide(self, query: torch.Tensor, state: ScoreGapState) -> torch.Tensor:
        layer = state.layer
        if layer is None:
            raise ConfigError("score_gap trigger: its state was not attached to a layer (Trigger.attach)")
        self._follow_leaving_token(state)
        now = self.scores(query, layer)
        held = self.held_mask(state)
        if self.leaving == "ignored":
            # units opened since the selection that the buffer did not admit are no candidates
            first_new = layer.units.num_prompt_units + state.units_at_selection  # (B,)
            ids = torch.arange(now.shape[-1], device=now.device)
            opened = ids.view(1, 1, -1) >= first_new.view(-1, 1, 1)
            now = now.masked_fill(opened & ~held, float("-inf"))
        if self.measure == "weakest":
            gap = score_gap(now, held)
        else:
            gap = mass_gap(now, held, layer.units.size)
        gap = gap.amax(-1)  # (B,): the worst KV head decides
        fire = (gap > self.margin) | ~state.has_selection
        if self.follow > 0 and state.above is not None:
            # the layer above decided this step already (its ``reselect``, on the device)
            fire = fire | (state.above.reselect & (gap > self.margin - self.follow))
        state.gap.copy_(gap.clamp(min=-1e4, max=1e4))
        return fire
