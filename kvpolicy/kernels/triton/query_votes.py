"""Triton query encoding (op ``query_votes``): the group's mean query, rotated, and its vote table
in one launch.

Replaces the selector's PyTorch front end (the group mean, ``F.normalize``, the seven butterfly
stages of the Walsh–Hadamard transform, the centroid scores' matmul, a sort of every
subspace's 256 centroids, then ``vote_table``'s zero fill and scatter: about thirty small
launches). One program per (sequence, KV head, subspace) (``RANKS = "sort"``):

- loads the group's query heads (``G x D``), averages and l2-normalises them and applies the
  SRHT signs;
- rotates only its subspace's ``dims`` coordinates: ``H[i, j] = (-1)^popcount(i & j) / sqrt(D)``
  (Sylvester order, as ``analytic._fwht``), a ``dims x D`` product, and writes them;
- scores the subspace's ``2**dims`` sign-pattern centroids and ranks them by one ``tl.sort`` of
  (score, then the lower id) packed in an int64 (the reference's stable descending sort), and
  writes the table row (int8): the rank-``r`` centroid gets ``tier_weights[r]`` votes, ranks
  past ``rho`` 0.

With ``per_head`` (``votes="head_max"``), one program per (sequence, KV head, subspace, query
head): each ranks its own head's unit query into that head's table, ``(B, H, G, S, 256)``; the
programs of head 0 write the group mean's rotated coordinates (the rerank's query). ``G`` times
the programs, each rotating two queries (the mean, its head).

With ``logit_queries`` (``rerank="head_softmax"``), the same launch also writes each query head's
logit query (``analytic.head_logit_queries``: its unit vector rotated, times its norm and
``D**-0.5``), ``(B, H, G, D)``: each (row, subspace) program rotates its subspace's coordinates of
every head of the group (``G x dims x D`` terms), where the selector built them with about twenty
small PyTorch launches a layer before.

Before session 10 (``RANKS = "count"``, kept for the benchmark's before/after rows): one program
per block of 32 centroids, each ranking its block by counting the centroids ahead of it
(``32 x 256`` comparisons) and repeating the prologue and all 256 scores, 8 programs per
subspace: about 29M warp instructions at 4 x 8 rows (sm_90 PTX, offline), against about 3M for
the sort; measured 35 us at batch 4 on an H200 (session 9), for a few us of work. The sort was
avoided then because the interpreter runs ``tl.sort`` slowly; at the tests' sizes it costs
seconds.

Floats reorder against the reference (a direct sum for the butterflies, a sum for the
matmul): the rotated query agrees to about 1e-6, and the table is identical unless two
centroid scores of a subspace tie to float rounding across a tier boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import reference_analytic
from ..dispatch import OPS, implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous


@pdl_kernel
@triton.jit
def _query_votes_kernel(
    query_ptr, signs_ptr, weights_ptr, rotated_ptr, table_ptr,
    H, G, RHO,
    q_sb, q_sh, q_sg, q_sd,
    inv_sqrt_d, inv_sqrt_dims,
    D: tl.constexpr, LOG_D: tl.constexpr, BLOCK_G: tl.constexpr,
    S: tl.constexpr, DIMS: tl.constexpr, BLOCK_DIMS: tl.constexpr, CENTROIDS: tl.constexpr, BLOCK_C: tl.constexpr, IDS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1)
    block = tl.program_id(2)
    b = row // H
    h = row % H
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = tl.load(
        query_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :] * q_sd, mask=(g < G)[:, None], other=0.0
    ).to(tl.float32)
    mean = tl.sum(heads, axis=0) / G
    norm = tl.sqrt(tl.sum(mean * mean, axis=0))
    unit = mean / tl.maximum(norm, 1e-12) * tl.load(signs_ptr + d)
    # this subspace's rotated coordinates: row i of the Hadamard matrix dotted with the unit query
    j = tl.arange(0, BLOCK_DIMS)
    in_j = j < DIMS
    i = sub * DIMS + j
    both = i[:, None] & d[None, :]
    parity = tl.zeros([BLOCK_DIMS, D], dtype=tl.int32)
    for bit in tl.static_range(LOG_D):
        parity ^= (both >> bit) & 1
    part = tl.sum(tl.where(parity == 0, unit[None, :], -unit[None, :]), axis=1) * inv_sqrt_d
    part = tl.where(in_j, part, 0.0)
    if block == 0:
        tl.store(rotated_ptr + row * D + i, part, mask=in_j)
    # the centroids' scores, every one and this program's block of them, by the same elementwise
    # steps (coordinate by coordinate), so a centroid's two scores are the same float
    c = tl.arange(0, CENTROIDS)
    mine = block * BLOCK_C + tl.arange(0, BLOCK_C)
    score = tl.zeros([CENTROIDS], dtype=tl.float32)
    my_score = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(DIMS):
        coordinate = tl.sum(tl.where(j == k, part, 0.0), axis=0) * inv_sqrt_dims  # exact: one value and zeros
        score += tl.where(((c >> k) & 1) != 0, coordinate, -coordinate)
        my_score += tl.where(((mine >> k) & 1) != 0, coordinate, -coordinate)
    score = score + 0.0  # + 0.0: -0.0 ties +0.0, as in the reference's sort
    my_score = my_score + 0.0
    # rank = centroids scoring higher, plus those scoring the same with a lower id (a stable
    # sort's place): one count of BLOCK_C x CENTROIDS comparisons, the block's centroids only
    ahead = (score[None, :] > my_score[:, None]) | (
        (score[None, :] == my_score[:, None]) & (c[None, :] < mine[:, None])
    )
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    votes = tl.load(weights_ptr + rank, mask=rank < RHO, other=0)
    table_row = table_ptr + (row * S + sub) * IDS
    tl.store(table_row + mine, votes.to(tl.int8))
    if CENTROIDS < IDS:  # ids past the subspace's centroids get no votes
        if block == 0:
            rest = tl.arange(0, IDS)
            tl.store(table_row + rest, tl.zeros([IDS], dtype=tl.int8), mask=rest >= CENTROIDS)


@triton.jit
def _signed_unit(query, signs):
    """A query l2-normalised, times the SRHT signs: what the Hadamard rows rotate."""
    norm = tl.sqrt(tl.sum(query * query, axis=0))
    return query / tl.maximum(norm, 1e-12) * signs


@triton.jit
def _subspace_rotation(unit, parity, in_j, inv_sqrt_d):
    """The rotated coordinates of one subspace: the Hadamard rows ``parity`` picks (0 where
    ``in_j`` is not)."""
    part = tl.sum(tl.where(parity == 0, unit[None, :], -unit[None, :]), axis=1) * inv_sqrt_d
    return tl.where(in_j, part, 0.0)


@pdl_kernel
@triton.jit
def _query_votes_sort_kernel(
    query_ptr, signs_ptr, weights_ptr, rotated_ptr, table_ptr, logits_ptr,
    H, G, RHO,
    q_sb, q_sh, q_sg, q_sd,
    inv_sqrt_d, inv_sqrt_dims,
    D: tl.constexpr, LOG_D: tl.constexpr, BLOCK_G: tl.constexpr,
    S: tl.constexpr, DIMS: tl.constexpr, BLOCK_DIMS: tl.constexpr, CENTROIDS: tl.constexpr, IDS: tl.constexpr,
    PER_HEAD: tl.constexpr, LOGITS: tl.constexpr, PDL: tl.constexpr,
):
    # one program per (row, subspace): the prologue and the scores once, then the ranks by one
    # sort of the subspace's centroids (CENTROIDS x log^2 compare-swaps, where counting took
    # CENTROIDS^2 comparisons and repeated the prologue per block of 32). PER_HEAD: one program
    # per (row, subspace, query head), each ranking its own head's query into the head's table
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1)
    b = row // H
    h = row % H
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = tl.load(
        query_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :] * q_sd, mask=(g < G)[:, None], other=0.0
    ).to(tl.float32)
    # the signs and the rank-r centroid's votes, loaded with the query: neither depends on it, and
    # loaded where they are used they would wait behind the norm's and the sort's barriers
    signs = tl.load(signs_ptr + d)
    rank = tl.arange(0, CENTROIDS)
    votes = tl.load(weights_ptr + rank, mask=rank < RHO, other=0)
    mean = tl.sum(heads, axis=0) / G
    unit = _signed_unit(mean, signs)
    j = tl.arange(0, BLOCK_DIMS)
    in_j = j < DIMS
    i = sub * DIMS + j
    both = i[:, None] & d[None, :]
    parity = tl.zeros([BLOCK_DIMS, D], dtype=tl.int32)
    for bit in tl.static_range(LOG_D):
        parity ^= (both >> bit) & 1
    part = _subspace_rotation(unit, parity, in_j, inv_sqrt_d)
    if LOGITS:
        # each query head's logit query (analytic.head_logit_queries): its unit vector rotated, times
        # its norm and D**-0.5; this subspace's coordinates of every head (G x DIMS x D terms), by one
        # program of the row's subspace (with per-head tables, the programs of voting head 0)
        if PER_HEAD:
            writes = tl.program_id(2) == 0
        else:
            writes = True
        if writes:
            norms = tl.sqrt(tl.sum(heads * heads, axis=1))
            units = heads / tl.maximum(norms, 1e-12)[:, None] * signs[None, :]
            rotated_heads = tl.sum(tl.where((parity == 0)[None, :, :], units[:, None, :], -units[:, None, :]),
                                   axis=2) * inv_sqrt_d
            logit_query = rotated_heads * (norms * inv_sqrt_d)[:, None]
            tl.store(logits_ptr + (row * G + g[:, None]) * D + i[None, :], logit_query,
                     mask=(g < G)[:, None] & in_j[None, :])
    if PER_HEAD:
        voter = tl.program_id(2)
        if voter == 0:  # the rerank's query is still the group's mean: one program of the group writes it
            tl.store(rotated_ptr + row * D + i, part, mask=in_j)
        # the voting head's query, as the reference encodes each head: its own unit vector, rotated
        head = tl.sum(tl.where((g == voter)[:, None], heads, 0.0), axis=0)
        part = _subspace_rotation(_signed_unit(head, signs), parity, in_j, inv_sqrt_d)
    else:
        tl.store(rotated_ptr + row * D + i, part, mask=in_j)
    # the scores by the counting kernel's elementwise steps (the same floats)
    c = tl.arange(0, CENTROIDS)
    score = tl.zeros([CENTROIDS], dtype=tl.float32)
    for k in tl.static_range(DIMS):
        coordinate = tl.sum(tl.where(j == k, part, 0.0), axis=0) * inv_sqrt_dims
        score += tl.where(((c >> k) & 1) != 0, coordinate, -coordinate)
    score = score + 0.0  # -0.0 ties +0.0, as in the reference's sort
    # (score, then the lower id) as one int64 that orders as the reference's stable descending
    # sort: the float's bits made to order as the float (negatives flip their magnitude bits),
    # then 255 - id below them; sorted descending, entry r is the rank-r centroid
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 8) | (255 - c).to(tl.int64)
    ranked = tl.sort(key, 0, True)
    centroid = 255 - (ranked & 255)
    if PER_HEAD:
        table_row = table_ptr + ((row * G + voter) * S + sub) * IDS
    else:
        table_row = table_ptr + (row * S + sub) * IDS
    tl.store(table_row + centroid, votes.to(tl.int8))
    if CENTROIDS < IDS:  # ids past the subspace's centroids get no votes
        rest = tl.arange(0, IDS)
        tl.store(table_row + rest, tl.zeros([IDS], dtype=tl.int8), mask=rest >= CENTROIDS)


# how the ranks are found: "sort" (one program per (row, subspace), one tl.sort; H200: 7.2 us at
# 128Kx4 against 35.7) or "count" (one program per block of 32 centroids, each counting those
# ahead of it: the kernel before session 10, kept for benchmarks/pariskv_select.py's before/after
# rows). On the H200 "count" disagreed with the reference (a head_dim 128 case and exact float
# ties; docs/bench/session10/final/gpu_tests.log) where "sort" matched: the tests hold "count" to
# the reference on the CPU interpreter only
RANKS = "sort"
_SORT_WARPS = 2


def query_votes(
    query_group: torch.Tensor,
    signs: torch.Tensor,
    subspaces: int,
    tier_weights: Sequence[int] | torch.Tensor,
    per_head: bool = False,
    logit_queries: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(rotated (B, H, D) float32, table (B, H, S, 256) int8)``, with ``per_head`` one table per
    query head ``(B, H, G, S, 256)``, with ``logit_queries`` a third, each query head's logit query
    ``(B, H, G, D)`` float32 (``rerank="head_softmax"``'s, written by the same launch); see
    ``reference_analytic.query_votes``."""
    batch, heads, group, dim = query_group.shape
    weights = torch.as_tensor(tier_weights, dtype=torch.int32, device=query_group.device)
    dims = dim // subspaces if subspaces else 0
    if (dim < 2 or dim & (dim - 1) or not subspaces or dim % subspaces or dims > 8 or tuple(signs.shape) != (dim,)
            or weights.dim() != 1 or not 1 <= weights.shape[0] <= 1 << dims):
        raise ValueError(
            f"triton query_votes: query {tuple(query_group.shape)} (a power-of-two D), signs {tuple(signs.shape)}, "
            f"{subspaces} subspaces (at most 8 dims each) or {tuple(weights.shape)} tier weights do not fit"
        )
    if per_head and RANKS != "sort":
        raise ValueError(f"triton query_votes: per-head tables take RANKS 'sort', not {RANKS!r}")
    if logit_queries and RANKS != "sort":
        raise ValueError(f"triton query_votes: logit queries take RANKS 'sort', not {RANKS!r}")
    device = query_group.device
    rotated = torch.empty(batch, heads, dim, dtype=torch.float32, device=device)
    voters = (group,) if per_head else ()
    table = torch.empty(batch, heads, *voters, subspaces, reference_analytic.NUM_IDS, dtype=torch.int8, device=device)
    logits = torch.empty(batch, heads, group, dim, dtype=torch.float32, device=device) if logit_queries else None
    outputs = (rotated, table, logits) if logit_queries else (rotated, table)
    if batch * heads == 0:
        return outputs
    common = (query_group, signs.float().contiguous(), weights.contiguous(), rotated, table,
              *(() if RANKS == "count" else (rotated if logits is None else logits,)),
              heads, group, weights.shape[0], *query_group.stride(), 1.0 / math.sqrt(dim), 1.0 / math.sqrt(dims))
    shape = dict(D=dim, LOG_D=dim.bit_length() - 1, BLOCK_G=triton.next_power_of_2(group),
                 S=subspaces, DIMS=dims, BLOCK_DIMS=max(2, dims), CENTROIDS=1 << dims, IDS=reference_analytic.NUM_IDS)
    if RANKS == "sort":
        _query_votes_sort_kernel[(batch * heads, subspaces, *voters)](*common, **shape, PER_HEAD=per_head,
                                                                      LOGITS=logit_queries, num_warps=_SORT_WARPS)
    elif RANKS == "count":
        block_c = min(32, 1 << dims)
        _query_votes_kernel[(batch * heads, subspaces, (1 << dims) // block_c)](*common, **shape, BLOCK_C=block_c)
    else:
        raise ValueError(f"triton query_votes: RANKS {RANKS!r}; accepted: sort, count")
    return outputs


if "query_votes" in OPS:  # registered once dispatch.OPS names the op
    implement("triton", "query_votes", supports=triton_runs_on)(query_votes)
