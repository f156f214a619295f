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

Measures: ``weakest`` and ``mass`` (above); ``rank``, how many unheld units outscore the held units'
mean score (the units the selector would now rank in the upper part of its selection; ``margin`` is
then a count), which is scale-free per layer and does not go through a unit's mass estimate (EVAL.md,
"Trigger candidates on 16 samples": the mean-key mass estimate missed a needle token that one query
head attended). ``cap`` bounds how long a selection is kept.

The trigger reads its layer's unit table, selector and retrieval capacity: the layer's prefill
hands itself over (``Trigger.attach``).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..kernels import reference_step
from ..kernels.reference_step import held_units_mask, open_unit_size
from ..registry import register
from .base import Decision, Trigger
from .outlier_keys import OutlierKeys, prompt_key_basis, take_outlier_keys


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
    # (B, H, U) uint8, the Triton ops' held marks: the held list as a mask, kept in step with it
    # (``kernels/triton/score_gap.py``)
    held_marks: torch.Tensor | None = None
    # (B,) long: steps since the last selection, this one included (counted where ``cap`` is set)
    age: torch.Tensor | None = None
    # (B,) long: the layer's steps so far (counted where ``every`` > 1: which steps measure the gap)
    steps: torch.Tensor | None = None
    # ``estimate="outlier"``: each prompt unit's outlier keys, taken from the pool at attach
    outliers: OutlierKeys | None = None
    # ``challengers``: (B, H, G, C) long, the unheld units a measured step found strongest (-1: none)
    challengers: torch.Tensor | None = None
    # (B, H) int32, the fused op's check of each KV head's challengers (``score_gap_challengers.py``)
    challenger_flags: torch.Tensor | None = None
    # ``low_rank``: (B, H, D, low_rank) float32, each KV head's directions of most prompt key energy
    key_basis: torch.Tensor | None = None


