"""Triton collision candidates (op ``collision_candidates``): votes, candidate count and the
candidate set, each centroid id read once.

Two pipelines, with the same output exactly. ``PIPELINE = "pass"`` (the default): the
three launches below (votes, threshold, compact; two in a small call, see
``folds_threshold``). ``PIPELINE = "fused"`` (session 10): two launches, the threshold folded into the compaction (see the comment above
``_votes_fused_kernel``); on an H200 its votes pass took 150 us at 128Kx4 against the pass's 46,
and 1,178 against 314 at 1Mx4 (docs/bench/session10/final/paris/), so it is not the default.

Replaces ``collision_count`` + ``candidate_topk`` + the device-side cut of the selector (a
histogram launch, a place launch, about fifteen torch ops for the mask, the prefix sums, the
count and the cut). Votes are small integers (at most ``max_votes``: 96 for 16 subspaces x 6
tiers), so the ``keep`` best-voted keys of a row are every key with more votes than a
threshold vote ``v*`` plus the first keys by position with exactly ``v*``:

1. ``_votes_kernel``, one program per (row, chunk of ``pass_chunk`` positions: 4096, fewer in
   a call too small to fill the GPU with programs of that size): reads the chunk's
   centroid ids (``S`` bytes per key, the only pass over them; as int32 words of four where
   the layout allows), looks each up in the row's vote table (``(S, 256)``, int8 from
   ``query_votes``, L1/L2-resident) one subspace at a time across the keys, so a warp's
   lookups hit one subspace's 256 bytes (two cache lines; an int32 table spreads a subspace
   over eight: with it this kernel read the ids at a quarter of HBM speed, 0.53 ms at 1M x 4
   on an H200 in session 6, which those lookups' L1 passes would explain; an estimate, not
   profiled), sums over subspaces, and writes the vote
   as int16 (-1 where the position is not voted on: padding, sink, update buffer, past
   ``indexed``) and the chunk's histogram of votes (bin 0: not voted; bin ``v + 1``: vote v).
2. ``_threshold_kernel``, one program per row: the row's voted tokens ``n`` (the histogram's
   sum), the candidate count by ParisKV's length rule (``reference_analytic.candidate_count``,
   the same float32 arithmetic), the threshold vote, and per chunk where its candidates start
   in the output and how many of its ``v*`` keys are taken (the first by position overall).
3. ``_compact_kernel``, one program per (row, chunk): reads the votes again (2 bytes a key,
   an eighth of the ids' 16) and writes the chunk's candidates at their places, in position
   order, so the rerank reads the candidates' codes in address order; and its share of the
   row's -1 tail (so no fill launch precedes the three).

A call too small to fill the GPU with ``_CHUNK``-position programs (its chunk shrank; batch 1
at 32K), and since session 18 a large one too (``FOLD_LARGE_THRESHOLD``), folds step 2 into step 3
(``folds_threshold``, ``FOLD_SMALL_THRESHOLD``): the votes pass adds each chunk's
histogram into the row's (atomics into a zeroed ``(rows, BINS)``, self-clearing scratch: the
row's last compaction program zeroes it again, so no memset precedes it) and writes the chunk's
suffix counts (bin b: its keys with vote bin b or more), and every compaction program finds the
row's count and threshold from the row histogram and its start from two suffix counts of each
earlier chunk (``_compact_fused_kernel``, the fused pipeline's). One program a row walking up to
128 chunk histograms (4.8 us at 1x32K on an H200, session 14) is gone; each compaction
program waits on one more dependent load (the suffix counts, after the row's threshold).

Per-head tables (``query_votes(per_head=True)``: ``(B, H, G, S, 256)``, ParisKV's
``votes="head_max"``): both votes kernels take them under the constexpr ``HEADS`` (0: the
group's one table, the code above unchanged). A key's ids are still read once; each id is looked
up in every head's row (``(G, keys)`` lookups, ``G x 4 KB`` of int8 tables a row), the G sums
kept apart and the key's votes their max. The threshold and the compaction read the votes only,
so they do not change.

Per key and step: the ids once (``S`` bytes), the vote written and read once (2 + 2 bytes),
``token_valid`` once (1 byte per sequence, shared by its heads through the cache). The output
is the same set as the reference (exact: integer arithmetic, the count in float32 as there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import reference_analytic
from ..dispatch import OPS, implement, triton_runs_on
from . import scratch
from .pdl import pdl_kernel, wait_for_previous

# positions per program of the votes and compaction passes; keys per step inside one. 4096 with the
# large calls' fold (below): at 2048 a folded 1Mx4 call's compaction programs each read the counts of
# up to 640 earlier chunks (208 us, H200, session 18), at 4096 half as many (130 us)
_CHUNK = 4096
_SUB = 256
# a small call (batch 1 at 32K: 8 rows of ~40K positions, 80 programs of 16 steps at _CHUNK)
# runs a loop of dependent steps on too few programs: the chunk shrinks, down to _MIN_CHUNK,
# until the grid has about _PASS_PROGRAMS programs (an H200 holds ~2,000 4-warp programs at
# once); a chunk of at most _ONE_STEP_CHUNK positions is read in one step (its loads all
# independent). Larger calls keep _CHUNK and _SUB (128K x 4: 1,280 programs)
_PASS_PROGRAMS = 1024
_MIN_CHUNK = 512
_ONE_STEP_CHUNK = 512
# chunks per step of the threshold pass (a step holds _CHUNK_BLOCK x BINS counts); a row of at
# most _WHOLE_ROW_CHUNKS chunks is read in one step (8 warps), so the smaller chunks above cost
# the threshold pass no extra dependent loads
_CHUNK_BLOCK = 32
_WHOLE_ROW_CHUNKS = 128
# bands of the length rule the kernel takes (ParisKV's has 3)
_MAX_BANDS = 4
# warps a program of the votes and compaction passes (4: Triton's default, what every measurement
# so far ran); benchmarks/pariskv_select.py's COLLISION_VARIANTS times the others
_VOTES_WARPS = 4
_COMPACT_WARPS = 4
# a small call (chunk under _CHUNK, at most _MAX_CHUNKS chunks a row): the threshold pass folded
# into the compaction (see the module docstring); False: the threshold launch at every size
FOLD_SMALL_THRESHOLD = True
# with FOLD_SMALL_THRESHOLD, a large call (chunks of _CHUNK) folded too, as long as a row has at most
# _MAX_CHUNKS chunks: its threshold pass is one program a row walking every chunk's histogram twice
# (49 us at 1Mx4 on an H200), where each folded compaction program reads two counts of each earlier
# chunk from L2. The whole op on an H200 (session 18, benchmarks/pariskv_select.py, same candidates):
# 1Mx4 464.5 us against 529.8 unfolded at chunks of 2048, 128Kx4 78.4 against 83.6, 512Kx1 78.6
# against 96.9
FOLD_LARGE_THRESHOLD = True
# Session 19 measured three other votes passes on an H200 (1Mx4, against 324 us; all removed): the
# lookups by tl.gather from a table held by the program, through shared memory, 2,175 us; each step's
# ids loaded a step ahead as one tile of words, 1,161 us; a table of two 4-bit votes a byte (a
# subspace's lookups in one 128-byte line, two more ALU steps a lookup), 603 us. The pass is bound by
# its instructions a lookup (about six: the id's byte, a 64-bit address, the load, the add), not by
# the ids' bytes or L1's lines
# "pass" (votes, threshold, compact) or session 10's "fused" (two launches; 3.3x and
# 3.7x slower votes at 128Kx4 and 1Mx4 on an H200, so kept for benchmarks/pariskv_select.py only)
PIPELINE = "pass"
# the fused pipeline: about _VOTES_PROGRAMS programs a pass (the chunk grows from _FUSED_MIN_CHUNK past
# that, so a row has fewer chunks: 64 at 128Kx4, 128 at 1Mx4), at most _MAX_CHUNKS chunks a row
# (the compaction reads two counts of each), keys per step of its compaction
_VOTES_PROGRAMS = 4096
_FUSED_MIN_CHUNK = 2048
_MAX_CHUNKS = 1024
_COMPACT_SUB = 1024


@triton.jit
def _suffix_and_row_hist(hist, bins, suffix_at, row_hist_at):
    """A chunk's suffix counts (per bin, its positions in that bin or above; bin ``v + 1`` holds
    ``v`` votes) stored at ``suffix_at``, and its histogram added to the row's at ``row_hist_at``
    (bin 0, the positions not voted, left out)."""
    suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    tl.store(suffix_at + bins, suffix)
    tl.atomic_add(row_hist_at + bins, hist, mask=(hist != 0) & (bins > 0), sem="relaxed")


@triton.jit
def _head_rows(HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, S: tl.constexpr, IDS: tl.constexpr):
    """Where each query head's table starts in a row's ``(HEADS, S, IDS)`` tables, ``(BLOCK_HEADS,
    1)``: the padding heads past ``HEADS`` read the last head's again, so they never win the max."""
    return (tl.minimum(tl.arange(0, BLOCK_HEADS), HEADS - 1) * (S * IDS))[:, None]


