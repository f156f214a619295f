"""Triton budget fill (op ``select_budget``): same contract and results as the reference.

One fill launch, one program per (sequence, KV head), after the radix select's launches when
that ranking runs:

0. a program whose sequence has ``take[b]`` False writes an empty selection (slots 0,
   ``slot_valid`` False, ``num_units`` 0, ``unit_ids`` -1) and returns: in a replayed decode
   graph the fill and the ranking cost nothing on the steps where
   the sequence keeps its selection (every radix launch's programs of such a row exit at once);
1. rank the units (which way: see ``AUTO_RANKING``): in the kernel, ``tl.sort`` of one 64-bit key
   per unit over a power-of-two block (see ``_descending_key``: the score's bits made
   order-preserving and inverted in the high word, the unit index in the low word, so the
   ascending key order is exactly ``torch.sort(descending=True, stable=True)``'s order of the
   selectable units, ties by ascending index). Units that cannot be taken (``-inf``/NaN) get
   one key above every selectable one (their relative order never changes the outputs: they
   cover no tokens), padding the largest key. The ranked unit ids (-1 for the unselectable)
   go to a scratch row. Or a threshold select (``_threshold_rank``): a radix select of the cut
   unit's key in the fill's own program, then an in-register sort of the at most ``R`` units
   the fill can take. Or the radix select ("radix", ``_RADIX_PASSES``): the same cut found by
   three launches spread over (row, chunk of units) programs, a fourth that compacts the
   winners (the units better than the cut, then those tied with it in index order), and in
   the fill an in-register sort of the better ones only (a small block when they fit); any
   number of units. Or ``torch.sort`` / ``torch.topk`` of the best ``min(U, R)`` keys before
   the launch, where every row ranks on every step;
2. zero a per-program scratch row of ``R`` "a unit starts here" flags;
3. walk the ranking in blocks, carrying the running token total and taken count: a block
   prefix sum of the ranked sizes gives each unit's ``[begin, end)`` in the budget; taken
   units (selectable, non-empty, ``begin < R``) are compacted into ``unit_ids`` by a prefix
   sum of the taken flags, their ``start - begin`` goes to a compact scratch row, and a flag
   marks ``begin``;
4. walk the ``R`` output positions in blocks: a prefix sum of the flags numbers the taken unit
   covering each position, so ``slot = order[clamp(p + start - begin)]`` needs no search.

Steps are separated by a block barrier (the scratch is written and read by different threads
of the program). Apart from the in-kernel sorts, registers stay bounded by the block sizes
whatever ``U`` and ``R`` are. No host syncs: shapes alone size the grids and the scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import graph_branch
from ..dispatch import implement, triton_runs_on
from . import score as _score  # noqa: F401  (registers ``unit_scores``, the selection's first stage)
from .pdl import pdl_kernel, wait_for_previous

# units / positions per block step and warps per program (H200, U=8192, R=2048, torch.sort
# ranking: the fill took ~30 us of ~110, the stable sort the rest; block size and warps
# barely mattered)
_BLOCK = 2048
_NUM_WARPS = 8
# How rows are ranked (H200, benchmarks/select_sort.py, 8 KV heads, R = 2048, us per call at
# batch 1 / 4, 2026-12-02: 2,048 units from docs/bench/session7/sortbench_call2.log, the rest
# from sortbench.log, the later call, which printed the topk column; the radix column is not
# measured on GPU yet):
#
#   units  take   full tl.sort   threshold   torch.sort   topk        radix
#   2048   all        33 / 34     71 / 73      36 / 38       -        not measured
#   2048   none       12 / 18     22 / 18      28 / 31       -        not measured
#   8192   all       225 / 226   165 / 165    101 / 111   117 / 119   not measured
#   8192   none       12 / 11     13 / 11      76 / 88    110 / 110   not measured
#   32768  all          -        616 / 617    182 / 248   125 / 150   not measured
#   32768  none         -         12 / 12      90 / 145   114 / 136   not measured
#
# A row that keeps its selection skips every in-kernel ranking, where torch.sort and topk rank
# every row every step; the radix select still launches a memset and four kernels whose programs
# exit at once (each costs a launch in a replayed graph), the full sort and the threshold select
# none. With ``take`` (triggers that keep selections) in a step captured inline the full sort was
# chosen up to 8,192 units for that, the threshold select above it. Without ``take``, or inside a
# CUDA graph conditional node's body (``graph_branch``: it runs only on steps where some row
# re-selects), the full sort up to 2,048 units and torch.topk above it, where a re-selecting row
# was fastest: at 4 x 128K (8,200 units a row, 32 rows) louiskv's every-step row took 18.07 ms
# with topk against 19.15 with torch.sort, interval(9) 8.83 against 8.94
# (docs/bench/session7/e2e_topk_128k4.log against e2e_compiled.log), though at exactly 8,192
# units in isolation torch.sort is 8-16 us faster; at 32,768 topk is 57-98 us faster.
# The radix select replaces topk and the threshold select in the table below on the expectation
# that it ranks a re-selecting row faster than both (it reads each unit four times over many
# programs and sorts only the ~R / (tokens per unit) winners); until measured that is a guess:
# the table is the whole rule, change it from the radix column.
#
# "auto", one table: the first row whose unit limit holds (None: any number) gives the ranking,
# with take in a step captured inline / without take or inside a conditional node's body
AUTO_RANKING = (
    # units up to   with take inline   without take or in a conditional body
    (2048, "full", "full"),
    (8192, "full", "radix"),
    (None, "radix", "radix"),
)
# units per block step of the threshold select's passes (a [block, 16] digit histogram each)
_THRESHOLD_BLOCK = 512
# "auto" (the rule above) or forced for every call (the tests, benchmarks/select_sort.py):
# "full", "threshold", "torch.sort", "topk" (torch.topk of the best min(U, R) unique int64 keys)
# or "radix"
RANKING = "auto"
RANKINGS = ("full", "threshold", "torch.sort", "topk", "radix")
# warps for the in-kernel sort of more than 4096 keys
_SORT_NUM_WARPS = 16
# the radix select: units per program of its launches, warps per program, and the block that
# sorts the winners better than the cut when they fit (the full min(U, R) block otherwise)
_RADIX_CHUNK = 1024
_RADIX_NUM_WARPS = 4
_RADIX_SMALL_SORT = 256
# a middle block for winners past the small one (K-means units: ~760-1,270 at R = 2,048), so that
# fewer than 1,024 of them are not sorted in the whole min(U, R) block
_RADIX_MID_SORT = 1024  # (0: none)
# The radix select's winners (the units better than the cut) are sorted in the fill's program. With
# K-means units of random keys they are mostly 1-3-token clusters (a few-token mean scores further
# from 0): ~760-1,270 of them at R = 2,048, past the small sort block. A launch that ranked them over
# (row, block of 128 winners) programs by counting smaller keys measured slower on the H200 (whole
# op, us, sort / rank: 4 x 8,200 units 47.0 / 50.5 with 127 winners, 64.1 / 72.4 with 761;
# 1 x 32,800: 51.2 / 53.9 and 69.6 / 79.5; docs/bench/session11/louis/fill_variants.log), as did the
# output positions as a second launch (140-152 against 45-51; session11/fill/fill_variants.log).


def auto_ranking(units: int, take_inline: bool) -> str:
    """The ranking "auto" picks for ``units`` units a row, from ``AUTO_RANKING``."""
    for limit, with_take, without_take in AUTO_RANKING:
        if limit is None or units <= limit:
            return with_take if take_inline else without_take
    raise ValueError(f"triton select_budget: AUTO_RANKING has no row for {units} units (end it with None)")


@triton.jit
def _descending_key(score, index, in_range):
    """int64 keys whose ascending order is a stable descending sort of the selectable scores."""
    # -0.0 and 0.0 compare equal (a comparison sort keeps them in index order): one bit pattern
    canonical = tl.where(score == 0.0, 0.0, score)
    bits = canonical.to(tl.int32, bitcast=True)
    # flip the magnitude bits of negative floats: signed int order is then float order...
    ascending = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # ...and its complement is the reverse order; the unselectable (-inf, NaN) sort after
    # every selectable score, +inf included
    descending = tl.where(score > float("-inf"), ~ascending, 0x7FFFFFFF)
    key = (descending.to(tl.int64) << 32) | index.to(tl.int64)
    return tl.where(in_range, key, 0x7FFFFFFFFFFFFFFF)


@pdl_kernel
@triton.jit
def _keys_kernel(scores_ptr, sizes_ptr, keys_ptr, U, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``keys[row, u]`` = ``_descending_key`` of unit ``u`` (for the "topk" ranking); an empty
    unit ranks with the unselectable, so the best ``R`` keys hold every unit the fill takes."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = index < U
    score = tl.load(scores_ptr + row * U + index, mask=in_range, other=float("-inf"))
    size = tl.load(sizes_ptr + row * U + index, mask=in_range, other=0)
    score = tl.where(size > 0, score, float("-inf"))
    tl.store(keys_ptr + row * U + index, _descending_key(score, index, in_range), mask=in_range)


@triton.jit
def _rank_row(scores_ptr, ranked_ptr, U, SORT_BLOCK: tl.constexpr):
    """``ranked[k]``: the unit ranked ``k``-th (stable descending score), -1 if unselectable."""
    index = tl.arange(0, SORT_BLOCK)
    in_range = index < U
    score = tl.load(scores_ptr + index, mask=in_range, other=float("-inf"))
    key = tl.sort(_descending_key(score, index, in_range))
    # high word: the unselectable have 0x7FFFFFFF; low word: the unit index
    unit = tl.where((key >> 32).to(tl.int32) < 0x7FFFFFFF, key.to(tl.int32), -1)
    tl.store(ranked_ptr + index, unit, mask=in_range)


@triton.jit
def _live_block(scores_ptr, sizes_ptr, u0, U, BLOCK: tl.constexpr):
    """One block of units for the threshold select: their indices, token counts, whether each
    is non-empty and selectable, the signed ``_descending_key`` and its high word (the score's)."""
    index = u0 + tl.arange(0, BLOCK)
    in_range = index < U
    score = tl.load(scores_ptr + index, mask=in_range, other=float("-inf"))
    size = tl.load(sizes_ptr + index, mask=in_range, other=0).to(tl.int32)  # a row holds < 2**31 tokens
    live = in_range & (score > float("-inf")) & (size > 0)
    signed = _descending_key(score, index, in_range)
    return size, live, signed, (signed >> 32).to(tl.int32)


@triton.jit
def _threshold_rank(scores_ptr, sizes_ptr, cand_ptr, ranked_ptr, U, R,
                    BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr):
    """``ranked[k]``, ``k < CAND_BLOCK``: the units the fill can take, in rank order, then -1.

    The taken units are a prefix of the ranking ending at the unit whose tokens reach ``R``
    (the cut unit). A radix select finds the cut unit's score key (the high word of
    ``_descending_key``) 4 bits at a time: each pass histograms, by the next digit, the tokens
    of the non-empty selectable units that match the digits found so far, and keeps the digit
    whose bucket holds the ``R``-th token. The units that score strictly better than the cut
    (fewer than ``R``, they hold fewer than ``R`` tokens) are compacted first, then the units
    tied with it in index order (the fill can take at most ``R`` less the tokens before them),
    and the at most ``CAND_BLOCK`` candidates are sorted in registers by the whole key (score,
    then index). Work grows with ``U`` linearly, without a sort of ``U`` keys; empty and
    unselectable units cover no tokens and are left out.
    """
    # score keys with the sign bit flipped read as unsigned in score order; digits are taken
    # most significant first, so a digit is (key >> shift) & 15 whatever the sign extension
    flip = tl.full([], -2147483648, tl.int32)
    digits = tl.arange(0, 16)
    prefix = tl.full([], 0, tl.int32)
    mask = tl.full([], 0, tl.int32)
    before = tl.full([], 0, tl.int32)  # tokens of units in buckets below the current one
    everything = tl.full([], 0, tl.int1)
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        # per-lane partial histograms, summed once per pass (a reduction per block costs more
        # than the block's arithmetic)
        partial = tl.zeros([BLOCK, 16], tl.int32)
        for u0 in range(0, U, BLOCK):
            size, live, _, high = _live_block(scores_ptr, sizes_ptr, u0, U, BLOCK)
            key = high ^ flip
            match = (live & ((key & mask) == prefix)) != 0  # (!= 0: the interpreter may give an int32 mask)
            digit = (key >> shift) & 15
            weight = tl.where(match, size, 0)
            partial += tl.where(digit[:, None] == digits[None, :], weight[:, None], 0)
        inclusive = tl.cumsum(tl.sum(partial, axis=0), 0) + before
        if level == 0:
            everything = (tl.max(inclusive, 0) < R).to(tl.int1)  # fewer tokens than the budget: take every unit
        chosen = tl.sum((inclusive < R).to(tl.int32), 0)  # the bucket holding the R-th token
        chosen = tl.minimum(chosen, 15)
        before = tl.max(tl.where(digits < chosen, inclusive, before), 0)
        prefix = prefix | (chosen << shift)
        mask = mask | (tl.full([], 15, tl.int32) << shift)
    cut = prefix ^ flip  # the cut unit's score key, signed again

    # compact the candidates: strictly better than the cut (every live unit if they all fit),
    # then those tied with it in index order, then sort them
    count = tl.full([], 0, tl.int32)
    for u0 in range(0, U, BLOCK):
        _, live, signed, high = _live_block(scores_ptr, sizes_ptr, u0, U, BLOCK)
        keep = (live & ((high < cut) | (everything != 0))) != 0
        position = tl.cumsum(keep.to(tl.int32), 0) + count - 1
        tl.store(cand_ptr + position, signed, mask=keep & (position < CAND_BLOCK))
        count += tl.sum(keep.to(tl.int32), 0)
    if everything == 0:
        for u0 in range(0, U, BLOCK):
            _, live, signed, high = _live_block(scores_ptr, sizes_ptr, u0, U, BLOCK)
            keep = (live & (high == cut)) != 0
            position = tl.cumsum(keep.to(tl.int32), 0) + count - 1
            tl.store(cand_ptr + position, signed, mask=keep & (position < CAND_BLOCK))
            count += tl.sum(keep.to(tl.int32), 0)
    tl.debug_barrier()
    slot = tl.arange(0, CAND_BLOCK)
    keys = tl.load(cand_ptr + slot, mask=slot < count, other=0x7FFFFFFFFFFFFFFF)
    keys = tl.sort(keys)
    unit = tl.where(slot < count, keys.to(tl.int32), -1)
    tl.store(ranked_ptr + slot, unit)


# ---- the radix ranking: each row spread over programs of ``_RADIX_CHUNK`` units -----------
#
# The cut unit's score word (the high word of ``_descending_key``, its sign bit flipped so that
# it reads as unsigned in rank order) is found 12, 12 then 8 bits at a time. Each pass is one
# launch over (row, chunk) programs that add the tokens of their matching non-empty selectable
# units to the row's histogram of the pass's digit by atomics (integer sums: the result does
# not depend on their order); every program of the next launch scans that histogram to pick the
# digit whose bucket holds the R-th token (a redundant 4,096-bin scan instead of a launch).
# (shift, bins, offset of the histogram in the row's scratch line) per pass:
_RADIX_PASSES = ((20, 4096, 0), (8, 4096, 4096), (0, 256, 8192))
# then in the line: the count of units compacted as better than the cut (an atomic counter),
# and per chunk the last pass's histogram in units rather than tokens, from which a chunk learns
# how many units tied with the cut precede it
_RADIX_COUNTER = tl.constexpr(8448)
_RADIX_TIES = tl.constexpr(8449)
@triton.jit
def _radix_units(scores_ptr, sizes_ptr, row, chunk, U, CHUNK: tl.constexpr):
    """One chunk of a row: unit indices, token counts, live (non-empty and selectable), the
    signed ``_descending_key``, its high word and the high word as an unsigned rank-order key."""
    size, live, signed, high = _live_block(scores_ptr + row * U, sizes_ptr + row * U, chunk * CHUNK, U, CHUNK)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    return index, size, live, signed, high, high ^ tl.full([], -2147483648, tl.int32)


@triton.jit
def _radix_digit(hist_ptr, before, R, BINS: tl.constexpr):
    """The bucket holding the R-th token: (its digit, the tokens of the buckets before it plus
    ``before``, the tokens of all buckets plus ``before``); the last bucket if none reaches R."""
    bins = tl.arange(0, BINS)
    inclusive = tl.cumsum(tl.load(hist_ptr + bins), 0) + before
    chosen = tl.minimum(tl.sum((inclusive < R).to(tl.int32), 0), BINS - 1)
    return chosen, tl.max(tl.where(bins < chosen, inclusive, before), 0), tl.max(inclusive, 0)


@pdl_kernel
@triton.jit
def _radix_hist_kernel(scores_ptr, sizes_ptr, take_ptr, scratch_ptr, state_ptr,
                       U, R, ROWS_PER_SEQUENCE, SCRATCH_LEN, LEVEL: tl.constexpr,
                       SHIFT: tl.constexpr, BINS: tl.constexpr, HIST: tl.constexpr,
                       PREV_SHIFT: tl.constexpr, PREV_BINS: tl.constexpr, PREV_HIST: tl.constexpr,
                       HAS_TAKE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Pass ``LEVEL`` (0, 1, 2; its digit is ``(key >> SHIFT) % BINS``): the previous pass's
    digit from its histogram (at ``PREV_HIST`` in the row's scratch line), then this pass's.

    ``state[row, level]`` = (the digits found through ``level``, the tokens of the units ranked
    before their bucket, whether the row holds fewer than R tokens); written by chunk 0 only,
    one slot per level, so that no program reads a slot another one is writing.
    """
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if HAS_TAKE:  # noqa: SIM102
        if tl.load(take_ptr + row // ROWS_PER_SEQUENCE) == 0:
            return
    line = scratch_ptr + row * SCRATCH_LEN
    prefix = tl.full([], 0, tl.int32)
    known = tl.full([], 0, tl.int32)  # the bits of the key the digits found so far fix
    if LEVEL > 0:
        before = tl.full([], 0, tl.int32)
        if LEVEL > 1:
            prefix = tl.load(state_ptr + row * 12 + 4 * (LEVEL - 2))
            before = tl.load(state_ptr + row * 12 + 4 * (LEVEL - 2) + 1)
        chosen, before, total = _radix_digit(line + PREV_HIST, before, R, PREV_BINS)
        if LEVEL == 1:
            everything = (total < R).to(tl.int32)  # fewer tokens than the budget: every live unit is taken
        else:
            everything = tl.load(state_ptr + row * 12 + 4 * (LEVEL - 2) + 2)
        prefix = prefix | (chosen << PREV_SHIFT)
        known = tl.full([], -(1 << PREV_SHIFT), tl.int32)
        if chunk == 0:
            tl.store(state_ptr + row * 12 + 4 * (LEVEL - 1), prefix)
            tl.store(state_ptr + row * 12 + 4 * (LEVEL - 1) + 1, before)
            tl.store(state_ptr + row * 12 + 4 * (LEVEL - 1) + 2, everything)
        if everything != 0:  # no cut to find
            return
    _, size, live, _, _, key = _radix_units(scores_ptr, sizes_ptr, row, chunk, U, CHUNK)
    match = (live & ((key & known) == prefix)) != 0  # (!= 0: the interpreter may give an int32 mask)
    digit = (key >> SHIFT) & (BINS - 1)
    tl.atomic_add(line + HIST + digit, size, mask=match)
    if LEVEL == 2:
        tl.atomic_add(line + _RADIX_TIES + chunk * BINS + digit, tl.full([CHUNK], 1, tl.int32), mask=match)


@pdl_kernel
@triton.jit
def _radix_compact_kernel(scores_ptr, sizes_ptr, take_ptr, scratch_ptr, state_ptr, better_ptr, tied_ptr,
                          unit_ids_ptr, U, R, ROWS_PER_SEQUENCE, CHUNKS, SCRATCH_LEN,
                          LAST_SHIFT: tl.constexpr, LAST_BINS: tl.constexpr, LAST_HIST: tl.constexpr,
                          HAS_TAKE: tl.constexpr, CHUNK: tl.constexpr, CAND_BLOCK: tl.constexpr,
                          CHUNKS_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The last digit, then the winners: the keys of the units strictly better than the cut
    (all taken; fewer than R tokens) at atomic positions, their order restored later by a sort,
    and the units tied with the cut at their index order's positions (the fill takes the first
    of them), counted over the earlier chunks from the last pass's per-chunk histograms. Also
    the row's ``unit_ids`` to -1 (the fill writes the taken prefix afterwards)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if HAS_TAKE:  # noqa: SIM102
        if tl.load(take_ptr + row // ROWS_PER_SEQUENCE) == 0:
            return
    line = scratch_ptr + row * SCRATCH_LEN
    prefix = tl.load(state_ptr + row * 12 + 4)
    before = tl.load(state_ptr + row * 12 + 5)
    everything = tl.load(state_ptr + row * 12 + 6)
    chosen, before, _ = _radix_digit(line + LAST_HIST, before, R, LAST_BINS)
    cut = (prefix | (chosen << LAST_SHIFT)) ^ tl.full([], -2147483648, tl.int32)  # the cut's score word, signed
    chunks = tl.arange(0, CHUNKS_BLOCK)
    tied_per_chunk = tl.load(line + _RADIX_TIES + chunks * LAST_BINS + chosen, mask=chunks < CHUNKS, other=0)
    tied_before = tl.sum(tl.where(chunks < chunk, tied_per_chunk, 0), 0)
    if chunk == 0:
        tl.store(state_ptr + row * 12 + 8, tl.where(everything != 0, 0, tl.sum(tied_per_chunk, 0)))
    index, _, live, signed, high, _ = _radix_units(scores_ptr, sizes_ptr, row, chunk, U, CHUNK)
    better = (live & ((high < cut) | (everything != 0))) != 0
    tied = (live & (high == cut) & (everything == 0)) != 0
    start = tl.atomic_add(line + _RADIX_COUNTER, tl.sum(better.to(tl.int32), 0))
    position = start + tl.cumsum(better.to(tl.int32), 0) - 1
    tl.store(better_ptr + row * CAND_BLOCK + position, signed, mask=better & (position < CAND_BLOCK))
    position = tied_before + tl.cumsum(tied.to(tl.int32), 0) - 1
    tl.store(tied_ptr + row * CAND_BLOCK + position, index, mask=tied & (position < CAND_BLOCK))
    tl.store(unit_ids_ptr + row * U + index, tl.full([CHUNK], -1, tl.int64), mask=index < U)


@triton.jit
def _radix_order(better_ptr, tied_ptr, counter_ptr, tied_count_ptr, ranked_ptr,
                 CAND_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr, MID_SORT: tl.constexpr,
                 BLOCK: tl.constexpr):
    """``ranked``: the better units sorted by key (in the smallest of the ``SMALL_SORT``,
    ``MID_SORT`` and ``CAND_BLOCK`` blocks they fit), then the tied ones in index order; returns
    their count."""
    better = tl.load(counter_ptr)
    # each branch keeps its own names: compiled Triton merges a name bound in both branches,
    # which fails for blocks of two shapes (the interpreter does not check)
    if better <= SMALL_SORT:
        small = tl.arange(0, SMALL_SORT)
        small_keys = tl.sort(tl.load(better_ptr + small, mask=small < better, other=0x7FFFFFFFFFFFFFFF))
        tl.store(ranked_ptr + small, small_keys.to(tl.int32), mask=small < better)
    elif better <= MID_SORT:
        mid = tl.arange(0, MID_SORT)
        mid_keys = tl.sort(tl.load(better_ptr + mid, mask=mid < better, other=0x7FFFFFFFFFFFFFFF))
        tl.store(ranked_ptr + mid, mid_keys.to(tl.int32), mask=mid < better)
    else:
        whole = tl.arange(0, CAND_BLOCK)
        whole_keys = tl.sort(tl.load(better_ptr + whole, mask=whole < better, other=0x7FFFFFFFFFFFFFFF))
        tl.store(ranked_ptr + whole, whole_keys.to(tl.int32), mask=whole < better)
    tied = tl.minimum(tl.load(tied_count_ptr), CAND_BLOCK - better)
    for t0 in range(0, tied, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tl.store(ranked_ptr + better + t, tl.load(tied_ptr + t, mask=t < tied), mask=t < tied)
    return better + tied


@pdl_kernel
@triton.jit
def _fill_kernel(
    scores_ptr, ranked_ptr, ranked_scores_ptr, sizes_ptr, starts_ptr, order_ptr, take_ptr,
    unit_ids_ptr, num_units_ptr, slots_ptr, slot_valid_ptr,
    heads_ptr, shift_ptr, cand_ptr, tied_ptr, radix_line_ptr, radix_state_ptr,
    U, N, R, SHIFT_LEN, ROWS_PER_SEQUENCE, RANKED_KEYS, RADIX_LINE,
    BLOCK_U: tl.constexpr, BLOCK_R: tl.constexpr, SORT_BLOCK: tl.constexpr, HAS_TAKE: tl.constexpr,
    CAND_BLOCK: tl.constexpr, RADIX: tl.constexpr, SMALL_SORT: tl.constexpr, MID_SORT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    bh = tl.program_id(0).to(tl.int64)
    u_base = bh * U
    r_base = bh * R
    zero = bh * 0  # an int64 scalar, for loop-carried totals

    # 0. a sequence that does not re-select: an empty selection, nothing read
    # (nested: take_ptr is None when HAS_TAKE is off, so it must not be loaded at all)
    if HAS_TAKE:  # noqa: SIM102
        if tl.load(take_ptr + bh // ROWS_PER_SEQUENCE) == 0:
            for r0 in range(0, R, BLOCK_R):
                p = r0 + tl.arange(0, BLOCK_R)
                tl.store(slots_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=slots_ptr.dtype.element_ty), mask=p < R)
                tl.store(slot_valid_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=tl.int1), mask=p < R)
            for u0 in range(0, U, BLOCK_U):
                i = u0 + tl.arange(0, BLOCK_U)
                tl.store(unit_ids_ptr + u_base + i, tl.full([BLOCK_U], -1, dtype=tl.int64), mask=i < U)
            tl.store(num_units_ptr + bh, zero)
            return

    # 1. rank in the kernel: ranked unit ids to the scratch row, -1 for the unselectable; or
    # (CAND_BLOCK) only the units the fill can take, by a threshold select, or (RADIX) ordered
    # from the winners the radix launches compacted
    if SORT_BLOCK > 0:
        _rank_row(scores_ptr + u_base, ranked_ptr + u_base, U, SORT_BLOCK)
    ranked_base = bh * CAND_BLOCK if CAND_BLOCK > 0 else u_base
    ranked_len = CAND_BLOCK if CAND_BLOCK > 0 else U
    if CAND_BLOCK > 0:
        if RADIX:
            ranked_len = _radix_order(cand_ptr + bh * CAND_BLOCK, tied_ptr + bh * CAND_BLOCK,
                                      radix_line_ptr + bh * RADIX_LINE + _RADIX_COUNTER, radix_state_ptr + bh * 12 + 8,
                                      ranked_ptr + bh * CAND_BLOCK, CAND_BLOCK, SMALL_SORT, MID_SORT, BLOCK_U)
        else:
            _threshold_rank(scores_ptr + u_base, sizes_ptr + u_base, cand_ptr + bh * CAND_BLOCK,
                            ranked_ptr + bh * CAND_BLOCK, U, R, BLOCK_U, CAND_BLOCK)
    if RANKED_KEYS > 0:  # "topk": the best RANKED_KEYS keys of the row, ascending
        ranked_base = bh * RANKED_KEYS
        ranked_len = RANKED_KEYS

    # 2. no unit starts anywhere yet
    for r0 in range(0, R, BLOCK_R):
        p = r0 + tl.arange(0, BLOCK_R)
        tl.store(heads_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=tl.int8), mask=p < R)
    tl.debug_barrier()

    # 3. units in score order
    total = zero  # tokens of all selectable units so far (not capped at R, like the reference)
    count = zero  # units taken so far
    for u0 in range(0, ranked_len, BLOCK_U):
        i = u0 + tl.arange(0, BLOCK_U)
        in_range = i < ranked_len
        if SORT_BLOCK > 0 or CAND_BLOCK > 0:
            unit = tl.load(ranked_ptr + ranked_base + i, mask=in_range, other=-1).to(tl.int64)
            selectable = unit >= 0
        elif RANKED_KEYS > 0:
            # high word 0x7FFFFFFF: unselectable (or past the row); low word: the unit index
            key = tl.load(ranked_ptr + ranked_base + i, mask=in_range, other=0x7FFFFFFFFFFFFFFF)
            selectable = (key >> 32).to(tl.int32) < 0x7FFFFFFF
            unit = tl.where(selectable, key & 0xFFFFFFFF, 0)
        else:
            unit = tl.load(ranked_ptr + u_base + i, mask=in_range, other=0)
            score = tl.load(ranked_scores_ptr + u_base + i, mask=in_range, other=float("-inf"))
            selectable = in_range & (score > float("-inf"))  # NaN is not selectable either
        size = tl.load(sizes_ptr + u_base + unit, mask=selectable, other=0).to(tl.int64)
        start = tl.load(starts_ptr + u_base + unit, mask=selectable, other=0).to(tl.int64)
        end = tl.cumsum(size, 0) + total
        begin = end - size
        taken = selectable & (size > 0) & (begin < R)
        taken_i = taken.to(tl.int64)
        position = tl.cumsum(taken_i, 0) + count - 1
        tl.store(unit_ids_ptr + u_base + position, unit, mask=taken)
        tl.store(shift_ptr + bh * SHIFT_LEN + position, start - begin, mask=taken)
        tl.store(heads_ptr + r_base + begin, tl.full([BLOCK_U], 1, dtype=tl.int8), mask=taken)
        total += tl.sum(size, 0)
        count += tl.sum(taken_i, 0)
    # the rest of unit_ids is -1 (disjoint from the compacted writes, so no barrier; the radix
    # compaction's launch wrote -1 to the whole row already, over many programs)
    if not RADIX:
        for u0 in range((count // BLOCK_U) * BLOCK_U, U, BLOCK_U):
            i = u0 + tl.arange(0, BLOCK_U)
            tl.store(unit_ids_ptr + u_base + i, tl.full([BLOCK_U], -1, dtype=tl.int64), mask=(i >= count) & (i < U))
    tl.store(num_units_ptr + bh, count)
    tl.debug_barrier()

    # 4. output positions: the k-th flag at or before p is the taken unit covering p
    seen = zero
    for r0 in range(0, R, BLOCK_R):
        p = r0 + tl.arange(0, BLOCK_R)
        in_range = p < R
        head = tl.load(heads_ptr + r_base + p, mask=in_range, other=0).to(tl.int64)
        which = tl.cumsum(head, 0) + seen - 1
        valid = in_range & (p < total)
        shift = tl.load(shift_ptr + bh * SHIFT_LEN + which, mask=valid, other=0)
        index = tl.minimum(tl.maximum(p + shift, 0), N - 1)
        slot = tl.load(order_ptr + bh * N + index, mask=valid, other=0)
        tl.store(slots_ptr + r_base + p, slot, mask=in_range)
        tl.store(slot_valid_ptr + r_base + p, valid, mask=in_range)
        seen += tl.sum(head, 0)


@implement("triton", "select_budget", supports=triton_runs_on)
def select_budget(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    starts: torch.Tensor,
    order: torch.Tensor,
    capacity: int,
    take: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill a token budget with the best-scoring units; see ``reference.select_budget``.

    Rows of sequences with ``take[b]`` False get an empty selection (slots 0, ``slot_valid``
    False, ``num_units`` 0, ``unit_ids`` -1) without being ranked or filled. Without ``take``
    every row is ranked and filled.
    """
    *lead, units = scores.shape
    device = scores.device
    capacity = int(capacity)
    unit_ids = torch.empty(*lead, units, dtype=torch.long, device=device)
    num_units = torch.empty(*lead, dtype=torch.long, device=device)
    slots = torch.empty(*lead, capacity, dtype=order.dtype, device=device)
    slot_valid = torch.empty(*lead, capacity, dtype=torch.bool, device=device)
    programs = scores.numel() // units if units else 0
    if programs == 0:
        num_units.zero_()
        slots.zero_()
        slot_valid.zero_()
        return unit_ids, num_units, slots, slot_valid
    rows_per_sequence = 1
    if take is not None:
        batch = lead[0] if lead else 1
        if take.numel() != batch:
            raise ValueError(f"triton select_budget: take has {take.numel()} entries for {batch} sequences")
        take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
        rows_per_sequence = programs // batch
    scores = scores.contiguous()
    sort_block = cand_block = 0
    cand = tied = radix_line = radix_state = scores  # not read unless the threshold or radix select runs
    radix_line_len = 0
    ranking = RANKING
    if ranking == "auto":
        # in a conditional node's body the step re-selects somewhere: no row is ranked for nothing
        # on a reusing step, so the fastest ranking of a re-selecting row wins (as without take)
        ranking = auto_ranking(units, take is not None and not graph_branch.in_conditional_body())
    if ranking not in RANKINGS:
        raise ValueError(f"triton select_budget: RANKING {RANKING!r}; accepted: auto, {', '.join(RANKINGS)}")
    ranked_keys = 0
    if ranking == "torch.sort":
        ranked_scores, ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    elif ranking == "topk":
        # the best min(U, R) units: every taken unit holds a token, so the fill never needs more.
        # Unique int64 keys (score, then index) make torch.topk's order the stable one
        keys = torch.empty(programs, units, dtype=torch.int64, device=device)
        _keys_kernel[(programs, triton.cdiv(units, 1024))](scores, sizes.contiguous(), keys, units, BLOCK=1024)
        ranked_keys = max(1, min(units, capacity))  # one at a budget of 0: RANKED_KEYS 0 means another ranking
        ranked = torch.topk(keys, ranked_keys, dim=-1, largest=False, sorted=True).values
        ranked_scores = scores  # not read
    elif ranking == "full":
        # in-kernel ranking of every unit: the ranked unit ids (int32) go to a scratch row
        sort_block = triton.next_power_of_2(units)
        ranked = torch.empty(programs, units, dtype=torch.int32, device=device)
        ranked_scores = scores  # not read
    else:
        # threshold or radix select: only the (at most R) units the fill can take are ranked
        cand_block = triton.next_power_of_2(max(1, min(units, capacity)))
        ranked = torch.empty(programs, cand_block, dtype=torch.int32, device=device)
        cand = torch.empty(programs, cand_block, dtype=torch.long, device=device)
        ranked_scores = scores  # not read
        if ranking == "radix":
            sizes = sizes.contiguous()
            cand, tied, radix_line, radix_state = _radix_select(scores, sizes, take, capacity, rows_per_sequence,
                                                                cand_block, unit_ids)
            radix_line_len = radix_line.shape[-1]
    # scratch: per program, R flags and one shift per taken unit (at most min(U, R) of them)
    heads = torch.empty(programs, capacity, dtype=torch.int8, device=device)
    shift_len = max(1, min(units, capacity))
    shift = torch.empty(programs, shift_len, dtype=torch.long, device=device)
    small_sort = min(_RADIX_SMALL_SORT, cand_block) if cand_block else 1
    _fill_kernel[(programs,)](
        scores, ranked, ranked_scores, sizes.contiguous(), starts.contiguous(), order.contiguous(), take,
        unit_ids, num_units, slots, slot_valid,
        heads, shift, cand, tied, radix_line, radix_state,
        units, order.shape[-1], capacity, shift_len, rows_per_sequence, ranked_keys, radix_line_len,
        BLOCK_U=min(_THRESHOLD_BLOCK if ranking == "threshold" else _BLOCK, triton.next_power_of_2(units)),
        BLOCK_R=min(_BLOCK, triton.next_power_of_2(max(capacity, 1))),
        SORT_BLOCK=sort_block, HAS_TAKE=take is not None, CAND_BLOCK=cand_block,
        RADIX=ranking == "radix", SMALL_SORT=small_sort, MID_SORT=max(small_sort, min(_RADIX_MID_SORT, cand_block)),
        num_warps=_SORT_NUM_WARPS if max(sort_block, cand_block) > 4096 else _NUM_WARPS,
    )
    return unit_ids, num_units, slots, slot_valid


def _radix_select(scores, sizes, take, capacity, rows_per_sequence, cand_block, unit_ids):
    """The radix select's launches, before the fill (which reads their results): returns (the
    keys of the units better than the cut, the units tied with it, the scratch lines, the
    per-row state); per row, the line's ``_RADIX_COUNTER`` entry counts the better units and
    ``state[:, 8]`` the tied ones. ``unit_ids`` of the rows in ``take`` become -1."""
    programs, units = scores.numel() // scores.shape[-1], scores.shape[-1]
    device = scores.device
    chunk = min(_RADIX_CHUNK, triton.next_power_of_2(units))
    chunks = triton.cdiv(units, chunk)
    last_shift, last_bins, last_hist = _RADIX_PASSES[-1]
    line_len = _RADIX_TIES.value + chunks * last_bins
    # histograms and counters start at zero (one memset); the per-row state (3 passes x 4 int32),
    # the better keys and the tied units are written before they are read
    line = torch.zeros(programs, line_len, dtype=torch.int32, device=device)
    state = torch.empty(programs, 12, dtype=torch.int32, device=device)
    better = torch.empty(programs, cand_block, dtype=torch.long, device=device)
    tied = torch.empty(programs, cand_block, dtype=torch.int32, device=device)
    for level, (bit_shift, bins, hist) in enumerate(_RADIX_PASSES):
        prev_shift, prev_bins, prev_hist = _RADIX_PASSES[level - 1] if level else (0, 1, 0)
        _radix_hist_kernel[(programs, chunks)](
            scores, sizes, take, line, state,
            units, capacity, rows_per_sequence, line_len, LEVEL=level,
            SHIFT=bit_shift, BINS=bins, HIST=hist, PREV_SHIFT=prev_shift, PREV_BINS=prev_bins,
            PREV_HIST=prev_hist, HAS_TAKE=take is not None, CHUNK=chunk, num_warps=_RADIX_NUM_WARPS,
        )
    _radix_compact_kernel[(programs, chunks)](
        scores, sizes, take, line, state, better, tied, unit_ids,
        units, capacity, rows_per_sequence, chunks, line_len,
        LAST_SHIFT=last_shift, LAST_BINS=last_bins, LAST_HIST=last_hist, HAS_TAKE=take is not None,
        CHUNK=chunk, CAND_BLOCK=cand_block, CHUNKS_BLOCK=triton.next_power_of_2(chunks),
        num_warps=_RADIX_NUM_WARPS,
    )
    return better, tied, line, state
