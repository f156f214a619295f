"""Triton candidate top-k (op ``candidate_topk``): the ``k`` best-voted keys by counting sort.

Collision votes are small integers (at most ``subspaces * tiers``, 96 for ParisKV at d=128),
so the reference's order (votes descending, ties to the lower token index) is a stable
counting sort, and a key's place in it is

    (keys with more votes) + (keys with as many votes and a lower index)

which needs no comparison sort. Two launches over the votes, each one program per
(row, chunk of ``_CHUNK`` keys), and a few small torch ops between them, all on the device:

1. ``_histogram``: per chunk, how many keys have each vote (one-hot sums, ``BINS`` =
   ``next_power_of_2(max_score + 1)`` bins);
2. torch: per (row, chunk, vote) the place of the chunk's first key with that vote: the row's
   keys with more votes plus the earlier chunks' keys with that vote;
3. ``_place``: the chunk's keys in index order, ``_SUB`` at a time; a key's place is its
   vote's running place plus the keys before it in the step with the same vote; keys placed
   below ``k`` are written, the running places advance (atomically: keys of one step share
   votes). A vote whose next place is already ``k`` or more is skipped from then on.

Invalid keys (vote -1) never enter; places past the valid keys stay -1, like the reference.
The caller passes ``max_score`` (a host int): the histogram's size, without reading the votes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous

# keys per program, and per step inside it (a step compares _SUB x BINS and _SUB x _SUB)
_CHUNK = 1024
_SUB = 64
# the most votes a histogram holds (ParisKV's largest is 16 subspaces x 6 tiers = 96)
_MAX_BINS = 1024


@pdl_kernel
@triton.jit
def _histogram(scores_ptr, hist_ptr, N, CHUNKS, CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        index = chunk * CHUNK + s0 + tl.arange(0, SUB)
        votes = tl.load(scores_ptr + row * N + index, mask=index < N, other=-1)
        # -1 (invalid, or past the end) matches no bin
        counts += tl.sum((votes[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + (row * CHUNKS + chunk) * BINS + bins, counts)


@pdl_kernel
@triton.jit
def _place(scores_ptr, next_ptr, out_ptr, N, K, CHUNKS, CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    next_row = next_ptr + (row * CHUNKS + chunk) * BINS  # this chunk's running place per vote
    lane = tl.arange(0, SUB)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: key j comes before key i in the step
    for s0 in range(0, CHUNK, SUB):
        index = chunk * CHUNK + s0 + lane
        votes = tl.load(scores_ptr + row * N + index, mask=index < N, other=-1)
        valid = votes >= 0
        vote = tl.where(valid, votes, 0)
        start = tl.load(next_row + vote, mask=valid, other=K)
        live = valid & (start < K)
        same_before = tl.sum(((votes[:, None] == votes[None, :]) & earlier).to(tl.int32), axis=1)
        place = start + same_before
        tl.store(out_ptr + row * K + place, index.to(tl.int64), mask=live & (place < K))
        tl.debug_barrier()  # every lane has read its start before any advances
        tl.atomic_add(next_row + vote, 1, mask=live)
        tl.debug_barrier()


@implement("triton", "candidate_topk", supports=triton_runs_on)
def candidate_topk(scores: torch.Tensor, k: int, max_score: int | None = None) -> torch.Tensor:
    """The ``k`` best-voted keys, ``(B, H, k)`` long token indices, best first; see
    ``reference_analytic.candidate_topk``. ``max_score``: the largest vote any key can have
    (``subspaces * tiers`` for ParisKV's votes); votes above it would be lost, so it is required.
    """
    if max_score is None or not isinstance(max_score, int) or max_score < 0:
        raise ValueError(
            f"triton candidate_topk needs max_score, the largest possible vote (an int >= 0), got {max_score!r}"
        )
    bins = triton.next_power_of_2(max_score + 1)
    if bins > _MAX_BINS:
        raise ValueError(f"triton candidate_topk: max_score must be below {_MAX_BINS}, got {max_score}")
    if scores.dtype != torch.int32:
        raise ValueError(f"triton candidate_topk: scores must be int32 votes, got {scores.dtype}")
    *lead, n = scores.shape
    k = int(k)
    out = torch.full((*lead, k), -1, dtype=torch.long, device=scores.device)
    rows = scores.numel() // n if n else 0
    if rows == 0 or k == 0:
        return out
    scores = scores.contiguous()
    chunks = triton.cdiv(n, _CHUNK)
    hist = torch.empty(rows, chunks, bins, dtype=torch.int32, device=scores.device)
    _histogram[(rows, chunks)](scores, hist, n, chunks, CHUNK=_CHUNK, SUB=_SUB, BINS=bins)
    per_vote = hist.sum(1)  # (rows, bins)
    more_votes = per_vote.sum(-1, keepdim=True) - per_vote.cumsum(-1)  # keys of the row with a higher vote
    earlier_chunks = hist.cumsum(1) - hist  # keys with the same vote in earlier chunks
    next_place = (more_votes[:, None, :] + earlier_chunks).to(torch.int32).contiguous()
    _place[(rows, chunks)](scores, next_place, out, n, k, chunks, CHUNK=_CHUNK, SUB=_SUB, BINS=bins)
    return out