@pdl_kernel
@triton.jit
def _votes_kernel(
    table_ptr, keys_ptr, valid_ptr, indexed_ptr, votes_ptr, hist_ptr, row_hist_ptr,
    H, N, CHUNKS,
    key_sb, key_sh, key_sn, key_ss,
    valid_sb, valid_sn,
    S: tl.constexpr, IDS: tl.constexpr, WORDS: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, ROW_HIST: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, PDL: tl.constexpr,
):
    # HEADS: 0, one table a row (the group's mean query); else the row's HEADS query heads' tables,
    # each key's ids looked up in every one and its votes the best head's sum
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    indexed = tl.load(indexed_ptr)
    if HEADS:
        table_row = table_ptr + row * HEADS * S * IDS
        head_rows = _head_rows(HEADS, BLOCK_HEADS, S, IDS)
    else:
        table_row = table_ptr + row * S * IDS
    bins = tl.arange(0, BINS)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        n = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_n = n < N
        # the positions' flags first: loaded after the lookups (in source order), ptxas issued
        # them after the lookups had returned, a dependent load more before the stores
        valid = tl.load(valid_ptr + b * valid_sb + n * valid_sn, mask=in_n, other=0)
        key_row = keys_ptr + b * key_sb + h * key_sh + n * key_sn
        # one subspace at a time across the keys: a warp's lookups then fall in one subspace's
        # 256-entry row (two cache lines of int8 votes), not across the whole table
        if HEADS:
            total = tl.zeros([BLOCK_HEADS, SUB], dtype=tl.int32)
        else:
            total = tl.zeros([SUB], dtype=tl.int32)
        if WORDS:  # the ids as int32 words, four subspaces each (keys_ptr is the int32 view)
            for w in tl.static_range(S // 4):
                word = tl.load(key_row + w * key_ss, mask=in_n, other=0)
                for j in tl.static_range(4):
                    ids = (word >> (8 * j)) & 255
                    if HEADS:
                        total += tl.load(table_row + head_rows + (4 * w + j) * IDS + ids[None, :], mask=in_n[None, :],
                                         other=0).to(tl.int32)
                    else:
                        total += tl.load(table_row + (4 * w + j) * IDS + ids, mask=in_n, other=0).to(tl.int32)
        else:
            for sub in tl.static_range(S):
                ids = tl.load(key_row + sub * key_ss, mask=in_n, other=0).to(tl.int32)
                if HEADS:
                    total += tl.load(table_row + head_rows + sub * IDS + ids[None, :], mask=in_n[None, :],
                                     other=0).to(tl.int32)
                else:
                    total += tl.load(table_row + sub * IDS + ids, mask=in_n, other=0).to(tl.int32)
        if HEADS:  # the key's best head
            total = tl.max(total, axis=0)
        # (not next to the flags' load: there ptxas placed the compare before the ids' loads, so
        # the ids waited on the indexed count's load)
        voted = in_n & (valid != 0) & (n < indexed)
        tl.store(votes_ptr + row * N + n, tl.where(voted, total, -1).to(tl.int16), mask=in_n)
        hist += tl.histogram(tl.where(voted, total + 1, 0), BINS)
    if ROW_HIST:  # the threshold folded into the compaction: suffix counts, and the row's histogram
        _suffix_and_row_hist(hist, bins, hist_ptr + (row * CHUNKS + chunk) * BINS, row_hist_ptr + row * BINS)
    else:
        tl.store(hist_ptr + (row * CHUNKS + chunk) * BINS + bins, hist)


def _as_words(key_centroids: torch.Tensor) -> torch.Tensor | None:
    """The uint8 ids as int32 words (4 subspaces each), where the layout allows; else None."""
    if key_centroids.shape[-1] % 4 or key_centroids.stride(-1) != 1:
        return None
    try:
        return key_centroids.view(torch.int32)
    except RuntimeError:  # strides or offset not a multiple of 4 bytes
        return None


@triton.jit
def _length_rule(
    n, FLOOR, fraction,
    bound0, share0, held0, bound1, share1, held1, bound2, share2, held2, bound3, share3, held3,
):
    """ParisKV's length rule (reference_analytic.candidate_count): the smallest band n is below
    wins; from each band's bound on, at least its held count (0 unless the rule holds)."""
    share = fraction
    share = tl.where(n < bound3, tl.maximum(share3, fraction), share)
    share = tl.where(n < bound2, tl.maximum(share2, fraction), share)
    share = tl.where(n < bound1, tl.maximum(share1, fraction), share)
    share = tl.where(n < bound0, tl.maximum(share0, fraction), share)
    wanted = n.to(tl.float32) * share
    whole = wanted.to(tl.int32)  # wanted >= 0: truncation, then up where a fraction remains (= ceil)
    keep = tl.maximum(whole + (whole.to(tl.float32) < wanted).to(tl.int32), FLOOR)
    keep = tl.where(n >= bound0, tl.maximum(keep, held0), keep)
    keep = tl.where(n >= bound1, tl.maximum(keep, held1), keep)
    keep = tl.where(n >= bound2, tl.maximum(keep, held2), keep)
    return tl.where(n >= bound3, tl.maximum(keep, held3), keep)


@pdl_kernel
@triton.jit
def _threshold_kernel(
    hist_ptr, start_ptr, ties_ptr, level_ptr, take_ptr,
    CHUNKS, WIDTH, FLOOR, fraction,
    bound0, share0, held0, bound1, share1, held1, bound2, share2, held2, bound3, share3, held3,
    BINS: tl.constexpr, CHUNK_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK_BLOCK)
    base = hist_ptr + row * CHUNKS * BINS
    total = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, CHUNKS, CHUNK_BLOCK):
        c = c0 + lanes
        block = tl.load(base + c[:, None] * BINS + bins[None, :], mask=(c < CHUNKS)[:, None], other=0)
        total += tl.sum(block, axis=0)
    total = tl.where(bins > 0, total, 0)  # bin 0: not voted on
    n = tl.sum(total, axis=0)
    keep = _length_rule(
        n, FLOOR, fraction,
        bound0, share0, held0, bound1, share1, held1, bound2, share2, held2, bound3, share3, held3,
    )
    take = tl.minimum(tl.minimum(keep, n), WIDTH)
    # keys with at least bin b's vote; the threshold is the highest bin that reaches `take`
    at_least = tl.sum(total, axis=0) - tl.cumsum(total, axis=0) + total
    level = tl.max(tl.where((at_least >= take) & (bins > 0), bins, 0), axis=0)
    level = tl.where(take > 0, level, BINS)  # nothing to take: no bin qualifies
    above = tl.sum(tl.where(bins > level, total, 0), axis=0)
    ties = take - above  # keys with the threshold vote to take, the first by position
    tl.store(level_ptr + row, level)
    tl.store(take_ptr + row, take)
    ties_before = 0
    placed = 0
    for c0 in range(0, CHUNKS, CHUNK_BLOCK):
        c = c0 + lanes
        in_c = c < CHUNKS
        block = tl.load(base + c[:, None] * BINS + bins[None, :], mask=in_c[:, None], other=0)
        over = tl.sum(tl.where(bins[None, :] > level, block, 0), axis=1)
        tied = tl.sum(tl.where(bins[None, :] == level, block, 0), axis=1)
        tied_before = ties_before + tl.cumsum(tied, axis=0) - tied
        taken_ties = tl.minimum(tl.maximum(ties - tied_before, 0), tied)
        count = over + taken_ties
        tl.store(start_ptr + row * CHUNKS + c, placed + tl.cumsum(count, axis=0) - count, mask=in_c)
        tl.store(ties_ptr + row * CHUNKS + c, taken_ties, mask=in_c)
        ties_before += tl.sum(tied, axis=0)
        placed += tl.sum(count, axis=0)


