"""Successive selections that overlap as a real model's do, for benchmarks of random weights.

A random-weight model's queries are unrelated from step to step, so each re-selection picks
units afresh: 80-90% of its rows are misses (not in the retrieved buffer or the unit cache),
where a real model misses 36-43% (SmolLM2, EVAL.md). The pinned pool's cost per re-selection
follows the misses, so a benchmark at random weights' overlap overstates it.

``StickyTopBudget`` is ``top_budget`` whose unit scores carry a fixed bias per unit,
``stickiness * sigma * h(u)``, with ``h`` a hash of the unit's index into [0, 1) and ``sigma``
the spread (standard deviation) of the row's scores: the query still ranks the units, but the
same ones keep winning, more of them the larger the bias; in units of the scores' own spread,
so one setting means about the same overlap at any context or batch. The scoring, ranking and fetch run
as they do for ``top_budget``, plus the bias: one launch on the Triton backend (``sticky_bias.py``),
a dozen PyTorch ops on the reference; the row's measured miss fraction says what overlap the bias
produced.

``StickyCollisionRerank`` does the same for ParisKV's selection, which ranks tokens through fused
vote, candidate and rerank kernels with no unit scores to bias: it pulls the query towards a fixed
direction by ``pull`` times the query's own norm, so the keys along that direction keep winning. The
kernels run unchanged on the pulled query (two elementwise launches more a re-selection).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..kernels import dispatch
from ..selectors.collision_rerank import CollisionRerank
from ..selectors.top_budget import TopBudget


# Knuth's multiplicative hash: a permutation of 32-bit integers
HASH_MULTIPLIER = 2654435761


def unit_hash(units: int, device: torch.device) -> torch.Tensor:
    """``(units,)`` float32 in [0, 1), fixed per unit index: Knuth's multiplicative hash, so
    distinct units get distinct values."""
    index = torch.arange(units, device=device, dtype=torch.long)
    return ((index * HASH_MULTIPLIER) % (1 << 32)).float() / float(1 << 32)


@dataclass
class StickyTopBudget(TopBudget):
    """``top_budget`` with a fixed per-unit score bias of up to ``stickiness`` times the scores'
    spread (benchmarks only)."""

    stickiness: float = 0.0

    def unit_scores(self, query, units, ops, take=None) -> torch.Tensor:
        scores = super().unit_scores(query, units, ops, take)
        if _scores_with_triton(dispatch.as_ops(ops, scores.device)):
            from .sticky_bias import sticky_bias as fused  # imports Triton only where it runs

            return fused(scores, self.stickiness)
        return sticky_bias(scores, self.stickiness)


@dataclass
class StickyCollisionRerank(CollisionRerank):
    """``collision_rerank`` on a query pulled towards a fixed direction by ``pull`` times its norm
    (benchmarks only)."""

    pull: float = 0.0

    @classmethod
    def pulling(cls, selector: CollisionRerank, pull: float) -> "StickyCollisionRerank":
        """``selector`` (a preset's, with its options) on the pulled query."""
        return cls(**{f.name: getattr(selector, f.name) for f in fields(selector)}, pull=pull)

    def select(self, query, index, capacity, ops, take=None):
        return super().select(pulled_query(query, self.pull), index, capacity, ops, take)


def pulled_query(query: torch.Tensor, pull: float) -> torch.Tensor:
    """``(..., D)`` query -> ``query + pull * |query| * u``, ``u`` a fixed unit direction made on the
    query's device from ``unit_hash`` (no host copy, so a captured step can make it)."""
    direction = unit_hash(query.shape[-1], query.device) - 0.5
    direction = direction / direction.norm()
    pulled = query.float() + pull * query.float().norm(dim=-1, keepdim=True) * direction
    return pulled.to(query.dtype)


def _scores_with_triton(ops: dispatch.Ops) -> bool:
    """The fused bias where the policy's scoring resolved to Triton (by name, or ``auto`` on CUDA)."""
    return ops.unit_scores.__module__.startswith("kvpolicy.kernels.triton")


def sticky_bias(scores: torch.Tensor, stickiness: float) -> torch.Tensor:
    """``(..., U)`` scores -> scores plus ``stickiness * sigma * unit_hash`` per row, ``sigma`` the
    standard deviation of the row's finite scores (the reference of ``sticky_bias.py``)."""
    finite = torch.isfinite(scores)
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    kept = torch.where(finite, scores, 0.0)
    mean = kept.sum(-1, keepdim=True) / count
    spread = (torch.where(finite, scores - mean, 0.0).square().sum(-1, keepdim=True) / count).sqrt()
    return scores + stickiness * spread * unit_hash(scores.shape[-1], scores.device)
