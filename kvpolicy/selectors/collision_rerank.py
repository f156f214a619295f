from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch

from .. import analytic
from ..errors import ConfigError
from ..kernels import dispatch, reference_analytic
from ..registry import register
from ..units.analytic_index import AnalyticIndex
from .base import Selection, Selector


@functools.cache
def _votes_on(tiers: int, device: torch.device) -> torch.Tensor:
    # cached on the device: a captured step must not copy from the host. Made outside inference
    # mode whoever asks first: a cached inference tensor would send later steps' as_tensor
    # through the dispatcher (an aten.to on every selection)
    with torch.inference_mode(False):
        return torch.tensor(analytic.tier_weights(tiers), dtype=torch.int32, device=device)


# who votes for the candidates: the GQA group's mean query (ParisKV's), or each query head, a key
# keeping its best head's votes
VOTES = ("group_mean", "head_max")
# how the candidates are ranked: the 4-bit estimate of the group's mean query (ParisKV's), or each
# query head's own estimate as a logit, softmaxed over the candidates and summed over the group
RERANKS = ("group_mean", "head_softmax")


@functools.cache
def _votes_per_head(query_votes) -> bool:
    """Whether a bound ``query_votes`` makes per-head tables (its ``collision_candidates`` then
    takes them): every backend's op names the ``per_head`` keyword where it has them. Cached: a
    head_max selection asks at every eager step."""
    return query_votes is not None and "per_head" in inspect.signature(query_votes).parameters


def _votes_logit_queries(query_votes) -> bool:
    """Whether a bound ``query_votes`` also writes each query head's logit query (``logit_queries``:
    ``rerank="head_softmax"``'s rerank query in the same launch, where ``analytic.head_logit_queries``
    costs about twenty small launches); every backend's op names the keyword where it has it."""
    return query_votes is not None and "logit_queries" in inspect.signature(query_votes).parameters