@pdl_kernel
@triton.jit
def _compact_kernel(
    votes_ptr, start_ptr, ties_ptr, level_ptr, take_ptr, out_ptr,
    N, CHUNKS, WIDTH, FILL,
    CHUNK: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    level = tl.load(level_ptr + row)
    ties = tl.load(ties_ptr + row * CHUNKS + chunk)
    placed = tl.load(start_ptr + row * CHUNKS + chunk)
    ties_seen = 0
    for s0 in range(0, CHUNK, SUB):
        n = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_n = n < N
        vote_bin = tl.load(votes_ptr + row * N + n, mask=in_n, other=-1).to(tl.int32) + 1
        tied = (vote_bin == level).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tied, axis=0) - tied
        take = ((vote_bin > level) | ((tied != 0) & (tie_rank < ties))).to(tl.int32)
        place = placed + tl.cumsum(take, axis=0) - take
        tl.store(out_ptr + row * WIDTH + place, n, mask=(take != 0) & (place < WIDTH))
        ties_seen += tl.sum(tied, axis=0)
        placed += tl.sum(take, axis=0)
    # the -1 tail past the row's candidates: FILL places of it per chunk (no separate fill launch)
    taken = tl.load(take_ptr + row)
    for f0 in range(0, FILL, SUB):
        place = chunk * FILL + f0 + tl.arange(0, SUB).to(tl.int64)
        tl.store(out_ptr + row * WIDTH + place, tl.full([SUB], -1, tl.int64),
                 mask=(place >= taken) & (place < WIDTH) & (f0 + tl.arange(0, SUB) < FILL))


