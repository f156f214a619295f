"""Pure-PyTorch reference for ParisKV's ops: collision voting, candidate top-k, 4-bit rerank.

Same conventions as ``reference``: batched over (sequence, KV head), fixed output shapes, no
host reads of tensor values (graph-capturable). Queries come one per KV head: for GQA the
caller averages the group's queries first, so ``H`` is the number of KV heads everywhere; the
rerank ops also take one query per head of the group, ``(B, H, G, D)`` (``rerank="head_softmax"``:
``head_softmax_scores``). Encodings are those of ``kvpolicy.analytic``.
"""

from __future__ import annotations

import math

from collections.abc import Sequence

import torch

from .. import analytic
from ..analytic import dequantize

# key centroid ids are uint8 (``analytic.MAX_SUBSPACE_DIMS`` = 8), so 256 ids at most
NUM_IDS = 256


def vote_table(query_centroids: torch.Tensor, tier_weights: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Votes of each centroid id per subspace, ``(B, H, S, 256)`` int32.

    ``table[b, h, s, c]`` is the sum of ``tier_weights[r]`` over the ranks ``r`` at which
    ``query_centroids[b, h, s, r] == c`` (one rank at most for ``encode_query``'s distinct
    ids). A lookup then costs a key one read per subspace, whatever ``rho`` is. Pass
    ``tier_weights`` as a device tensor inside a captured step (no host copy then).
    """
    rho = query_centroids.shape[-1]
    device = query_centroids.device
    weights = torch.as_tensor(tier_weights, dtype=torch.int32, device=device)
    if weights.shape != (rho,):
        raise ValueError(
            f"collision_count: tier_weights must hold one int per query rank ({rho}), got shape {tuple(weights.shape)}"
        )
    table = torch.zeros(*query_centroids.shape[:-1], NUM_IDS, dtype=torch.int32, device=device)
    # scatter_add: integer sums are order-independent, so deterministic on any device
    return table.scatter_add_(-1, query_centroids.long(), weights.expand(query_centroids.shape))


def collision_count(
    query_centroids: torch.Tensor,
    key_centroids: torch.Tensor,
    valid: torch.Tensor,
    tier_weights: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """Tiered collision votes of every key, ``(B, H, N)`` int32.

    ``query_centroids``: ``(B, H, S, rho)`` long or uint8, the query's centroid ids (< 256)
    per subspace, best first (``analytic.encode_query``); ``key_centroids``: ``(B, H, N, S)``
    uint8; ``valid``: ``(B, H, N)`` bool; ``tier_weights``: ``rho`` ints
    (``analytic.tier_weights()``), the votes a key gets in a subspace where its centroid is
    the query's rank-``r`` centroid (0 where it is none of them). Votes are summed over
    subspaces; invalid keys get -1 (below any valid key).
    """
    return torch.where(valid, table_votes(vote_table(query_centroids, tier_weights), key_centroids), -1)


def table_votes(table: torch.Tensor, key_centroids: torch.Tensor) -> torch.Tensor:
    """Each key's votes, ``(B, H, N)`` int32: ``table (B, H, S, 256)`` looked up at its ids ``(B, H, N, S)``."""
    votes = torch.zeros(key_centroids.shape[:-1], dtype=torch.int32, device=key_centroids.device)
    # one subspace at a time: memory (B, H, N), not (B, H, N, S)
    for s in range(key_centroids.shape[-1]):
        votes += table[:, :, s].gather(-1, key_centroids[..., s].long())
    return votes


def candidate_topk(scores: torch.Tensor, k: int, max_score: int | None = None) -> torch.Tensor:
    """The ``k`` best-voted keys, ``(B, H, k)`` long token indices, best first.

    ``scores``: ``(B, H, N)`` int32 from ``collision_count`` (-1 = invalid). Ties go to the
    lower token index. Invalid keys never enter; where fewer than ``k`` keys are valid
    (or ``k > N``) the tail is -1. ``max_score``: the largest vote a key can have; the Triton
    version sizes its counting sort with it, this one does not need it.
    """
    n = scores.shape[-1]
    index = torch.arange(n, device=scores.device)
    # votes * N + (N - 1 - index) is unique per key, so torch.topk's order is fully
    # determined (it is not stable on ties) and no full sort is needed; int64 cannot overflow
    rank_key = scores.long() * n + (n - 1 - index)
    take = min(k, n)
    best, _ = torch.topk(rank_key, take, dim=-1)
    chosen = torch.where(best >= 0, (n - 1) - best.remainder(n), -1)
    if take < k:
        chosen = torch.nn.functional.pad(chosen, (0, k - take), value=-1)
    return chosen


def rerank_scores(
    query_rotated: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """Estimated ``q·k / |q|`` of each candidate, ``(B, H, C)`` float32, ``-inf`` where -1.

    ``norms * weight * <query_rotated, dequantize(codes)>`` for ``query_rotated (B, H, D)``,
    ``codes (B, H, N, D // 2)`` uint8, ``weight``/``norms (B, H, N)`` and ``candidates
    (B, H, C)`` long token indices (-1 = none).
    """
    listed = candidates >= 0
    values, scale = _candidate_values(codes, weight, norms, candidates)
    dot = torch.einsum("bhcd,bhd->bhc", values, query_rotated.float())
    return torch.where(listed, scale * dot, float("-inf"))


def _candidate_values(codes, weight, norms, candidates):
    """The candidates' dequantised codes ``(B, H, C, D)`` and ``norms * weight`` ``(B, H, C)``."""
    index = candidates.clamp(min=0)
    picked = codes.gather(2, index.unsqueeze(-1).expand(*index.shape, codes.shape[-1]))
    return dequantize(picked), (weight.float() * norms.float()).gather(2, index)


def head_softmax_scores(
    query_logits: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """Each candidate's estimated attention mass summed over the query heads of its group, as a log,
    ``(B, H, C)`` float32, ``-inf`` where -1 (``rerank="head_softmax"``).

    ``query_logits (B, H, G, D)``: each query head's rotated query scaled so that its 4-bit
    estimate is an attention logit (``analytic.head_logit_queries``); the other arguments as in
    ``rerank_scores``. Each head's logits are softmaxed over the row's listed candidates and the
    group's softmaxes summed; the log of that sum ranks as the sum does, but where a tail
    candidate's mass underflows float32 in every head it still ranks by its logits instead of
    tying at 0. The group's mean query can rank low a token that one head attends (EVAL.md,
    "pariskv's held count on SmolLM2 at 8K": the lost needle digit); its own head's softmax keeps it.
    """
    listed = candidates >= 0
    values, scale = _candidate_values(codes, weight, norms, candidates)
    logits = scale.unsqueeze(2) * torch.einsum("bhcd,bhgd->bhgc", values, query_logits.float())
    logits = logits.masked_fill(~listed.unsqueeze(2), float("-inf"))
    # log of the summed softmaxes; a row with no candidate is NaN here and -inf below
    mass = torch.logsumexp(torch.log_softmax(logits, dim=-1), dim=2)
    return torch.where(listed, mass, float("-inf"))


def candidate_scores(
    query: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """The rerank's score of each candidate (higher is better), ``(B, H, C)`` float32: ``rerank_scores``
    for one query a KV head ``(B, H, D)`` (``rerank="group_mean"``), ``head_softmax_scores`` for one
    per query head ``(B, H, G, D)`` (``rerank="head_softmax"``)."""
    if query.dim() == 3:
        return rerank_scores(query, codes, weight, norms, candidates)
    if query.dim() == 4:
        return head_softmax_scores(query, codes, weight, norms, candidates)
    raise ValueError(
        f"rerank: the query must be (B, H, D) (the group's mean, rotated) or (B, H, G, D) (each head's "
        f"logit query), got shape {tuple(query.shape)}"
    )


def topk_of_candidates(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The candidates of the ``k`` highest scores, ``(B, H, k)`` long, best first; -1 pads.

    Shared by every backend's ``rerank`` so they rank identically.
    """
    take = min(k, scores.shape[-1])
    best, where = torch.topk(scores, take, dim=-1)
    chosen = torch.where(best > float("-inf"), candidates.gather(-1, where), -1)
    if take < k:
        chosen = torch.nn.functional.pad(chosen, (0, k - take), value=-1)
    return chosen


def rerank(
    query_rotated: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Top-``k`` candidates by estimated ``q·k``, ``(B, H, k)`` long token indices, best first.

    Shapes as in ``rerank_scores``, or a query per head of the group (``candidate_scores``);
    candidates -1 are ignored and the tail is -1 where fewer than ``k`` are listed. Never touches
    full-precision keys.
    """
    scores = candidate_scores(query_rotated, codes, weight, norms, candidates)
    return topk_of_candidates(scores, candidates, k)


# -- the fused selection pipeline (ops query_votes, collision_candidates) ---------------------


def query_votes(
    query_group: torch.Tensor,
    signs: torch.Tensor,
    subspaces: int,
    tier_weights: Sequence[int] | torch.Tensor,
    per_head: bool = False,
    logit_queries: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The GQA group's mean query, rotated, and its vote table: ``(rotated (B, H, D) float32,
    table (B, H, S, 256) int8)``; with ``per_head``, one table per query head of the group,
    ``(B, H, G, S, 256)`` (the rotated query is still the group's mean: the rerank's). With
    ``logit_queries``, a third output: each query head's logit query ``(B, H, G, D)`` float32,
    ``analytic.head_logit_queries`` (``rerank="head_softmax"``'s rerank query).

    ``query_group``: ``(B, H, G, D)`` (any float dtype), the query heads of each KV head;
    ``signs``: the layer's SRHT signs ``(D,)``; ``tier_weights``: the votes of each of the
    ``rho`` ranks (``analytic.tier_weights(tiers)``: 1 to 8 votes; each must fit int8). The same
    as ``analytic.encode_query`` of the group's mean (or of each head), then ``vote_table`` as
    int8: a subspace's row is 256 bytes, so the collision pass's lookups of one subspace fall in
    two cache lines.
    """
    weights = torch.as_tensor(tier_weights, dtype=torch.int32, device=query_group.device)
    encoded = analytic.encode_query(query_group.float().mean(2), signs, subspaces, weights.shape[0])
    voting = analytic.encode_query(query_group.float(), signs, subspaces, weights.shape[0]) if per_head else encoded
    table = vote_table(voting.centroids, weights).to(torch.int8)
    if logit_queries:
        return encoded.rotated, table, analytic.head_logit_queries(query_group, signs)
    return encoded.rotated, table


def candidate_count(
    valid_count: torch.Tensor,
    floor: int,
    fraction: float,
    bands: Sequence[tuple[int, float]] = (),
    hold: bool = False,
) -> torch.Tensor:
    """Candidates to keep per row, ``valid_count``'s shape, long: ``max(floor, ceil(n * share(n)))``.

    ``n`` (``valid_count``, long) is the row's tokens in the retrieval zone; ``share(n)`` is
    ``fraction``, or for ``n`` below a band's bound the first such band's share if larger
    (``bands``: ``(bound, share)`` pairs, bounds ascending; ``analytic.CANDIDATE_BANDS``).
    The product is rounded up in float32, as every backend computes it. ``hold``: never fewer
    than a shorter zone keeps (``held_counts``).
    """
    share = torch.full(valid_count.shape, fraction, dtype=torch.float32, device=valid_count.device)
    for bound, band in reversed(tuple(bands)):  # the smallest bound that n is below wins
        share = torch.where(valid_count < bound, max(band, fraction), share)
    count = torch.ceil(valid_count.float() * share).long().clamp(min=floor)
    for bound, held in held_counts(bands, fraction, hold):
        count = torch.where(valid_count >= bound, count.clamp(min=held), count)
    return count


def held_counts(bands: Sequence[tuple[int, float]], fraction: float, hold: bool) -> list[tuple[int, int]]:
    """``(bound, count)`` per band: from ``bound`` tokens on, at least the ``count`` that a zone one
    token shorter keeps (all 0 unless ``hold``). ParisKV's bands drop the count at each bound: 2,500
    candidates at 4,999 tokens, 1,250 at 5,000; held, it stays 2,500 until a quarter of the zone
    passes it (EVAL.md, "pariskv's held candidate count")."""
    return [(int(bound), math.ceil((bound - 1) * max(share, fraction)) if hold else 0) for bound, share in bands]


def collision_candidates(
    table: torch.Tensor,
    key_centroids: torch.Tensor,
    token_valid: torch.Tensor,
    indexed: torch.Tensor,
    width: int,
    max_votes: int,
    floor: int,
    fraction: float,
    bands: Sequence[tuple[int, float]] = (),
    hold: bool = False,
) -> torch.Tensor:
    """The best-voted keys of the retrieval zone, ``(B, H, width)`` long positions in
    increasing order, then -1.

    ``table``: ``(B, H, S, 256)`` int8 from ``query_votes`` (or int32, ``vote_table``'s), or
    ``(B, H, G, S, 256)`` (``query_votes(per_head=True)``): a key's votes are then its best
    head's; ``key_centroids``: ``(B, H, N, S)`` uint8; ``token_valid``: ``(B, N)`` bool; ``indexed``: ``()`` long, positions
    ``[0, indexed)`` are voted on. A row keeps ``candidate_count`` of its ``n`` voted tokens
    (``floor``, ``fraction``, ``bands``, ``hold``), at most ``width``: the same keys as
    ``candidate_topk(collision_count(...), width)`` cut there (most votes first, ties to the
    lower position), listed by position, so the rerank reads the codes in address order.
    ``max_votes``: the largest vote a key can have (the Triton version sizes its histogram
    with it).
    """
    batch, heads, n, _ = key_centroids.shape
    position = torch.arange(n, device=key_centroids.device)
    voted = (token_valid & (position < indexed))[:, None, :].expand(batch, heads, n)
    if table.dim() == 5:
        # each query head votes on its own, a key keeps its best head's votes: the group's mean
        # query can dilute the one head that attends a token (EVAL.md, pariskv on Gemma 3)
        each = [table_votes(table[:, :, g], key_centroids) for g in range(table.shape[2])]
        counted = torch.stack(each).max(0).values
    else:
        counted = table_votes(table, key_centroids)
    votes = torch.where(voted, counted, -1)
    best = candidate_topk(votes, width)
    keep = candidate_count(voted.sum(-1), floor, fraction, bands, hold)  # (B, H)
    best = torch.where(torch.arange(width, device=best.device) < keep[..., None], best, -1)
    # by position, the -1 tail last
    ordered = torch.where(best >= 0, best, n).sort(-1).values
    return torch.where(ordered < n, ordered, -1)


# -- the fused rerank and final selection (op rerank_select) ---------------------------------


def rerank_select(
    query_rotated: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
    token_valid: torch.Tensor,
    slots: torch.Tensor,
    indexed: torch.Tensor,
    next_position: torch.Tensor,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final selection of ``capacity`` rows: the update buffer's tokens, then the best
    reranked candidates. ``(unit_ids (B, H, R) long, num_units (B, H) long, slots (B, H, R)
    long, valid (B, H, R) bool)``, the fields of a ``Selection``.

    ``query_rotated``, ``codes``, ``weight``, ``norms``: as in ``rerank_scores`` (or a query per
    head of the group, ``(B, H, G, D)``: ``candidate_scores``);
    ``candidates (B, H, W)``: positions in increasing order, then -1 (``collision_candidates``);
    ``token_valid (B, N)`` bool; ``slots (N,)`` long, the slot of each position; ``indexed``,
    ``next_position``: ``()`` long, the update buffer is positions ``[indexed, next_position)``.

    Rows ``[0, b)``, ``b = min(next_position - indexed, R)``: the buffer's positions
    ``indexed + r`` (valid where ``token_valid``). Rows ``[b, R)``: the ``R - b`` candidates of
    the highest ``candidate_scores``, ties to the lower position, listed by position (so a pool is
    read in address order), then -1 rows where fewer are listed. ``unit_ids`` is the position
    where ``valid``, else -1; ``slots`` is ``slots[position]`` (``slots[0]`` for an empty row);
    ``num_units`` counts the valid rows.
    """
    batch, heads, n, _ = codes.shape
    width = candidates.shape[-1]
    device = codes.device
    scores = candidate_scores(query_rotated, codes, weight, norms, candidates) + 0.0  # -0.0 ties +0.0
    buffered = (next_position - indexed).clamp(min=0, max=capacity)
    # rank by (score desc, position asc): positions first, then a stable sort on the scores
    by_position = torch.where(candidates >= 0, candidates, n).sort(-1)
    ranked = scores.gather(-1, by_position.indices)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(width, device=device).expand_as(order))
    chosen = (rank < capacity - buffered) & (ranked > float("-inf"))
    picked = torch.where(chosen, by_position.values, n).sort(-1).values  # by position, n = none
    return compose_selection(picked, token_valid, slots, indexed, next_position, capacity, n)


def compose_selection(picked: torch.Tensor, token_valid: torch.Tensor, slots: torch.Tensor, indexed: torch.Tensor,
                      next_position: torch.Tensor, capacity: int, n: int):
    """``rerank_select``'s rows from ``picked (B, H, k)``, the chosen candidates' positions in
    increasing order (``n`` = none): the update buffer's positions first, then ``picked``."""
    batch, heads = picked.shape[:2]
    device = picked.device
    if picked.shape[-1] < capacity:
        picked = torch.nn.functional.pad(picked, (0, capacity - picked.shape[-1]), value=n)
    buffered = (next_position - indexed).clamp(min=0, max=capacity)
    room = torch.arange(capacity, device=device)
    from_buffer = room < buffered  # (R,)
    buffer_position = (indexed + room).clamp(max=n - 1)
    retrieved = picked.gather(-1, (room - buffered).clamp(min=0).expand(batch, heads, capacity))
    position = torch.where(from_buffer, buffer_position, retrieved)  # (B, H, R), n = none
    buffer_valid = token_valid.gather(1, buffer_position.expand(batch, capacity))  # (B, R)
    valid = torch.where(from_buffer, buffer_valid.view(batch, 1, capacity), retrieved < n)
    position = torch.where(position < n, position, 0)
    return torch.where(valid, position, -1), valid.sum(-1), slots[position], valid


# -- the decode step's write of a leaving token (op analytic_append) ---------------------------


def analytic_append(
    centroids: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    token_valid: torch.Tensor,
    slots: torch.Tensor,
    next_position: torch.Tensor,
    indexed: torch.Tensor,
    signs: torch.Tensor,
    subspaces: int,
    update_buffer: int,
    key: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
) -> None:
    """A token leaves the local window: flush a full update buffer, then encode and buffer it.

    In place, on an ``AnalyticIndex``'s tensors (``kvpolicy.units.analytic_index``): ``indexed``
    becomes ``next_position`` where ``next_position - indexed >= update_buffer``; ``key (B, H,
    D)`` is encoded (``analytic.encode_keys``) into position ``next_position`` of ``centroids``,
    ``codes``, ``weight``, ``norms``; ``token_valid[:, next_position] = valid (B,)``,
    ``slots[next_position] = slot`` (``()``); then ``next_position`` advances by one. No host
    reads: the position is a device counter.
    """
    full = (next_position - indexed) >= update_buffer
    indexed.copy_(torch.where(full, next_position, indexed))
    encoded = analytic.encode_keys(key, signs, subspaces)
    position = next_position.view(1)
    centroids.index_copy_(2, position, encoded.centroids.unsqueeze(2))
    codes.index_copy_(2, position, encoded.codes.unsqueeze(2))
    weight.index_copy_(2, position, encoded.weight.unsqueeze(2))
    norms.index_copy_(2, position, encoded.norms.unsqueeze(2))
    token_valid.index_copy_(1, position, valid.view(-1, 1))
    slots.index_copy_(0, position, slot.view(1))
    next_position.add_(1)


# -- the prompt's encoding into a fresh index (op analytic_encode) ----------------------------


def analytic_encode(
    keys: torch.Tensor,
    signs: torch.Tensor,
    subspaces: int,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
) -> None:
    """The prompt's keys ``(B, H, n, D)`` encoded (``analytic.encode_keys``) into positions
    ``[0, n)`` of an ``AnalyticIndex``'s tensors, in place: ``centroids (B, H, capacity, S)``
    uint8, ``codes (B, H, capacity, D // 2)`` uint8, ``weight`` and ``norms (B, H, capacity)``
    float32, ``capacity >= n``; positions from ``n`` on are left as they are.
    """
    n = keys.shape[2]
    encoded = analytic.encode_keys(keys, signs, subspaces)
    for out, value in zip((centroids, codes, weight, norms), encoded):
        out[:, :, :n] = value