@register("selector", "collision_rerank")
@dataclass
class CollisionRerank(Selector):
    """ParisKV's selection over an ``analytic`` index: collision votes, then a 4-bit rerank.

    Per KV head, the GQA group's queries are averaged (as ParisKV's code does), so there is
    one selection per KV head. ``votes="head_max"`` lets each query head of the group vote on its
    own, a key keeping its best head's votes (the rerank still scores the mean query): where one
    head of a group attends a token and the others do not, the mean query's votes can rank it out
    of the candidates (EVAL.md: pariskv on Gemma 3, one KV head for four query heads; the pariskv
    preset's default there, ``presets.BUILTIN_PARISKV_VOTES``). It costs G table lookups a key
    and subspace where the mean costs one. The query is rotated like the keys and, per subspace, its
    ``2**tiers - 1`` best sign-pattern centroids are ranked in ``tiers`` tiers of 1, 2, 4...
    ranks worth ``tiers``, ``tiers - 1``... votes (``tiers``: default ParisKV's 6, at most the
    subspace's dims). A key's votes over all subspaces are a coarse integer score; the
    best-voted tokens are reranked by the 4-bit estimate of ``q·k`` and the best fill the
    retrieval budget, after the update buffer's tokens, which are always taken. The
    selection's units are tokens; the store fetches their slots.

    How many candidates: ParisKV's length rule (``kvpolicy.analytic.CANDIDATE_BANDS``), a share
    of the ``n`` tokens of the retrieval zone: 0.5 below 5,000, 0.25 below 10,000, 0.2 below
    30,000, ``candidate_fraction`` (ParisKV: 0.1) from 30,000 on (a larger
    ``candidate_fraction`` wins everywhere: 1.0 reranks every token), but never fewer than
    ``min_candidates`` times the retrieval budget. A zone that fits the budget is therefore
    selected whole (ParisKV attends everything under about 2,000 tokens).

    ``hold_count`` (default True): never fewer candidates than a shorter zone keeps. ParisKV's
    bands drop the count at each bound (2,500 at 4,999 tokens, 1,250 at 5,000; 6,000 at 29,999,
    3,000 at 30,000); held, the count stays until the next band's share passes it. Measured on
    Gemma 3 at 8K (EVAL.md, "pariskv's held candidate count"): ParisKV's 2,028 candidates miss the
    needle's first digit (vote rank ~2,000); the held 2,500 find it. False: ParisKV's exact rule.

    Why a floor of twice the budget: with a floor of one budget, wherever 10% of the tokens is
    less than the budget (under ~4.4K tokens at budget 512) the candidates *are* the selection
    and the rerank does nothing. ParisKV's own regime (top-k 2048, 10% of 30K+ tokens) reranks
    at least 1.5x its top-k. Measured on SmolLM2 at 4K (EVAL.md): recall 0.94 at 1x, 0.96-0.97
    at 2x, 0.98 at 4x; 2x keeps the rerank's cost small.

    Candidates are computed at a fixed width, the most the rule keeps for any zone up to the
    index's capacity (host-known), and cut on the device to the rule's count for the tokens
    indexed so far, so the selection does not depend on how much room was reserved (eager and
    replayed steps choose the same tokens).

    ``rerank="head_softmax"`` ranks the candidates by each query head's own 4-bit estimate of
    ``q·k``, scaled as an attention logit (``D**-0.5``), softmaxed over the candidates and summed
    over the group (``reference_analytic.head_softmax_scores``): the oracle's score, over the
    candidates and on the codes. Where one head of a group attends a token that the mean query
    ranks low, the mean's rerank cuts it (EVAL.md, "pariskv's held count on SmolLM2 at 8K": a
    needle digit with 0.985 of its group's mass, 597th of the mean's estimates against a cut of
    440); its head's softmax keeps it. It costs G estimates a candidate where the mean costs one
    (the codes still read once: ``kvpolicy/kernels/triton/head_softmax.py``), and on the triton
    backend one more launch for the softmaxes' sums; ``query_votes`` writes the heads' logit
    queries in its launch (``logit_queries``).

    The kernels (``kvpolicy.analytic``'s module docstring maps the pipeline's files): with ops
    ``query_votes``, ``collision_candidates`` and ``rerank_select`` bound (every backend has
    them), one launch for the query, three for the votes and the candidates (two in a call too
    small for the GPU), five for the rerank, its top-k and the selection's rows (six with
    ``rerank="head_softmax"``); the
    retrieved tokens are then
    listed by position (the pool read in address order), after the buffer's. Otherwise ``collision_count`` and
    ``candidate_topk``, then ``rerank`` (best first) and the composition in PyTorch.
    """

    candidate_fraction: float = analytic.DEFAULT_CANDIDATE_FRACTION
    min_candidates: float = 2.0
    hold_count: bool = True
    tiers: int | None = None
    votes: str = "group_mean"
    rerank: str = "group_mean"
    reads = AnalyticIndex

    def validate(self) -> None:
        if self.votes not in VOTES:
            raise ConfigError(f"collision_rerank: votes must be one of {', '.join(VOTES)}, got {self.votes!r}")
        if self.rerank not in RERANKS:
            raise ConfigError(f"collision_rerank: rerank must be one of {', '.join(RERANKS)}, got {self.rerank!r}")
        fraction = self.candidate_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ConfigError(
                f"collision_rerank: candidate_fraction must be a number in (0, 1] (ParisKV: about 0.1), got {fraction!r}"
            )
        if not isinstance(self.hold_count, bool):
            raise ConfigError(f"collision_rerank: hold_count must be True or False, got {self.hold_count!r}")
        floor = self.min_candidates
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor >= 1:
            raise ConfigError(
                f"collision_rerank: min_candidates (a multiple of the retrieval budget) must be a number >= 1, "
                f"got {floor!r}"
            )
        if self.tiers is not None and (
            not isinstance(self.tiers, int) or isinstance(self.tiers, bool)
            or not 1 <= self.tiers <= analytic.MAX_SUBSPACE_DIMS
        ):
            raise ConfigError(
                f"collision_rerank: tiers must be None (6, or the subspace's dims if fewer) or an integer in "
                f"1..{analytic.MAX_SUBSPACE_DIMS}, got {self.tiers!r}"
            )

    def tiers_for(self, dims: int) -> int:
        """The tiers used with ``dims``-dim subspaces (``2**dims`` centroids)."""
        if self.tiers is None:
            return min(analytic.DEFAULT_TIERS, dims)
        if self.tiers > dims:
            raise ConfigError(
                f"collision_rerank: tiers {self.tiers} rank {(1 << self.tiers) - 1} centroids per subspace, but "
                f"{dims}-dim subspaces have only {1 << dims}; accepted: 1..{dims} (or None)"
            )
        return self.tiers

    def floor_for(self, retrieval: int) -> int:
        """The fewest candidates: ``min_candidates`` times the retrieval budget."""
        return math.ceil(self.min_candidates * retrieval)

    def fraction_for(self, zone: int) -> float:
        """The share of a retrieval zone of ``zone`` tokens kept as candidates (ParisKV's length rule)."""
        for bound, share in analytic.CANDIDATE_BANDS:
            if zone < bound:
                return max(share, self.candidate_fraction)
        return self.candidate_fraction

    def rule_for(self, retrieval: int) -> tuple:
        """The count rule's arguments (``reference_analytic.candidate_count``'s after the count)."""
        return self.floor_for(retrieval), self.candidate_fraction, analytic.CANDIDATE_BANDS, self.hold_count

    def keep_for(self, zone: int, retrieval: int) -> int:
        """Candidates kept for a zone of ``zone`` tokens at retrieval budget ``retrieval`` (a host
        mirror of the device's ``reference_analytic.candidate_count``, before the width's cut)."""
        count = reference_analytic.candidate_count(
            torch.tensor([zone]), *self.rule_for(retrieval)
        )
        return int(count[0])

    def candidates_for(self, capacity: int, retrieval: int) -> int:
        """The candidate width: the most the length rule keeps for any zone of up to ``capacity``
        positions (at least the floor, at most ``capacity``)."""
        # the rule's count rises within a band and drops at its bound: the most is at a band's end
        ends = [min(capacity, bound - 1) for bound, _ in analytic.CANDIDATE_BANDS] + [capacity]
        widest = max(math.ceil(end * self.fraction_for(end)) for end in ends)
        # + 1: the device rounds in float32, this in float64
        return min(capacity, max(self.floor_for(retrieval), widest + 1))

    def rerank_query(self, rotated: torch.Tensor, group: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        """The rerank ops' query: the group's mean, rotated (``rotated (B, H, D)``), or with
        ``rerank="head_softmax"`` each head of ``group (B, H, G, D)`` as a logit query."""
        return analytic.head_logit_queries(group, signs) if self.rerank == "head_softmax" else rotated

    def score(self, query_group, units):
        raise NotImplementedError("collision_rerank selects tokens of an analytic index directly (select)")

    def select(self, query: torch.Tensor, index, capacity: int, ops, take: torch.Tensor | None = None) -> Selection:
        """``query (B, Hq, D)``; ``index``: an ``AnalyticIndex``; ``capacity``: the retrieval budget R.
        ``take`` (the sequences whose selection is used) is not read: every row is computed."""
        batch, q_heads, dim = query.shape
        kv_heads = index.weight.shape[1]
        device = query.device
        ops = dispatch.as_ops(ops, device)
        positions = index.capacity
        dims = dim // index.subspaces
        tiers = self.tiers_for(dims)

        group = query.view(batch, kv_heads, q_heads // kv_heads, dim)
        votes_per_rank = _votes_on(tiers, device)
        width = self.candidates_for(positions, capacity)
        rule = self.rule_for(capacity)
        max_votes = index.subspaces * tiers  # a key's votes: at most `tiers` in each subspace
        # the fused ops, where the bound table has them (dispatch.OPS names them)
        query_votes = getattr(ops, "query_votes", None)
        collision_candidates = getattr(ops, "collision_candidates", None)
        rerank_select = getattr(ops, "rerank_select", None)
        per_head = self.votes == "head_max"
        if per_head and not _votes_per_head(query_votes):
            raise ConfigError(f"collision_rerank: votes='head_max' needs query_votes with per-head tables, which the "
                              f"reference and triton backends have; this policy's ({ops.backend!r}) binds "
                              f"{getattr(query_votes, '__module__', None) or 'none'}'s")
        if query_votes is not None and collision_candidates is not None:
            # rerank="head_softmax": the heads' logit queries from the same launch, where the op makes them
            logits_too = self.rerank == "head_softmax" and rerank_select is not None and _votes_logit_queries(
                query_votes)
            rotated, table, *logit_queries = query_votes(group, index.signs, index.subspaces, votes_per_rank, **(
                {"per_head": True} if per_head else {}), **({"logit_queries": True} if logits_too else {}))
            candidates = collision_candidates(
                table, index.centroids, index.token_valid, index.indexed, width, max_votes, *rule
            )  # (B, H, C), by position
            if rerank_select is not None:
                # the rerank, its top-k and the buffer-first composition in one op
                scored_by = logit_queries[0] if logits_too else self.rerank_query(rotated, group, index.signs)
                return Selection(*rerank_select(
                    scored_by, index.codes, index.weight, index.norms, candidates,
                    index.token_valid, index.slots, index.indexed, index.next_position, capacity,
                ))
        else:
            encoded = analytic.encode_query(group.float().mean(2), index.signs, index.subspaces, (1 << tiers) - 1)
            rotated = encoded.rotated
            voted = index.retrieval_mask()  # (B, N)
            votes = ops.collision_count(
                encoded.centroids, index.centroids, voted[:, None, :].expand(batch, kv_heads, positions), votes_per_rank
            )
            candidates = ops.candidate_topk(votes, width, max_votes)  # (B, H, C), best first
            # the rule's count for the tokens indexed so far: the same tokens whatever the
            # capacity, since candidate_topk's order is fully determined
            keep = reference_analytic.candidate_count(voted.sum(-1), *rule)
            rank = torch.arange(width, device=device)
            candidates = torch.where(rank < keep.view(batch, 1, 1), candidates, -1)
        best = ops.rerank(
            self.rerank_query(rotated, group, index.signs), index.codes, index.weight, index.norms, candidates,
            capacity,
        )  # (B, H, R) positions, best first, -1 pads

        # the update buffer's tokens first (always attended), then the best retrieved ones
        buffered = index.buffered().clamp(max=capacity)
        room = torch.arange(capacity, device=device)
        from_buffer = room < buffered  # (R,)
        buffer_position = (index.indexed + room).clamp(max=positions - 1)
        shifted = best.gather(-1, (room - buffered).clamp(min=0).expand(batch, kv_heads, capacity))
        chosen = torch.where(from_buffer, buffer_position, shifted)  # (B, H, R)
        buffer_valid = index.token_valid.gather(1, buffer_position.expand(batch, capacity))  # (B, R)
        valid = torch.where(from_buffer, buffer_valid.view(batch, 1, capacity), shifted >= 0)
        slots = index.slots[chosen.clamp(min=0)]
        unit_ids = torch.where(valid, chosen, -1)
        return Selection(unit_ids, valid.sum(-1), slots, valid)