# -- session 10: two launches, the threshold folded into the compaction (PIPELINE = "fused") -----
#
# 1. ``_votes_fused_kernel``, one program per (row, chunk): as ``_votes_kernel``, but it reads a
#    key's ids as one 16-byte vector (a (keys, S / 4) tile of int32 words; the row stride a
#    constexpr, so the compiler can prove the alignment), streams them past L1 (``.cg``: the
#    row's 4 KB vote table stays there for the lookups), writes the votes as int8 where
#    ``max_votes`` allows (one byte a key), and writes its histogram as suffix counts (bin b:
#    the chunk's keys with vote bin >= b), adding the histogram to the row's (atomics: about
#    100 non-zero bins a program);
# 2. ``_compact_fused_kernel``, one program per (row, chunk): the row's count and threshold from
#    the row histogram (128 bins: the threshold pass's arithmetic), where its candidates start
#    from two suffix counts of each earlier chunk (the radix place pass's scheme), then the
#    compaction with one scan per step (the keys above the threshold and the tied keys packed
#    in one int32, 16 bits each), and its share of the -1 tail.
#
# The one-program-per-row threshold pass is gone: 7 us at 128Kx4, 50 us at 1Mx4 on the H200
# (session 9), where it walked the row's 64 or 512 chunk histograms twice, one block of 32 at a time.