MEASURES = ("weakest", "mass", "rank")
LEAVING = ("unheld", "ignored")
ESTIMATES = ("mean", "bound", "gauss", "outlier")
GROUPS = ("mean", "each")


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
    # how an unheld unit's mass is estimated (measure "mass"): "mean", its tokens at its mean key's
    # logit; "bound", at least one token at its key bound (Quest's upper bound from the units' key
    # min and max: a unit whose mean hides one spiking token counts by that token). The held units'
    # mass stays at the mean estimate. "bound" scores the table a second time each step. "gauss": every
    # unit's mass as the mean of exp(q.k) under a diagonal Gaussian spread of its keys (the prompt
    # units' variances taken once from the pool). "outlier": every prompt unit's mass as its ``outliers``
    # keys farthest from its mean key, each at its own logit, plus its other tokens at their mean key's
    # logit (a needle token that is its unit's outlier counts by itself; decode units keep "mean"),
    # taken at attach (``outlier_keys.py``) and scored by its own op (``score_gap_outlier_fire``, fused
    # on the triton backend, with ``group`` "mean" or "each"). "bound", "gauss", ``group="each"`` with
    # the mean estimate and ``count`` are reference-only experiments (EVAL.md, "Trigger candidates on 16
    # samples": none beat the default); the fused op refuses them with a ConfigError
    estimate: str = "mean"
    # ``estimate="outlier"``: how many keys of each prompt unit are kept and scored one by one
    outliers: int = 1
    # a selection is kept at most ``cap`` steps (0: no cap): the layer also re-selects when its
    # selection is ``cap`` steps old, whatever the gap
    cap: int = 0
    # whose query measures the gap: "mean", the selector's score (the mean over the KV head's query
    # group); "each", every query head's own score, the largest gap over the query heads deciding
    # (one query head that needs an unheld unit fires, where the group's mean can hide it)
    group: str = "mean"
    # also re-select where more than ``count`` unheld units outscore the held units' mean score (the
    # ``rank`` measure's count, beside the measure's own gap; 0: off)
    count: float = 0.0
    # a margin per layer (``margins[i]`` for layer ``i``; ``margin`` for the layers past its end): the
    # gap's scale and rate differ by layer; empty: ``margin`` everywhere
    margins: tuple = ()
    # measure the gap every ``every``-th step only (layer ``i`` at the steps ``s`` where ``(s + i) % every``
    # is 0, so each step measures ``1/every`` of the layers); between them the layer keeps its selection
    # (unless it has none, or ``cap`` says). 1: every step. The trigger's bytes a step fall by ``every``
    every: int = 1
    # with ``every`` > 1 and ``estimate="outlier"``: a measured step also keeps, per query head, the
    # ``challengers`` unheld units of largest estimated mass, and the steps between measure the gap against
    # those units alone instead of keeping the selection (a unit can only rise past them unseen until the
    # next measured step); the fused op then reads only the held units' and challengers' keys. 0: off
    challengers: int = 0
    # with ``estimate="outlier"``: a first pass at rank ``low_rank`` (0: off). Each step it estimates the unheld
    # units' mass from the query projected on the ``low_rank`` directions of most prompt key energy of each KV
    # head (taken at attach), and only the ``low_rank_top`` strongest units a query head are estimated whole and
    # can fire: the rest of the table is not read whole. Approximate: it can miss a fire whose unit the first
    # pass ranks lower (EVAL.md, "A low-rank first pass"). Reference only for now
    low_rank: int = 0
    low_rank_top: int = 16
    # with ``estimate="outlier"``: the query's products with the prompt units' int8 keys and rest means taken in
    # 14-bit fixed point (each query head's elements as integers times a power of two, from its largest; one
    # rounding of at most 2**-14 of that largest), so the fused op multiplies int8 by int8 on tensor cores
    # instead of converting every key to a 16-bit type (``kernels/fixed_point.py``); decode units' means as before
    fixed_query: bool = False
    # the spec names these only when set (``Policy.to_dict``): eval cells of the old settings resume
    SPEC_OMITS_AT_DEFAULT = {"estimate": "mean", "cap": 0, "group": "mean", "count": 0.0, "margins": (),
                             "outliers": 1, "every": 1, "challengers": 0, "low_rank": 0, "low_rank_top": 16,
                             "fixed_query": False}

    def margin_of(self, layer_idx: int) -> float:
        """The margin of layer ``layer_idx`` (``margins``, else ``margin``)."""
        return float(self.margins[layer_idx]) if layer_idx < len(self.margins) else float(self.margin)

    def validate(self) -> None:
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) or math.isnan(self.margin):
            raise ConfigError(f"score_gap trigger: margin must be a number, got {self.margin!r}")
        if self.measure not in MEASURES:
            raise ConfigError(f"score_gap trigger: measure must be one of {', '.join(MEASURES)}; got {self.measure!r}")
        if self.leaving not in LEAVING:
            raise ConfigError(f"score_gap trigger: leaving must be one of {', '.join(LEAVING)}; got {self.leaving!r}")
        if not isinstance(self.follow, (int, float)) or isinstance(self.follow, bool) or not self.follow >= 0:
            raise ConfigError(f"score_gap trigger: follow must be a number >= 0 (inf: always), got {self.follow!r}")
        if self.estimate not in ESTIMATES:
            raise ConfigError(f"score_gap trigger: estimate must be one of {', '.join(ESTIMATES)}; "
                              f"got {self.estimate!r}")
        if self.estimate == "bound" and self.group != "mean":
            raise ConfigError(f"score_gap trigger: estimate {self.estimate!r} takes group 'mean' only; got group "
                              f"{self.group!r}")
        if self.estimate != "mean" and self.measure != "mass":
            raise ConfigError(f"score_gap trigger: estimate {self.estimate!r} needs measure 'mass' (it estimates "
                              f"an unheld unit's mass); got measure {self.measure!r}")
        if not isinstance(self.outliers, int) or isinstance(self.outliers, bool) or self.outliers < 1:
            raise ConfigError(f"score_gap trigger: outliers must be an integer >= 1, got {self.outliers!r}")
        if self.outliers != 1 and self.estimate != "outlier":
            raise ConfigError(f"score_gap trigger: outliers is read by estimate 'outlier' only; got estimate "
                              f"{self.estimate!r}")
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(f"score_gap trigger: every must be an integer >= 1 (1: every step), got {self.every!r}")
        if not isinstance(self.challengers, int) or isinstance(self.challengers, bool) or self.challengers < 0:
            raise ConfigError(f"score_gap trigger: challengers must be an integer >= 0 (0: off), got "
                              f"{self.challengers!r}")
        if self.challengers and (self.estimate != "outlier" or self.every < 2):
            raise ConfigError(f"score_gap trigger: challengers needs estimate 'outlier' and every >= 2 (it measures "
                              f"the steps between measured ones); got estimate {self.estimate!r}, every {self.every!r}")
        for name, least in (("low_rank", 0), ("low_rank_top", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"score_gap trigger: {name} must be an integer >= {least}, got {value!r}")
        if self.low_rank and (self.estimate != "outlier" or self.challengers):
            raise ConfigError(f"score_gap trigger: low_rank needs estimate 'outlier' and no challengers (both narrow "
                              f"the units measured); got estimate {self.estimate!r}, challengers {self.challengers!r}")
        if not isinstance(self.fixed_query, bool):
            raise ConfigError(f"score_gap trigger: fixed_query must be true or false, got {self.fixed_query!r}")
        if self.fixed_query and self.estimate != "outlier":
            raise ConfigError("score_gap trigger: fixed_query is read by estimate 'outlier' only; got estimate "
                              f"{self.estimate!r}")
        if not isinstance(self.cap, int) or isinstance(self.cap, bool) or self.cap < 0:
            raise ConfigError(f"score_gap trigger: cap must be an integer >= 0 (0: no cap), got {self.cap!r}")
        if not isinstance(self.margins, (list, tuple)) or any(
                not isinstance(m, (int, float)) or isinstance(m, bool) or math.isnan(m) for m in self.margins):
            raise ConfigError(f"score_gap trigger: margins must be a list of numbers (one a layer), got {self.margins!r}")
        self.margins = tuple(float(m) for m in self.margins)
        if not isinstance(self.count, (int, float)) or isinstance(self.count, bool) or not self.count >= 0:
            raise ConfigError(f"score_gap trigger: count must be a number >= 0 (0: off), got {self.count!r}")
        if self.group not in GROUPS:
            raise ConfigError(f"score_gap trigger: group must be one of {', '.join(GROUPS)}; got {self.group!r}")

    def init_state(self, batch, num_q_heads, head_dim, device) -> ScoreGapState:
        return ScoreGapState(
            has_selection=torch.zeros(batch, dtype=torch.bool, device=device),
            gap=torch.zeros(batch, dtype=torch.float32, device=device),
            age=torch.zeros(batch, dtype=torch.long, device=device),
            steps=torch.zeros(batch, dtype=torch.long, device=device),
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
        # a fused op that does not implement some option says so here, before any step
        why = getattr(layer.ops.score_gap_fire, "unsupported", lambda trigger: None)(self)
        if why is not None:
            raise ConfigError(why)
        state.layer = weakref.proxy(layer)  # the layer owns this state: no reference cycle to keep its KV alive
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
        state.held_marks = None  # made from the new list where an op first reads them
        state.held_count = torch.zeros(batch, heads, dtype=torch.long, device=device)
        state.seen_open = units.open_unit.clone()
        state.seen_size = open_unit_size(units)
        state.seen_admitted = layer.store.admitted.clone()
        state.held_end = torch.zeros(batch, heads, room, dtype=torch.long, device=device)
        state.units_at_selection = units.decode_units.clone()
        if self.estimate == "outlier":
            state.outliers = take_outlier_keys(units, layer.store, self.outliers)
        if self.low_rank:
            dim = layer.store.pool.keys.shape[-1]
            if self.low_rank > dim:
                raise ConfigError(f"score_gap trigger: low_rank must be at most the head dimension ({dim}), got "
                                  f"{self.low_rank}")
            state.key_basis = prompt_key_basis(units, layer.store, self.low_rank)

    def selected(self, state: ScoreGapState, selection: Any, reselect: torch.Tensor) -> None:
        """The rows that re-selected hold exactly ``selection.unit_ids`` (the fetch made it so);
        the table and buffer as they are now (after this step's leaving token) are the new baseline
        (op ``score_gap_selected``, through the layer's bound ops)."""
        state.layer.ops.score_gap_selected(state, selection.unit_ids, reselect)

    def _follow_leaving_token(self, state: ScoreGapState) -> None:
        """Bring ``held`` up to date with the token that left the local window since the last look
        (``reference_step.follow_leaving_token``; the step's first move). In place, device only."""
        reference_step.follow_leaving_token(state, self.leaving == "unheld", state.layer.policy.admit == "evict")

    def held_mask(self, state: ScoreGapState) -> torch.Tensor:
        """``(B, H, U)`` bool over the layer's unit table: the units the layer holds now."""
        return held_units_mask(state.held, state.layer.units.capacity)

    def decide(self, query: torch.Tensor, state: ScoreGapState) -> torch.Tensor:
        return self._decide(query, state, reference_step)

    def decide_fast(self, query: torch.Tensor, state: ScoreGapState, ops) -> torch.Tensor:
        if type(self).decide is not ScoreGap.decide:  # a subclass with its own decision
            return self.decide(query, state)
        return self._decide(query, state, ops)

    def decide_and_note(self, query: torch.Tensor, state: ScoreGapState, ops, decision: Decision) -> None:
        """The fire and the note in the fire op's last launch (``score_gap_fire``'s ``decision``)."""
        if type(self).decide is not ScoreGap.decide:
            return super().decide_and_note(query, state, ops, decision)
        self._decide(query, state, ops, decision)

    def _spread(self, query: torch.Tensor, state: ScoreGapState) -> torch.Tensor:
        """``estimate="gauss"`` (reference only, an experiment): ``(B, H, U)`` half the query group's
        mean of ``sum_d q_d**2 var_d`` over each prompt unit's keys (0 for decode units), so that
        ``score + scale**2 * spread`` is the log of the unit's mean ``exp(q.k)`` were its keys Gaussian
        with that diagonal variance. The prompt units' variances are taken once from the pool."""
        layer = state.layer
        units, store = layer.units, layer.store
        var = getattr(state, "key_var", None)
        if var is None:
            keys = store.pool.keys.float()
            batch, heads, cap, dim = keys.shape
            var = torch.zeros(batch, heads, units.num_prompt_units, dim, device=keys.device)
            for b in range(batch):
                for h in range(heads):
                    sizes = units.size[b, h, :units.num_prompt_units]
                    n = int(sizes.sum())
                    slots = units.order[b, h, :n]
                    rows = store.pool_rows(slots.view(1, 1, -1).expand(batch, heads, -1).contiguous())[b, h]
                    k = keys[b, h].index_select(0, rows)
                    label = torch.repeat_interleave(torch.arange(units.num_prompt_units, device=k.device), sizes)
                    sq = torch.zeros(units.num_prompt_units, dim, device=k.device).index_add_(0, label, k * k)
                    mean = torch.zeros(units.num_prompt_units, dim, device=k.device).index_add_(0, label, k)
                    count = sizes.clamp(min=1).unsqueeze(-1).float()
                    var[b, h] = (sq / count - (mean / count) ** 2).clamp(min=0)
            state.key_var = var
        batch, q_heads, dim = query.shape
        heads = units.start.shape[1]
        group = query.float().view(batch, heads, q_heads // heads, dim)
        if self.group == "each":  # each query head's own: (B, H, G, U)
            spread = 0.5 * torch.einsum("bhgd,bhud->bhgu", group * group, var)
            out = torch.zeros(*units.size.shape[:2], group.shape[2], units.size.shape[-1], device=spread.device)
        else:
            spread = 0.5 * torch.einsum("bhgd,bhud->bhu", group * group, var) / group.shape[2]
            out = torch.zeros(units.size.shape, device=spread.device)
        out[..., :spread.shape[-1]] = spread
        return out

    def _decide(self, query: torch.Tensor, state: ScoreGapState, ops, decision: Decision | None = None) -> torch.Tensor:
        """The step: score the table (the selector's op), then ``score_gap_fire`` (follow the leaving
        token, measure the gap, decide; given ``decision``, note it) from ``ops``, the reference
        (``reference_step``) or the layer's bound ops. ``estimate="outlier"`` is one op from the
        query (``score_gap_outlier_fire``): it scores the outlier keys itself."""
        layer = state.layer
        if layer is None:
            raise ConfigError("score_gap trigger: its state was not attached to a layer (Trigger.attach)")
        scale = query.shape[-1] ** -0.5
        if self.estimate == "outlier":
            return ops.score_gap_outlier_fire(self, state, query, scale, decision=decision)
        fire_op = functools.partial(ops.score_gap_fire, decision=decision)
        if self.group == "each":
            # each query head's scores, (B, H, G, U): the unit-scores op over groups of one
            units = layer.units
            batch, q_heads, dim = query.shape
            kv = units.start.shape[1]
            group = query.view(batch, kv, q_heads // kv, dim)
            method = layer.policy.selector._unit_score_method()
            if method is None:
                raise ConfigError("score_gap trigger: group 'each' needs a selector scored by the unit_scores op "
                                  "(top_budget or bound)")
            raw = torch.stack([layer.ops.unit_scores(group[:, :, g:g + 1], units.key_mean, units.key_min,
                                                     units.key_max, units.selectable, method)
                               for g in range(group.shape[2])], dim=2)
            if self.estimate == "gauss":
                return fire_op(self, state, raw, scale, self._spread(query, state))
            return fire_op(self, state, raw, scale)
        raw = layer.policy.selector.unit_scores(query, layer.units, layer.ops)
        if self.estimate == "gauss":
            return fire_op(self, state, raw, scale, self._spread(query, state))
        if self.estimate == "bound":
            units = layer.units
            batch, q_heads, dim = query.shape
            group = query.view(batch, units.start.shape[1], q_heads // units.start.shape[1], dim)
            bound = layer.ops.unit_scores(group, None, units.key_min, units.key_max, units.selectable, "bound")
            return fire_op(self, state, raw, scale, bound)
        return fire_op(self, state, raw, scale)