@pdl_kernel
@triton.jit
def _votes_fused_kernel(
    table_ptr, keys_ptr, valid_ptr, indexed_ptr, votes_ptr, suffix_ptr, row_hist_ptr,
    H, N, CHUNKS,
    key_sb, key_sh, key_sn, key_ss,
    valid_sb, valid_sn,
    KEY_SN: tl.constexpr, S: tl.constexpr, IDS: tl.constexpr, WORDS: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, PDL: tl.constexpr,
):
    # HEADS: as _votes_kernel's (0: one table a row; else each query head's, the best head's votes)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    indexed = tl.load(indexed_ptr)
    if HEADS:
        table_row = table_ptr + row * HEADS * S * IDS
        head_rows = _head_rows(HEADS, BLOCK_HEADS, S, IDS)
    else:
        table_row = table_ptr + row * S * IDS
    bins = tl.arange(0, BINS)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        n = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_n = n < N
        if HEADS:
            total = tl.zeros([BLOCK_HEADS, SUB], dtype=tl.int32)
        else:
            total = tl.zeros([SUB], dtype=tl.int32)
        if WORDS:  # keys_ptr is the int32 view: S / 4 words a key, contiguous (one vector load)
            key_row = keys_ptr + b * key_sb + h * key_sh + n * KEY_SN
            w = tl.arange(0, S // 4)
            tile = tl.load(key_row[:, None] + w[None, :], mask=in_n[:, None], other=0, cache_modifier=".cg")
            for k in tl.static_range(S // 4):
                word = tl.sum(tl.where(w[None, :] == k, tile, 0), axis=1)  # a key's words sit in one thread
                for j in tl.static_range(4):
                    ids = (word >> (8 * j)) & 255
                    if HEADS:
                        total += tl.load(table_row + head_rows + (4 * k + j) * IDS + ids[None, :], mask=in_n[None, :],
                                         other=0, eviction_policy="evict_last").to(tl.int32)
                    else:
                        total += tl.load(table_row + (4 * k + j) * IDS + ids, mask=in_n, other=0,
                                         eviction_policy="evict_last").to(tl.int32)
        else:  # the uint8 ids, a byte at a time (a layout the words cannot read)
            key_row = keys_ptr + b * key_sb + h * key_sh + n * key_sn
            for sub in tl.static_range(S):
                ids = tl.load(key_row + sub * key_ss, mask=in_n, other=0).to(tl.int32)
                if HEADS:
                    total += tl.load(table_row + head_rows + sub * IDS + ids[None, :], mask=in_n[None, :],
                                     other=0).to(tl.int32)
                else:
                    total += tl.load(table_row + sub * IDS + ids, mask=in_n, other=0).to(tl.int32)
        if HEADS:  # the key's best head
            total = tl.max(total, axis=0)
        valid = tl.load(valid_ptr + b * valid_sb + n * valid_sn, mask=in_n, other=0)
        voted = in_n & (valid != 0) & (n < indexed)
        tl.store(votes_ptr + row * N + n, tl.where(voted, total, -1).to(votes_ptr.dtype.element_ty), mask=in_n)
        hist += tl.histogram(tl.where(voted, total + 1, 0), BINS)
    _suffix_and_row_hist(hist, bins, suffix_ptr + (row * CHUNKS + chunk) * BINS, row_hist_ptr + row * BINS)


@pdl_kernel
@triton.jit
def _compact_fused_kernel(
    votes_ptr, suffix_ptr, row_hist_ptr, done_ptr, out_ptr,
    N, CHUNKS, WIDTH, FILL, FLOOR, fraction,
    bound0, share0, held0, bound1, share1, held1, bound2, share2, held2, bound3, share3, held3,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # the first step's votes, loaded before the row's histogram (they do not depend on it); the
    # next step's a step ahead
    pos = chunk * CHUNK + tl.arange(0, SUB).to(tl.int64)
    vote_next = tl.load(votes_ptr + row * N + pos, mask=pos < N, other=-1).to(tl.int32) + 1
    bins = tl.arange(0, BINS)
    # the row's count and threshold: _threshold_kernel's arithmetic on the row histogram
    total = tl.load(row_hist_ptr + row * BINS + bins)
    total = tl.where(bins > 0, total, 0)
    n = tl.sum(total, axis=0)
    # the row histogram is self-clearing scratch (scratch.zeroed): the row's last program to have
    # read it zeroes it for the next call, and its ticket; the barrier puts this program's reads
    # before its ticket
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
        tl.store(row_hist_ptr + row * BINS + bins, tl.zeros([BINS], dtype=tl.int32))
        tl.store(done_ptr + row, 0)
    keep = _length_rule(
        n, FLOOR, fraction,
        bound0, share0, held0, bound1, share1, held1, bound2, share2, held2, bound3, share3, held3,
    )
    take = tl.minimum(tl.minimum(keep, n), WIDTH)
    at_least = n - tl.cumsum(total, axis=0) + total
    level = tl.max(tl.where((at_least >= take) & (bins > 0), bins, 0), axis=0)
    level = tl.where(take > 0, level, BINS)
    above = tl.sum(tl.where(bins > level, total, 0), axis=0)
    ties = take - above  # tied keys to take, the first by position over the row
    # every chunk's keys above the threshold and at it, from its suffix counts
    others = tl.arange(0, CHUNKS_BLOCK)
    in_others = others < CHUNKS
    base = suffix_ptr + (row * CHUNKS + others) * BINS
    # (level BINS: nothing taken; level BINS - 1: nothing above it)
    over = tl.load(base + tl.minimum(level + 1, BINS - 1), mask=in_others, other=0)
    over = tl.where(level + 1 < BINS, over, 0)
    at = tl.load(base + tl.minimum(level, BINS - 1), mask=in_others, other=0)
    at = tl.where(level < BINS, at, 0) - over
    taken = tl.minimum(tl.maximum(ties - (tl.cumsum(at, axis=0) - at), 0), at)
    placed = tl.sum(tl.where(others < chunk, over + taken, 0), axis=0)
    my_ties = tl.sum(tl.where(others == chunk, taken, 0), axis=0)
    ties_seen = 0
    for s0 in range(0, CHUNK, SUB):
        pos = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_n = pos < N
        vote_bin = vote_next
        ahead = pos + SUB
        vote_next = tl.load(votes_ptr + row * N + ahead, mask=(ahead < N) & (s0 + SUB < CHUNK), other=-1).to(tl.int32) + 1
        tied = (vote_bin == level).to(tl.int32)
        high = (vote_bin > level).to(tl.int32)
        # one scan for both counts: keys above the threshold in the high 16 bits, tied ones in the low
        packed = (high << 16) | tied
        before = tl.cumsum(packed, axis=0) - packed
        tied_before = ties_seen + (before & 0xFFFF)
        chosen = (high != 0) | ((tied != 0) & (tied_before < my_ties))
        place = placed + (before >> 16) + tl.minimum(tied_before, my_ties)
        tl.store(out_ptr + row * WIDTH + place, pos, mask=chosen & (place < WIDTH))
        step = tl.sum(packed, axis=0)
        ties_seen += step & 0xFFFF
        placed += step >> 16  # the tied ones are counted by ties_seen
    # the -1 tail past the row's candidates: FILL places of it per chunk
    for f0 in range(0, FILL, SUB):
        place = chunk * FILL + f0 + tl.arange(0, SUB).to(tl.int64)
        tl.store(out_ptr + row * WIDTH + place, tl.full([SUB], -1, tl.int64),
                 mask=(place >= take) & (place < WIDTH) & (f0 + tl.arange(0, SUB) < FILL))


def _bands(bands: Sequence[tuple[int, float]], fraction: float, hold: bool) -> list:
    """The length rule's bands as kernel arguments: bound, share and held count of each."""
    bands = list(bands)
    if len(bands) > _MAX_BANDS:
        raise ValueError(f"triton collision_candidates: at most {_MAX_BANDS} length bands, got {len(bands)}")
    held = [count for _, count in reference_analytic.held_counts(bands, fraction, hold)]
    rows = [(int(bound), float(share), count) for (bound, share), count in zip(bands, held)]
    rows += [(0, 0.0, 0)] * (_MAX_BANDS - len(rows))  # bound 0: no n is below it, nothing held
    return [value for row in rows for value in row]


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
    """Candidates ``(B, H, width)`` long, by position, -1 tail; see ``reference_analytic.collision_candidates``
    (a ``(B, H, G, S, 256)`` table: each query head's, a key's votes its best head's)."""
    batch, heads, n, subspaces = key_centroids.shape
    # query heads with a table each (query_votes(per_head=True)); 0: one table a row
    voters = table.shape[2] if table.dim() == 5 else 0
    per_row = (voters,) if voters else ()
    if (tuple(table.shape) != (batch, heads, *per_row, subspaces, reference_analytic.NUM_IDS)
            or table.dtype not in (torch.int8, torch.int32)
            or tuple(token_valid.shape) != (batch, n) or indexed.numel() != 1):
        raise ValueError(
            f"triton collision_candidates: table {tuple(table.shape)} {table.dtype}, token_valid "
            f"{tuple(token_valid.shape)} or indexed {tuple(indexed.shape)} do not fit key centroids "
            f"{tuple(key_centroids.shape)} (want an int8 or int32 (B, H, S, 256) or (B, H, G, S, 256) table, "
            f"(B, N) token_valid, one indexed)"
        )
    if not isinstance(max_votes, int) or not 0 <= max_votes < 32766:
        raise ValueError(f"triton collision_candidates: max_votes must be an int in 0..32765 (int16 votes), got {max_votes!r}")
    # the length rule as kernel arguments, checked before any launch: a call refused between the
    # votes and the compaction would leave the row histograms (self-clearing scratch) dirty
    rule = (int(floor), float(fraction), *_bands(bands, float(fraction), bool(hold)))
    width = int(width)
    rows = batch * heads
    if rows == 0 or n == 0 or width == 0:
        return torch.full((batch, heads, width), -1, dtype=torch.long, device=key_centroids.device)
    table = table.contiguous()
    valid = token_valid.view(torch.uint8) if token_valid.dtype == torch.bool else token_valid
    voting = dict(HEADS=voters, BLOCK_HEADS=triton.next_power_of_2(max(1, voters)))
    if PIPELINE == "fused":
        return _fused(table, key_centroids, valid, indexed, width, max_votes, rule, voting)
    if PIPELINE != "pass":
        raise ValueError(f"triton collision_candidates: PIPELINE {PIPELINE!r}; accepted: fused, pass")
    out = torch.empty(batch, heads, width, dtype=torch.long, device=key_centroids.device)
    device = key_centroids.device
    bins = triton.next_power_of_2(max_votes + 2)
    chunk = pass_chunk(rows, n)
    sub = chunk if chunk <= _ONE_STEP_CHUNK else _SUB
    chunks = triton.cdiv(n, chunk)
    chunk_block = triton.next_power_of_2(chunks) if chunks <= _WHOLE_ROW_CHUNKS else _CHUNK_BLOCK
    votes = torch.empty(batch, heads, n, dtype=torch.int16, device=device)
    hist = torch.empty(rows, chunks, bins, dtype=torch.int32, device=device)
    fold = folds_threshold(rows, n)
    row_hist, done = _row_scratch(device, rows, bins) if fold else (hist, None)
    words = _as_words(key_centroids)
    ids = key_centroids if words is None else words
    _votes_kernel[(rows, chunks)](
        table, ids, valid, indexed, votes, hist, row_hist,
        heads, n, chunks,
        *ids.stride(), *valid.stride(),
        S=subspaces, IDS=reference_analytic.NUM_IDS, WORDS=words is not None,
        CHUNK=chunk, SUB=sub, BINS=bins, ROW_HIST=fold, **voting, num_warps=_VOTES_WARPS,
    )
    if fold:  # hist holds suffix counts: the compaction finds the threshold itself
        _compact_fused_kernel[(rows, chunks)](
            votes, hist, row_hist, done, out,
            n, chunks, width, triton.cdiv(width, chunks), *rule,
            CHUNK=chunk, SUB=sub, BINS=bins, CHUNKS_BLOCK=max(2, triton.next_power_of_2(chunks)),
            num_warps=_COMPACT_WARPS,
        )
        return out
    start = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    ties = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    level = torch.empty(rows, dtype=torch.int32, device=device)
    take = torch.empty(rows, dtype=torch.int32, device=device)
    _threshold_kernel[(rows,)](
        hist, start, ties, level, take,
        chunks, width, *rule,
        BINS=bins, CHUNK_BLOCK=chunk_block, num_warps=8 if chunk_block > _CHUNK_BLOCK else 4,
    )
    _compact_kernel[(rows, chunks)](
        votes, start, ties, level, take, out, n, chunks, width, triton.cdiv(width, chunks), CHUNK=chunk, SUB=sub,
        num_warps=_COMPACT_WARPS,
    )
    return out


def _row_scratch(device: torch.device, rows: int, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row histograms ``(rows, bins)`` the votes pass adds into and the compaction's tickets
    ``(rows,)``: zeroed scratch its compaction leaves zeroed (no fill launch)."""
    return (scratch.zeroed(device, "collision_candidates.row_hist", (rows, bins)),
            scratch.zeroed(device, "collision_candidates.done", (rows,)))


def pass_chunk(rows: int, n: int) -> int:
    """Positions per program of the pass pipeline: ``_CHUNK``, or fewer (down to ``_MIN_CHUNK``)
    where ``_CHUNK`` would leave fewer than about ``_PASS_PROGRAMS`` programs."""
    wanted = triton.next_power_of_2(triton.cdiv(max(1, rows * n), _PASS_PROGRAMS))
    return min(_CHUNK, max(_MIN_CHUNK, wanted))


def folds_threshold(rows: int, n: int) -> bool:
    """Whether the pass pipeline folds its threshold pass into the compaction: where
    ``FOLD_SMALL_THRESHOLD`` and the chunk shrank below ``_CHUNK`` (or at any chunk with
    ``FOLD_LARGE_THRESHOLD``), at most ``_MAX_CHUNKS`` chunks a row."""
    chunk = pass_chunk(rows, n)
    return (FOLD_SMALL_THRESHOLD and (chunk < _CHUNK or FOLD_LARGE_THRESHOLD)
            and triton.cdiv(n, chunk) <= _MAX_CHUNKS)


def fused_chunk(rows: int, n: int) -> int:
    """Positions per program of the fused pipeline: ``_FUSED_MIN_CHUNK``, or more where about
    ``_VOTES_PROGRAMS`` programs (or ``_MAX_CHUNKS`` chunks a row) would leave fewer."""
    chunk = triton.next_power_of_2(triton.cdiv(max(1, rows * n), _VOTES_PROGRAMS))
    return max(_FUSED_MIN_CHUNK, chunk, triton.next_power_of_2(triton.cdiv(max(1, n), _MAX_CHUNKS)))


def _fused(table, key_centroids, valid, indexed, width, max_votes, rule, voting):
    batch, heads, n, subspaces = key_centroids.shape
    rows = batch * heads
    device = key_centroids.device
    out = torch.empty(batch, heads, width, dtype=torch.long, device=device)
    bins = triton.next_power_of_2(max_votes + 2)
    chunk = fused_chunk(rows, n)
    chunks = triton.cdiv(n, chunk)
    # votes -1..max_votes: one byte where they fit
    votes = torch.empty(batch, heads, n, dtype=torch.int8 if max_votes <= 126 else torch.int16, device=device)
    suffix = torch.empty(rows, chunks, bins, dtype=torch.int32, device=device)
    row_hist, done = _row_scratch(device, rows, bins)
    words = _as_words(key_centroids)
    # the words path needs the row stride as a constexpr (the vector loads' alignment)
    ids = key_centroids if words is None else words
    _votes_fused_kernel[(rows, chunks)](
        table, ids, valid, indexed, votes, suffix, row_hist,
        heads, n, chunks,
        *ids.stride(), *valid.stride(),
        KEY_SN=ids.stride(2) if words is not None else 0, S=subspaces, IDS=reference_analytic.NUM_IDS,
        WORDS=words is not None, CHUNK=chunk, SUB=min(chunk, _SUB), BINS=bins, **voting, num_warps=_VOTES_WARPS,
    )
    _compact_fused_kernel[(rows, chunks)](
        votes, suffix, row_hist, done, out,
        n, chunks, width, triton.cdiv(width, chunks), *rule,
        CHUNK=chunk, SUB=min(chunk, _COMPACT_SUB), BINS=bins, CHUNKS_BLOCK=max(2, triton.next_power_of_2(chunks)),
        num_warps=_COMPACT_WARPS,
    )
    return out


if "collision_candidates" in OPS:  # registered once dispatch.OPS names the op
    implement("triton", "collision_candidates", supports=triton_runs_on)(collision_candidates)
