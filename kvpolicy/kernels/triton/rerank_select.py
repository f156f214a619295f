"""Triton rerank and final selection (op ``rerank_select``): the candidates' 4-bit estimates,
their exact top-k and the buffer-first composition of the ``Selection``, in four launches.

Replaces ``rerank`` (its score kernel, then ``torch.topk``, a gather, a where and a pad) and the
selector's composition (about fifteen small torch ops). The top-k is a radix select on the
scores' bits: a float32 score maps to an int32 key that orders as the score does (negative
scores flip their magnitude bits; -0.0 is made +0.0 first), and the ``k`` best are every key
above a threshold key plus the first keys by position equal to it. The threshold is found
10 + 11 + 11 bits at a time:

1. ``_score_kernel``, one program per (row, chunk of candidates): reads each listed
   candidate's packed codes (``D / 2`` bytes; the only pass over them), weight and norm, writes
   its key (4 bytes) and the chunk's histogram of the keys' top 10 bits (bin 0: not listed).
2. ``_threshold_kernel``, one program per row: ``k = R - buffered`` from the device counters,
   the bin holding the ``k``-th key, and per chunk where its keys above that bin and its keys in
   it start (prefix sums of the chunks' histograms).
3. ``_split_kernel``, one program per (row, chunk): reads the keys again and writes those above
   the bin to the row's "above" list and those in it to its "tied" list, both in position order,
   each entry with the count of the other list's entries before it.
4. ``_finish_kernel``, one program per row: resolves the tied list (the next 11 bits, then the
   last 11, as histograms; then equal keys by position), writes each chosen candidate at its
   place in position order (its rank in its list plus the other list's entries before it), then
   the update buffer's rows, the -1 tail and the row's count.

Per candidate and step: its codes, weight and norm once, its position twice (8 bytes each),
its key written and read once (4 + 4 bytes); the threshold bin's tied entries (typically a few %
of the candidates) 16 bytes each, read three times more.

The chosen set and layout are ``reference_analytic.rerank_select``'s, up to float rounding of
the scores (a sum in another order): a candidate whose score is within about 1e-6 (relative)
of the k-th best may be swapped with one at the threshold (the tests allow 1e-5). Exact ties
(equal float32 scores) go to the lower position in both.

A query per head of the group (``rerank="head_softmax"``, ``(B, H, G, D)``): a head's softmax needs
every candidate's estimate before any key, so ``head_softmax.py``'s two launches replace the score
pass (the codes still read once, for all the heads), writing the same keys and first histogram;
every method's later passes are unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...analytic import nibble_values
from ..dispatch import OPS, implement, triton_runs_on
from .. import reference_analytic
from . import head_softmax, scratch
from .pdl import pdl_kernel, wait_for_previous

# candidates per program of the score and split passes (at most; SUB per step inside one):
# about _CHUNKS_PER_ROW programs a row, so 32 rows (4 x 8 heads) fill the GPU at 128K (13K
# candidates a row, chunks of 512) as at 1M (105K, chunks of 4,096), while the threshold pass
# reads at most that many histograms a row
_CHUNK = 4096
_CHUNKS_PER_ROW = 32
# candidates per step: the score pass holds SUB x D / 2 code bytes (as int32) and their values
# in registers (8 KiB of codes at D=128, as the old rerank's blocks); the split pass 4 bytes each
_SCORE_SUB = 128
_SPLIT_SUB = 1024
# chunks per step of the threshold pass (a step holds _CHUNK_BLOCK x 1024 counts)
_CHUNK_BLOCK = 8
# entries per step of the finish pass over the tied and above lists and the output rows
_BLOCK = 2048
# the key's bits per radix level: the top 10 (histogrammed per chunk), then 11 and 11
_BINS1 = 1024
_BINS2 = 4096  # 2048 values + 1 (bin 0: not in the level), rounded up to a power of two


@pdl_kernel
@triton.jit
def _score_kernel(
    query_ptr, codes_ptr, weight_ptr, norms_ptr, cand_ptr, keys_ptr, hist_ptr,
    H, W, CHUNKS,
    q_sb, q_sh, q_sd,
    code_sb, code_sh, code_sn, code_sd,
    weight_sb, weight_sh, weight_sn,
    norm_sb, norm_sh, norm_sn,
    cand_sb, cand_sh, cand_sc,
    values_ptr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    i = tl.arange(0, BLOCK_HALF)
    in_i = i < HALF
    # coordinate 2i is byte i's low nibble, 2i + 1 its high nibble
    q_base = query_ptr + b * q_sb + h * q_sh
    q_even = tl.load(q_base + (2 * i) * q_sd, mask=in_i, other=0.0).to(tl.float32)
    q_odd = tl.load(q_base + (2 * i + 1) * q_sd, mask=in_i, other=0.0).to(tl.float32)
    unlisted = tl.full([SUB], -2147483648, tl.int32)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        cand = tl.load(cand_ptr + b * cand_sb + h * cand_sh + c * cand_sc, mask=in_c, other=-1).to(tl.int64)
        listed = cand >= 0
        token = tl.where(listed, cand, 0)
        rows = listed[:, None] & in_i[None, :]
        packed = tl.load(
            codes_ptr + b * code_sb + h * code_sh + token[:, None] * code_sn + i[None, :] * code_sd,
            mask=rows, other=0,
        ).to(tl.int32)
        # a nibble's value (sign included) from a 16-float table: one 64-byte line, so a warp's
        # lookups are served at once
        low_val = tl.load(values_ptr + (packed & 15))
        high_val = tl.load(values_ptr + (packed >> 4))
        terms = low_val * q_even[None, :] + high_val * q_odd[None, :]
        dot = tl.sum(tl.where(rows, terms, 0.0), axis=1)
        weight = tl.load(weight_ptr + b * weight_sb + h * weight_sh + token * weight_sn, mask=listed, other=0.0)
        norm = tl.load(norms_ptr + b * norm_sb + h * norm_sh + token * norm_sn, mask=listed, other=0.0)
        score = weight.to(tl.float32) * norm.to(tl.float32) * dot + 0.0  # + 0.0: -0.0 ties +0.0
        # the float's bits as an int32 that orders as the float does: negatives flip their magnitude
        bits = score.to(tl.int32, bitcast=True)
        key = tl.where(listed, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), unlisted)
        tl.store(keys_ptr + row * W + c, key, mask=in_c)
        hist += tl.histogram(tl.where(in_c, (key >> 22) + 512, 0), BINS)
    tl.store(hist_ptr + (row * CHUNKS + chunk) * BINS + tl.arange(0, BINS), hist)


@pdl_kernel
@triton.jit
def _threshold_kernel(
    hist_ptr, indexed_ptr, next_ptr, start_ptr, row_ptr,
    CHUNKS, R,
    BINS: tl.constexpr, CHUNK_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK_BLOCK)
    base = hist_ptr + row * CHUNKS * BINS
    buffered = tl.minimum(tl.maximum(tl.load(next_ptr) - tl.load(indexed_ptr), 0), R).to(tl.int32)
    total = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, CHUNKS, CHUNK_BLOCK):
        c = c0 + lanes
        block = tl.load(base + c[:, None] * BINS + bins[None, :], mask=(c < CHUNKS)[:, None], other=0)
        total += tl.sum(block, axis=0)
    total = tl.where(bins > 0, total, 0)  # bin 0: not listed
    n = tl.sum(total, axis=0)
    take = tl.minimum(R - buffered, n)
    at_least = n - tl.cumsum(total, axis=0) + total
    level = tl.max(tl.where((at_least >= take) & (bins > 0), bins, 0), axis=0)
    level = tl.where(take > 0, level, BINS)  # nothing to take: no bin qualifies
    above = tl.sum(tl.where(bins > level, total, 0), axis=0)
    tied = tl.sum(tl.where(bins == level, total, 0), axis=0)
    tl.store(row_ptr + row * 4 + tl.arange(0, 4),
             tl.where(tl.arange(0, 4) == 0, level, tl.where(tl.arange(0, 4) == 1, take,
                      tl.where(tl.arange(0, 4) == 2, above, tied))))
    over_before = 0
    tied_before = 0
    for c0 in range(0, CHUNKS, CHUNK_BLOCK):
        c = c0 + lanes
        in_c = c < CHUNKS
        block = tl.load(base + c[:, None] * BINS + bins[None, :], mask=in_c[:, None], other=0)
        over = tl.sum(tl.where(bins[None, :] > level, block, 0), axis=1)
        at = tl.sum(tl.where(bins[None, :] == level, block, 0), axis=1)
        tl.store(start_ptr + (row * CHUNKS + c) * 2, over_before + tl.cumsum(over, axis=0) - over, mask=in_c)
        tl.store(start_ptr + (row * CHUNKS + c) * 2 + 1, tied_before + tl.cumsum(at, axis=0) - at, mask=in_c)
        over_before += tl.sum(over, axis=0)
        tied_before += tl.sum(at, axis=0)


@pdl_kernel
@triton.jit
def _split_kernel(
    keys_ptr, cand_ptr, start_ptr, row_ptr, above_ptr, tied_ptr,
    H, W, CHUNKS, R,
    cand_sb, cand_sh, cand_sc,
    CHUNK: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    level = tl.load(row_ptr + row * 4)
    over_placed = tl.load(start_ptr + (row * CHUNKS + chunk) * 2)
    tied_placed = tl.load(start_ptr + (row * CHUNKS + chunk) * 2 + 1)
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        key = tl.load(keys_ptr + row * W + c, mask=in_c, other=-2147483648)
        bin = (key >> 22) + 512
        over = ((bin > level) & in_c).to(tl.int32)
        tie = ((bin == level) & in_c).to(tl.int32)
        position = tl.load(cand_ptr + b * cand_sb + h * cand_sh + c * cand_sc, mask=(over | tie) != 0, other=0)
        over_at = over_placed + tl.cumsum(over, axis=0) - over
        tie_at = tied_placed + tl.cumsum(tie, axis=0) - tie
        # above list (R entries a row): position, then the tied entries before it
        above_row = above_ptr + row * R * 2
        tl.store(above_row + over_at * 2, position.to(tl.int32), mask=over != 0)
        tl.store(above_row + over_at * 2 + 1, tie_at, mask=over != 0)
        # tied list (W entries a row): key, position, then the above entries before it
        tied_row = tied_ptr + row * W * 4
        tl.store(tied_row + tie_at * 4, key, mask=tie != 0)
        tl.store(tied_row + tie_at * 4 + 1, position.to(tl.int32), mask=tie != 0)
        tl.store(tied_row + tie_at * 4 + 2, over_at, mask=tie != 0)
        over_placed += tl.sum(over, axis=0)
        tied_placed += tl.sum(tie, axis=0)


@triton.jit
def _buffer_rows_and_tail(out_ids, out_slots, out_valid, token_valid_ptr, slots_ptr, b, indexed, buffered, filled,
                          R, N, valid_sb, valid_sn, slot_s, BLOCK: tl.constexpr):
    """A row's rows ``[0, buffered)``: the update buffer's positions from ``indexed`` (-1 where not valid), and
    its empty tail ``[filled, R)`` (-1, slot 0's); the rows between are the chosen ones, written by the caller.
    Returns how many buffer rows are valid."""
    lanes = tl.arange(0, BLOCK)
    count = 0
    for r0 in range(0, R, BLOCK):
        r = r0 + lanes
        in_buffer = r < buffered
        empty = (r >= filled) & (r < R)
        position = tl.minimum(indexed + r, N - 1)
        valid = tl.load(token_valid_ptr + b * valid_sb + position * valid_sn, mask=in_buffer, other=0) != 0
        position = tl.where(in_buffer, position, 0)
        write = in_buffer | empty
        tl.store(out_ids + r, tl.where(valid, position, -1), mask=write)
        tl.store(out_slots + r, tl.load(slots_ptr + position * slot_s, mask=write, other=0), mask=write)
        tl.store(out_valid + r, valid.to(tl.int8), mask=write)
        count += tl.sum(valid.to(tl.int32), axis=0)
    return count


@triton.jit
def _highest(hist, bins, need, NBINS: tl.constexpr):
    # the highest bin b > 0 with at least `need` counts in bins >= b, and the counts above it
    hist = tl.where(bins > 0, hist, 0)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    level = tl.max(tl.where((at_least >= need) & (bins > 0), bins, 0), axis=0)
    level = tl.where(need > 0, level, NBINS)
    return level, tl.sum(tl.where(bins > level, hist, 0), axis=0)


@pdl_kernel
@triton.jit
def _finish_kernel(
    row_ptr, above_ptr, tied_ptr, token_valid_ptr, slots_ptr, indexed_ptr, next_ptr,
    ids_ptr, out_slots_ptr, valid_ptr, count_ptr,
    H, W, R, N,
    valid_sb, valid_sn, slot_s,
    BLOCK: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    take = tl.load(row_ptr + row * 4 + 1)
    above = tl.load(row_ptr + row * 4 + 2)
    tied = tl.load(row_ptr + row * 4 + 3)
    indexed = tl.load(indexed_ptr)
    buffered = tl.minimum(tl.maximum(tl.load(next_ptr) - indexed, 0), R).to(tl.int32)
    need = take - above  # tied entries to take
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)
    tied_row = tied_ptr + row * W * 4
    # the next 11 bits of the tied keys (bin = value + 1), then the last 11 of those at the level
    hist = tl.zeros([BINS], dtype=tl.int32)
    for t0 in range(0, tied, BLOCK):
        t = t0 + lanes
        key = tl.load(tied_row + t * 4, mask=t < tied, other=0)
        hist += tl.histogram(tl.where(t < tied, ((key >> 11) & 2047) + 1, 0), BINS)
    mid_level, mid_above = _highest(hist, bins, need, BINS)
    need_mid = need - mid_above
    hist = tl.zeros([BINS], dtype=tl.int32)
    for t0 in range(0, tied, BLOCK):
        t = t0 + lanes
        key = tl.load(tied_row + t * 4, mask=t < tied, other=0)
        at_mid = (t < tied) & (((key >> 11) & 2047) + 1 == mid_level)
        hist += tl.histogram(tl.where(at_mid, (key & 2047) + 1, 0), BINS)
    low_level, low_above = _highest(hist, bins, need_mid, BINS)
    need_equal = need_mid - low_above  # keys equal to the threshold key: the first by position
    # the chosen tied entries, in position order; each tied entry's count of chosen ones before it
    # goes in its fourth field, for the above list's places
    chosen_before = 0
    equal_before = 0
    out_ids = ids_ptr + row * R
    out_slots = out_slots_ptr + row * R
    out_valid = valid_ptr + row * R
    for t0 in range(0, tied, BLOCK):
        t = t0 + lanes
        in_t = t < tied
        key = tl.load(tied_row + t * 4, mask=in_t, other=0)
        mid = ((key >> 11) & 2047) + 1
        low = (key & 2047) + 1
        equal = (in_t & (mid == mid_level) & (low == low_level)).to(tl.int32)
        equal_rank = equal_before + tl.cumsum(equal, axis=0) - equal
        chosen = (in_t & ((mid > mid_level) | ((mid == mid_level) & (low > low_level))
                          | ((equal != 0) & (equal_rank < need_equal)))).to(tl.int32)
        rank = chosen_before + tl.cumsum(chosen, axis=0) - chosen
        tl.store(tied_row + t * 4 + 3, rank, mask=in_t)
        position = tl.load(tied_row + t * 4 + 1, mask=chosen != 0, other=0).to(tl.int64)
        over_before = tl.load(tied_row + t * 4 + 2, mask=chosen != 0, other=0)
        at = buffered + over_before + rank
        tl.store(out_ids + at, position, mask=chosen != 0)
        tl.store(out_slots + at, tl.load(slots_ptr + position * slot_s, mask=chosen != 0, other=0), mask=chosen != 0)
        tl.store(out_valid + at, tl.full([BLOCK], 1, tl.int8), mask=chosen != 0)
        chosen_before += tl.sum(chosen, axis=0)
        equal_before += tl.sum(equal, axis=0)
    tl.debug_barrier()  # the ranks stored above are read below by other threads
    above_row = above_ptr + row * R * 2
    for a0 in range(0, above, BLOCK):
        a = a0 + lanes
        in_a = a < above
        position = tl.load(above_row + a * 2, mask=in_a, other=0).to(tl.int64)
        tied_before = tl.load(above_row + a * 2 + 1, mask=in_a, other=0)
        # chosen tied entries before it: the rank of the tied entry at its place, or all of them
        ahead = tl.load(tied_row + tied_before * 4 + 3, mask=in_a & (tied_before < tied), other=0)
        ahead = tl.where(tied_before < tied, ahead, chosen_before)
        at = buffered + a + ahead
        tl.store(out_ids + at, position, mask=in_a)
        tl.store(out_slots + at, tl.load(slots_ptr + position * slot_s, mask=in_a, other=0), mask=in_a)
        tl.store(out_valid + at, tl.full([BLOCK], 1, tl.int8), mask=in_a)
    # the update buffer's rows first, the chosen ones (written above), then an empty tail
    count = take + _buffer_rows_and_tail(out_ids, out_slots, out_valid, token_valid_ptr, slots_ptr, b, indexed,
                                         buffered, buffered + take, R, N, valid_sb, valid_sn, slot_s, BLOCK)
    tl.store(count_ptr + row, count.to(tl.int64))


# -- the radix method: a multi-program radix select, 8 bits a level ------------------------------
#
# A key's 32 bits are four digits of 8 (the top digit's sign bit flipped, so the digits order as
# the signed key does). Every level is a pass of rows x chunks programs; a row's histogram of the
# level's digit is the sum of its chunks' (tl.histogram of 256 bins per program, then an atomic
# add of the non-zero bins into the row's), so no program walks a whole row:
#
# 1. ``_radix_score_kernel``: the scores (codes, weight, norm read once), their keys, the top
#    digit's histogram;
# 2. ``_radix_level_kernel`` at levels 1-3: every program picks the previous digit from the row's
#    histogram (the highest bin with at least ``need`` keys at or above it), then histograms the
#    next digit of its keys that match the digits picked so far; the row's state (digits, need)
#    is written once per row (chunk 0) for the next level. At level 3 each program also writes
#    its chunk's suffix counts of the last digit (entry d: its keys above the three digits picked,
#    plus its matching keys whose last digit is d or more; entry 256: the former alone), so the
#    place pass can count a chunk's keys above and at any threshold without a fourth level pass;
# 3. ``_radix_place_kernel``: each program picks the last digit from the row's histogram (the
#    threshold key ``T`` and how many keys equal to it are taken, the first by position), reads
#    two suffix counts of each chunk before it (at most ``_MAX_CHUNKS``: its keys above ``T`` and
#    at it), then writes its chosen candidates at their places in position order, and its share
#    of the update buffer's rows and the -1 tail (chunk 0: the row's count).
#
# The row histograms are self-clearing scratch (``scratch.zeroed``): the place pass's last program
# of a row zeroes all four levels, so a call launches no fill for them.
#
# Each level and place program loads its first step's keys (and in a small call the place pass
# its candidates' positions and slots: _PRELOAD_CANDIDATES) before the row's histogram, so those
# loads overlap the pick's.
#
# Per candidate: codes, weight, norm and position once (as the old rerank), the key written once
# and read four times (4 bytes each); per program 256 histogram bins (257 suffix counts at level 3).

_RADIX_BINS = 256
_RADIX_LEVELS = 4
# programs per call of each pass (about), and the most chunks a row (the place pass sums them)
_RADIX_PROGRAMS = 4096
_MAX_CHUNKS = 256
# keys per step of the level and place passes; rows per step of the place pass's buffer rows and tail
_RADIX_SUB = 1024
_PLACE_BLOCK = 256
# the score pass: candidates a step and warps a program (registers: sm_90, Triton 3.6, compiled
# offline with the runtime's specialization: 64 at 32 x 4 warps, 168 at 128 x 4, where the old
# rerank kernel took 255 and spilled 216 bytes; fewer registers, more programs resident, more
# code bytes in flight), and whether it reads the codes as int32 words where the layout allows
# (else bytes; words convert layouts through shared memory). 128 x 4 warps from session 8's H200
# variant rows (benchmarks/pariskv_select.py, docs/bench/session8/second/pariskv_select.log):
# rerank_select 0.107 ms against 0.114 at 32 x 4 (128Kx4), 0.372 against 0.491 (1Mx4); 64 x 8,
# 128 x 8 and the int32 words were slower at both
_RADIX_SCORE_SUB = 128
_RADIX_SCORE_WARPS = 4
# the fewest candidates a program of the radix passes takes: 256 where about _RADIX_PROGRAMS
# programs would leave fewer. Session 9's third H200 call (docs/bench/session9/third/paris/
# pariskv_select.log), "radix programs 2048", which is chunk 256 at 128Kx4: rerank_select 93.3 us
# against 107.2 (the whole selection 0.211 ms against 0.221); session 8's call alike (107.2
# against 114.0). At 1Mx4 the chunk is 1024 either way (there, 2048 programs took 380.5 against 370.4)
_RADIX_MIN_CHUNK = 256
# ... where that leaves at least _RADIX_MIN_CHUNK_PROGRAMS programs: a smaller call (batch 1 at
# 32K: 8 rows of 6K candidates, 192 programs at 256) takes chunks of one score step instead, so
# no program waits on two rounds of code loads (at 1x32K: 8 x 47 = 376 programs); unmeasured
_RADIX_MIN_CHUNK_PROGRAMS = 1024
# the fewest candidates a program of the level and place passes takes in a call of at least
# _RADIX_LEVEL_LARGE_CALL candidates (else the score pass's chunk). Their programs are latency-bound
# (a row histogram's pick, one step of keys, 256 atomics), so a large call is faster with fewer:
# session 19, H200 (benchmarks/pariskv_select.py --quick, two calls), the whole selection a layer with
# 1024 against the score pass's chunk: 512Kx1 150.1-157.7 us against 164.0-167.9, 128Kx4 161.0 against
# 167.3, 1Mx4 819.1-822.4 against 819.8-841.9; at 1x32K (32K candidates) slower, 44.0-49.1 against 42.0-42.6
_RADIX_LEVEL_MIN_CHUNK = 1024
_RADIX_LEVEL_LARGE_CALL = 1 << 18
# the place pass loads every listed candidate's position and slot ahead of the pick (two dependent
# loads off its chain) in a call of at most this many candidates (1x32K: 8 x 6K); a larger call
# loads the chosen ones' only (at 1Mx4, 3.4M candidates: ~27 MB of positions and a scattered
# slot read each, where ~65K are chosen)
_PRELOAD_CANDIDATES = 1 << 16
SCORE_WORDS = False
# (Session 19 measured two other score passes on an H200, both slower and removed: a nibble's value
# picked by selects among the 8 magnitudes instead of a table load, 1.4x at 1Mx4; each step's codes
# loaded a step ahead, its candidates two ahead, 1.06x)


@triton.jit
def _key_digit(key, LEVEL: tl.constexpr):
    # digit LEVEL (0 = the top 8 bits) of an int32 key, as an unsigned 0..255 that orders as the key
    digit = (key >> (24 - 8 * LEVEL)) & 255
    if LEVEL == 0:
        digit = digit ^ 128
    return digit


@triton.jit
def _pick(hist, bins, need):
    # the highest bin b with at least `need` counts in bins >= b (255 where need is 0), and the
    # counts above it
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    level = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
    return level, tl.sum(tl.where(bins > level, hist, 0), axis=0)


@pdl_kernel
@triton.jit
def _radix_score_kernel(
    query_ptr, codes_ptr, weight_ptr, norms_ptr, cand_ptr, keys_ptr, row_hist_ptr,
    H, W,
    q_sb, q_sh, q_sd,
    code_sb, code_sh, code_sn, code_sd,
    weight_sb, weight_sh, weight_sn,
    norm_sb, norm_sh, norm_sn,
    cand_sb, cand_sh, cand_sc,
    values_ptr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    BINS: tl.constexpr, LEVELS: tl.constexpr, WIDE: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    q_base = query_ptr + b * q_sb + h * q_sh
    if WORDS:
        # codes as int32 words (codes_ptr is the int32 view): nibble j of word w is coordinate
        # 8w + j, so a candidate's D / 2 bytes are D / 8 words (vector loads, and a quarter of the
        # registers of a byte tile); the coordinates are visited nibble by nibble below
        i = tl.arange(0, BLOCK_HALF)  # words
        in_i = i < HALF // 4
        q_even = tl.zeros([BLOCK_HALF], dtype=tl.float32)  # not read
        q_odd = q_even
    else:
        i = tl.arange(0, BLOCK_HALF)
        in_i = i < HALF
        # coordinate 2i is byte i's low nibble, 2i + 1 its high nibble
        q_even = tl.load(q_base + (2 * i) * q_sd, mask=in_i, other=0.0).to(tl.float32)
        q_odd = tl.load(q_base + (2 * i + 1) * q_sd, mask=in_i, other=0.0).to(tl.float32)
    unlisted = tl.full([SUB], -2147483648, tl.int32)
    bins = tl.arange(0, BINS)
    hist = tl.zeros([BINS], dtype=tl.int32)
    cand_row = cand_ptr + b * cand_sb + h * cand_sh
    # the next step's candidates are loaded a step ahead, so a step waits on one load (its
    # codes), not two (the candidates, then their codes)
    c = chunk * CHUNK + tl.arange(0, SUB).to(tl.int64)
    cand_next = tl.load(cand_row + c * cand_sc, mask=c < W, other=-1).to(tl.int64)
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        cand = cand_next
        ahead = c + SUB
        cand_next = tl.load(cand_row + ahead * cand_sc, mask=(ahead < W) & (s0 + SUB < CHUNK), other=-1).to(tl.int64)
        listed = cand >= 0
        token = tl.maximum(cand, 0)  # (a where here trips Triton 3.6's layouts with the carried load)
        rows = listed[:, None] & in_i[None, :]
        packed = tl.load(
            codes_ptr + b * code_sb + h * code_sh + token[:, None] * code_sn + i[None, :] * code_sd,
            mask=rows, other=0,
        ).to(tl.int32)
        if WORDS:
            terms = tl.zeros([SUB, BLOCK_HALF], dtype=tl.float32)
            for j in tl.static_range(8):
                q_j = tl.load(q_base + (8 * i + j) * q_sd, mask=in_i, other=0.0).to(tl.float32)
                terms += tl.load(values_ptr + ((packed >> (4 * j)) & 15)) * q_j[None, :]
        else:
            low_val = tl.load(values_ptr + (packed & 15))
            high_val = tl.load(values_ptr + (packed >> 4))
            terms = low_val * q_even[None, :] + high_val * q_odd[None, :]
        dot = tl.sum(tl.where(rows, terms, 0.0), axis=1)
        weight = tl.load(weight_ptr + b * weight_sb + h * weight_sh + token * weight_sn, mask=listed, other=0.0)
        norm = tl.load(norms_ptr + b * norm_sb + h * norm_sh + token * norm_sn, mask=listed, other=0.0)
        score = weight.to(tl.float32) * norm.to(tl.float32) * dot + 0.0  # + 0.0: -0.0 ties +0.0
        # -inf (and NaN) scores are never chosen, as the reference's unlisted -inf
        listed = listed & (score > float("-inf"))
        bits = score.to(tl.int32, bitcast=True)
        key = tl.where(listed, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), unlisted)
        if WIDE:
            # (key, then the lower index first) as one int64 for torch.topk: unique, so its order is fixed
            wide = (key.to(tl.int64) << 32) | (W - 1 - c)
            tl.store(keys_ptr + row * W + c, wide, mask=in_c)
        else:
            tl.store(keys_ptr + row * W + c, key, mask=in_c)
            ok = in_c & listed
            hist += tl.histogram(tl.where(ok, _key_digit(key, 0), 0), BINS)
            # the unlisted and the padding went to bin 0: take them out
            hist -= tl.where(bins == 0, SUB - tl.sum(ok.to(tl.int32), axis=0), 0)
    if not WIDE:
        tl.atomic_add(row_hist_ptr + row * LEVELS * BINS + bins, hist, mask=hist != 0, sem="relaxed")


@pdl_kernel
@triton.jit
def _radix_level_kernel(
    keys_ptr, row_hist_ptr, state_ptr, counts_ptr, indexed_ptr, next_ptr,
    W, CHUNKS, R,
    LEVEL: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, LEVELS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    bins = tl.arange(0, BINS)
    three = tl.arange(0, 4)
    # the first step's keys, loaded before the row's histogram (they do not depend on it)
    c = chunk * CHUNK + tl.arange(0, SUB).to(tl.int64)
    key_next = tl.load(keys_ptr + row * W + c, mask=c < W, other=-2147483648)
    # the state after the previous levels: the key's digits picked so far, the keys still to take
    hist = tl.load(row_hist_ptr + (row * LEVELS + LEVEL - 1) * BINS + bins)
    if LEVEL == 1:
        buffered = tl.minimum(tl.maximum(tl.load(next_ptr) - tl.load(indexed_ptr), 0), R).to(tl.int32)
        take = tl.minimum(R - buffered, tl.sum(hist, axis=0))
        prefix = take * 0
        need = take
    else:
        state = tl.load(state_ptr + (row * LEVELS + LEVEL - 1) * 4 + three)
        prefix = tl.sum(tl.where(three == 0, state, 0), axis=0)
        need = tl.sum(tl.where(three == 1, state, 0), axis=0)
        take = tl.sum(tl.where(three == 2, state, 0), axis=0)
    digit, above = _pick(hist, bins, need)
    if LEVEL == 1:
        digit_bits = digit ^ 128
    else:
        digit_bits = digit
    prefix = prefix | (digit_bits << (32 - 8 * LEVEL))
    need = need - above
    if chunk == 0:
        tl.store(state_ptr + (row * LEVELS + LEVEL) * 4 + three,
                 tl.where(three == 0, prefix, tl.where(three == 1, need, tl.where(three == 2, take, 0))))
    # the next digit's histogram of the keys whose higher digits are the picked ones
    high = -(1 << (32 - 8 * LEVEL))  # the bits picked so far
    unlisted = tl.full([SUB], -2147483648, tl.int32)
    hist = tl.zeros([BINS], dtype=tl.int32)
    over = 0  # keys above every key with the picked digits
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        key = key_next
        ahead = c + SUB
        key_next = tl.load(keys_ptr + row * W + ahead, mask=(ahead < W) & (s0 + SUB < CHUNK), other=-2147483648)
        listed = in_c & (key != unlisted)
        match = listed & ((key & high) == prefix)
        hist += tl.histogram(tl.where(match, _key_digit(key, LEVEL), 0), BINS)
        hist -= tl.where(bins == 0, SUB - tl.sum(match.to(tl.int32), axis=0), 0)
        if LEVEL == LEVELS - 1:  # above the largest key with the picked digits
            over += tl.sum((listed & (key > (prefix | ((1 << (32 - 8 * LEVEL)) - 1)))).to(tl.int32), axis=0)
    tl.atomic_add(row_hist_ptr + (row * LEVELS + LEVEL) * BINS + bins, hist, mask=hist != 0, sem="relaxed")
    if LEVEL == LEVELS - 1:
        # the chunk's suffix counts of the last digit (see the comment above): the place pass
        # reads entries d and d + 1 of them for the picked last digit d
        suffix = over + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        counts_row = counts_ptr + (row * CHUNKS + chunk) * (BINS + 1)
        tl.store(counts_row + bins, suffix)
        tl.store(counts_row + BINS, over)


@pdl_kernel
@triton.jit
def _radix_place_kernel(
    keys_ptr, cand_ptr, row_hist_ptr, done_ptr, state_ptr, counts_ptr, token_valid_ptr, slots_ptr, indexed_ptr, next_ptr,
    ids_ptr, out_slots_ptr, valid_ptr, count_ptr,
    H, W, CHUNKS, R, N, FILL,
    cand_sb, cand_sh, cand_sc, valid_sb, valid_sn, slot_s,
    CHUNK: tl.constexpr, SUB: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, LEVELS: tl.constexpr,
    BINS: tl.constexpr, BLOCK: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    # the first step's keys (and with PRELOAD its candidates' positions and slots, every listed
    # one's, not the chosen ones' only), loaded before the row's histogram (they do not depend on it)
    cand_row = cand_ptr + b * cand_sb + h * cand_sh
    c = chunk * CHUNK + tl.arange(0, SUB).to(tl.int64)
    key_next = tl.load(keys_ptr + row * W + c, mask=c < W, other=-2147483648)
    if PRELOAD:
        position_next = tl.load(cand_row + c * cand_sc, mask=c < W, other=-1).to(tl.int64)
        slot_next = tl.load(slots_ptr + tl.maximum(position_next, 0) * slot_s, mask=position_next >= 0, other=0)
    # the last digit, picked as the level passes pick theirs: the threshold key and how many keys
    # equal to it are taken
    bins = tl.arange(0, BINS)
    three = tl.arange(0, 4)
    hist = tl.load(row_hist_ptr + (row * LEVELS + LEVELS - 1) * BINS + bins)
    state = tl.load(state_ptr + (row * LEVELS + LEVELS - 1) * 4 + three)
    prefix = tl.sum(tl.where(three == 0, state, 0), axis=0)
    need = tl.sum(tl.where(three == 1, state, 0), axis=0)
    take = tl.sum(tl.where(three == 2, state, 0), axis=0)
    # the row histograms are self-clearing scratch (scratch.zeroed): the earlier passes' levels were
    # read by launches that are done, the last one by this launch's programs; the row's last program
    # to have read it zeroes all of them, and its ticket (the barrier puts this program's reads first)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
        every = tl.arange(0, LEVELS * BINS)
        tl.store(row_hist_ptr + row * LEVELS * BINS + every, tl.zeros([LEVELS * BINS], dtype=tl.int32))
        tl.store(done_ptr + row, 0)
    digit, above = _pick(hist, bins, need)
    threshold = prefix | digit
    need_equal = need - above
    indexed = tl.load(indexed_ptr)
    buffered = tl.minimum(tl.maximum(tl.load(next_ptr) - indexed, 0), R).to(tl.int32)
    # the chunks before this one: their keys above the threshold, and their share of the equal
    # ones (the first need_equal by position), from their suffix counts of the last digit
    others = tl.arange(0, CHUNKS_BLOCK)
    in_others = others < CHUNKS
    counts_rows = counts_ptr + (row * CHUNKS + others) * (BINS + 1)
    over = tl.load(counts_rows + digit + 1, mask=in_others, other=0)
    tied = tl.load(counts_rows + digit, mask=in_others, other=0) - over
    taken = tl.minimum(tl.maximum(need_equal - (tl.cumsum(tied, axis=0) - tied), 0), tied)
    before = others < chunk
    placed = buffered + tl.sum(tl.where(before, over + taken, 0), axis=0)
    my_taken = tl.sum(tl.where(others == chunk, taken, 0), axis=0)
    unlisted = tl.full([SUB], -2147483648, tl.int32)
    out_ids = ids_ptr + row * R
    out_slots = out_slots_ptr + row * R
    out_valid = valid_ptr + row * R
    equal_seen = 0
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        key = key_next
        # the next step's, a step ahead
        ahead = c + SUB
        in_ahead = (ahead < W) & (s0 + SUB < CHUNK)
        key_next = tl.load(keys_ptr + row * W + ahead, mask=in_ahead, other=-2147483648)
        if PRELOAD:
            position = position_next
            slot = slot_next
            position_next = tl.load(cand_row + ahead * cand_sc, mask=in_ahead, other=-1).to(tl.int64)
            slot_next = tl.load(slots_ptr + tl.maximum(position_next, 0) * slot_s, mask=position_next >= 0, other=0)
        listed = in_c & (key != unlisted)
        equal = (listed & (key == threshold)).to(tl.int32)
        equal_rank = equal_seen + tl.cumsum(equal, axis=0) - equal
        chosen = ((listed & (key > threshold)) | ((equal != 0) & (equal_rank < my_taken))).to(tl.int32)
        at = placed + tl.cumsum(chosen, axis=0) - chosen
        if not PRELOAD:  # the chosen ones' only, once known
            position = tl.load(cand_row + c * cand_sc, mask=chosen != 0, other=0).to(tl.int64)
            slot = tl.load(slots_ptr + position * slot_s, mask=chosen != 0, other=0)
        tl.store(out_ids + at, position, mask=chosen != 0)
        tl.store(out_slots + at, slot, mask=chosen != 0)
        tl.store(out_valid + at, tl.full([SUB], 1, tl.int8), mask=chosen != 0)
        equal_seen += tl.sum(equal, axis=0)
        placed += tl.sum(chosen, axis=0)
    # this chunk's share of the rows: the update buffer's, then the empty tail past the chosen ones
    lanes = tl.arange(0, BLOCK)
    filled = buffered + take
    for f0 in range(0, FILL, BLOCK):
        r = chunk * FILL + f0 + lanes
        mine = (f0 + lanes < FILL) & (r < R)
        in_buffer = mine & (r < buffered)
        empty = mine & (r >= filled)
        position = tl.minimum(indexed + r, N - 1)
        valid = tl.load(token_valid_ptr + b * valid_sb + position * valid_sn, mask=in_buffer, other=0) != 0
        position = tl.where(in_buffer, position, 0)
        write = in_buffer | empty
        tl.store(out_ids + r, tl.where(valid, position, -1), mask=write)
        tl.store(out_slots + r, tl.load(slots_ptr + position * slot_s, mask=write, other=0), mask=write)
        tl.store(out_valid + r, valid.to(tl.int8), mask=write)
    if chunk == 0:  # the row's count: the chosen ones and the buffer's valid rows
        count = take
        # over the buffer's rows only (a few dozen), not all R: this program's serial tail
        for r0 in range(0, buffered, BLOCK):
            r = r0 + lanes
            in_buffer = r < buffered
            position = tl.minimum(indexed + r, N - 1)
            valid = tl.load(token_valid_ptr + b * valid_sb + position * valid_sn, mask=in_buffer, other=0) != 0
            count += tl.sum(valid.to(tl.int32), axis=0)
        tl.store(count_ptr + row, count.to(tl.int64))


# -- the row method: a small call's whole select in one program a row -----------------------------
#
# Where a row's keys fit one program's registers (at most _ROW_MAX_WIDTH candidates: 4K-6.6K a row at 1x32K and
# 4x32K), the radix method's three level passes and its place pass (four latency-bound launches: 13 us a
# layer at 1x32K on an H100, session 35's profile) become one launch after the same score pass:
# ``_radix_row_kernel`` loads its row's keys, positions and slots once, picks the top digit from the score
# pass's histogram as level 1 does, then fixes the threshold key's lower 24 bits one at a time (the largest
# key with at least ``take`` keys at or above it: a count in registers a bit), and places the chosen keys as
# the place pass does (above the threshold, then the first equal ones by position). It zeroes the row's
# histogram after reading it (the scratch stays zero between calls, as the place pass leaves it).

_ROW_MAX_WIDTH = 8192
_ROW_BLOCK = 1024  # output rows a step of the buffer rows and the -1 tail


@pdl_kernel
@triton.jit
def _radix_row_kernel(
    keys_ptr, cand_ptr, row_hist_ptr, token_valid_ptr, slots_ptr, indexed_ptr, next_ptr,
    ids_ptr, out_slots_ptr, valid_ptr, count_ptr,
    H, W, R, N,
    cand_sb, cand_sh, cand_sc, valid_sb, valid_sn, slot_s,
    BLOCK_W: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, LEVELS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    h = row % H
    c = tl.arange(0, BLOCK_W)
    key = tl.load(keys_ptr + row * W + c, mask=c < W, other=-2147483648)
    listed = key != -2147483648
    # every listed candidate's position and slot, loaded before the search (they do not depend on it)
    cand_row = cand_ptr + b * cand_sb + h * cand_sh
    position = tl.load(cand_row + c * cand_sc, mask=listed, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + position * slot_s, mask=listed, other=0)
    bins = tl.arange(0, BINS)
    hist = tl.load(row_hist_ptr + row * LEVELS * BINS + bins)
    indexed = tl.load(indexed_ptr)
    buffered = tl.minimum(tl.maximum(tl.load(next_ptr) - indexed, 0), R).to(tl.int32)
    take = tl.minimum(R - buffered, tl.sum(hist, axis=0))
    digit, _ = _pick(hist, bins, take)
    # the threshold key as an unsigned 32-bit value (the key plus 2**31), in int64: its top digit picked, then
    # each lower bit set where at least `take` keys are at or above it (compared as signed keys)
    threshold = digit.to(tl.int64) << 24
    for i in range(24):
        trial = threshold | (1 << (23 - i))
        at_or_above = tl.sum((listed & (key >= (trial - 2147483648).to(tl.int32))).to(tl.int32), axis=0)
        threshold = tl.where(at_or_above >= take, trial, threshold)
    threshold_key = (threshold - 2147483648).to(tl.int32)
    over = listed & (key > threshold_key)
    equal = (listed & (key == threshold_key)).to(tl.int32)
    equal_taken = take - tl.sum(over.to(tl.int32), axis=0)
    chosen = (over | ((equal != 0) & (tl.cumsum(equal, axis=0) - equal < equal_taken))).to(tl.int32)
    at = buffered + tl.cumsum(chosen, axis=0) - chosen
    out_ids = ids_ptr + row * R
    out_slots = out_slots_ptr + row * R
    out_valid = valid_ptr + row * R
    tl.store(out_ids + at, position, mask=chosen != 0)
    tl.store(out_slots + at, slot, mask=chosen != 0)
    tl.store(out_valid + at, tl.full([BLOCK_W], 1, tl.int8), mask=chosen != 0)
    # the update buffer's rows, then the empty tail past the chosen ones, and the row's count
    count = take + _buffer_rows_and_tail(out_ids, out_slots, out_valid, token_valid_ptr, slots_ptr, b, indexed,
                                         buffered, buffered + take, R, N, valid_sb, valid_sn, slot_s, BLOCK)
    tl.store(count_ptr + row, count.to(tl.int64))
    # the row's histogram back to zero for the next call (its reads above are done: the barrier orders them)
    tl.debug_barrier()
    tl.store(row_hist_ptr + row * LEVELS * BINS + bins, tl.zeros([BINS], dtype=tl.int32))


# which method ranks a call (see the module docstring): "auto" picks by the candidates per row,
# from _METHOD_BY_WIDTH: (the fewest candidates a row, method) pairs, ascending; the last whose
# bound the width reaches wins. Radix everywhere: the row method, one program a row, ran at 23.4 us against
# radix's four launches' 12.3 at 1x32K on an H100 (session 37: 8 rows, so 8 programs each a serial 24-bit
# search; pariskv 10.33 ms a step against 9.99 end to end). benchmarks/pariskv_select.py times them all
METHOD = "auto"
METHODS = ("radix", "row", "split", "torch")
_METHOD_BY_WIDTH = ((0, "radix"),)


def method_for(width: int) -> str:
    """The method ``METHOD`` names for ``width`` candidates a row ("auto": ``_METHOD_BY_WIDTH``)."""
    if METHOD != "auto":
        if METHOD not in METHODS:
            raise ValueError(f"triton rerank_select: METHOD {METHOD!r}; accepted: auto, {', '.join(METHODS)}")
        return METHOD
    chosen = _METHOD_BY_WIDTH[0][1]
    for bound, method in _METHOD_BY_WIDTH:
        if width >= bound:
            chosen = method
    return chosen


def _check(query_rotated, codes, weight, norms, candidates, token_valid, slots, indexed, next_position):
    head_softmax.check_query("rerank_select", query_rotated, codes)
    batch, heads, n, half = codes.shape
    width = candidates.shape[-1]
    if (tuple(weight.shape) != (batch, heads, n)
            or tuple(norms.shape) != (batch, heads, n) or tuple(candidates.shape[:2]) != (batch, heads)
            or candidates.dim() != 3 or tuple(token_valid.shape) != (batch, n) or tuple(slots.shape) != (n,)
            or indexed.numel() != 1 or next_position.numel() != 1):
        raise ValueError(
            f"triton rerank_select: weight {tuple(weight.shape)}, norms "
            f"{tuple(norms.shape)}, candidates {tuple(candidates.shape)}, token_valid {tuple(token_valid.shape)} "
            f"or slots {tuple(slots.shape)} do not fit codes {tuple(codes.shape)} (or the counters are not one value)"
        )
    if width >= 1 << 28 or n >= 1 << 31:  # list offsets (4 ints an entry) stay int32
        raise ValueError(f"triton rerank_select: {width} candidates over {n} positions exceed its int32 lists")


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
    method: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(unit_ids, num_units, slots, valid)``; see ``reference_analytic.rerank_select``.

    ``method``: "radix", "row" (at most ``_ROW_MAX_WIDTH`` candidates a row), "split" or "torch" (the module
    docstring and the comments above the kernels); None: ``method_for(width)``.
    ``query_rotated``: the group's mean ``(B, H, D)``, or a query per head of the group ``(B, H, G,
    D)`` (``rerank="head_softmax"``: ``head_softmax.keys`` scores the candidates).
    """
    args = (query_rotated, codes, weight, norms, candidates, token_valid, slots, indexed, next_position)
    _check(*args)
    method = method or method_for(candidates.shape[-1])
    if method == "radix":
        return _radix(*args, int(capacity))
    if method == "row":
        return _row(*args, int(capacity))
    if method == "split":
        return _split(*args, int(capacity))
    if method == "torch":
        return _torch_topk(*args, int(capacity))
    raise ValueError(f"triton rerank_select: method {method!r}; accepted: {', '.join(METHODS)}")


def _outputs(batch, heads, capacity, device):
    return (torch.empty(batch, heads, capacity, dtype=torch.long, device=device),
            torch.empty(batch, heads, capacity, dtype=torch.long, device=device),
            torch.empty(batch, heads, capacity, dtype=torch.bool, device=device),
            torch.empty(batch, heads, dtype=torch.long, device=device))


def _code_words(codes: torch.Tensor) -> torch.Tensor | None:
    """The packed codes as int32 words (8 nibbles each) where ``SCORE_WORDS`` and the layout allow; else None."""
    if not SCORE_WORDS or codes.shape[-1] % 4 or codes.stride(-1) != 1:
        return None
    try:
        return codes.view(torch.int32)
    except RuntimeError:  # strides or offset not a multiple of 4 bytes
        return None


def _score_launch(query_rotated, codes, weight, norms, candidates, keys, row_hist, chunk, chunks, wide):
    if query_rotated.dim() == 4:  # rerank="head_softmax": each head's softmax, the same keys
        head_softmax.keys(query_rotated, codes, weight, norms, candidates, keys, row_hist, chunk,
                          "wide" if wide else "radix", _RADIX_BINS, _RADIX_LEVELS)
        return
    batch, heads, n, half = codes.shape
    width = candidates.shape[-1]
    values = nibble_values(2 * half, codes.device)  # cached on the device
    words = _code_words(codes)
    source = codes if words is None else words
    _radix_score_kernel[(batch * heads, chunks)](
        query_rotated, source, weight, norms, candidates, keys, row_hist,
        heads, width,
        *query_rotated.stride(), *source.stride(), *weight.stride(), *norms.stride(), *candidates.stride(),
        values,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half if words is None else half // 4), CHUNK=chunk,
        SUB=min(chunk, _RADIX_SCORE_SUB), BINS=_RADIX_BINS, LEVELS=_RADIX_LEVELS, WIDE=wide, WORDS=words is not None,
        num_warps=_RADIX_SCORE_WARPS,
    )


def radix_chunk(rows: int, width: int) -> int:
    """Candidates per program of the radix method's passes: about ``_RADIX_PROGRAMS`` programs a
    call, at most ``_MAX_CHUNKS`` chunks a row, at least ``_RADIX_MIN_CHUNK`` where the call
    keeps ``_RADIX_MIN_CHUNK_PROGRAMS`` programs at it, and at least ``_RADIX_SCORE_SUB`` (all
    where the row has that many)."""
    chunk = triton.next_power_of_2(triton.cdiv(max(1, rows * width), _RADIX_PROGRAMS))
    if rows * triton.cdiv(width, _RADIX_MIN_CHUNK) >= _RADIX_MIN_CHUNK_PROGRAMS:
        chunk = max(chunk, _RADIX_MIN_CHUNK)
    chunk = max(chunk, triton.next_power_of_2(triton.cdiv(max(1, width), _MAX_CHUNKS)))
    return max(_RADIX_SCORE_SUB, min(chunk, triton.next_power_of_2(max(1, width))))


def _radix(query_rotated, codes, weight, norms, candidates, token_valid, slots, indexed, next_position, capacity):
    batch, heads, n, half = codes.shape
    width = candidates.shape[-1]
    device = codes.device
    rows = batch * heads
    ids, out_slots, valid, count = _outputs(batch, heads, capacity, device)
    if rows == 0 or capacity == 0:
        return ids, count.zero_(), out_slots, valid
    chunk = radix_chunk(rows, width)
    keys = torch.empty(rows, max(1, width), dtype=torch.int32, device=device)
    # zero between calls, as the place pass leaves them: no fill launched (scratch.zeroed)
    row_hist = scratch.zeroed(device, "rerank_select.row_hist", (rows, _RADIX_LEVELS, _RADIX_BINS))
    done = scratch.zeroed(device, "rerank_select.done", (rows,))
    state = torch.empty(rows, _RADIX_LEVELS, 4, dtype=torch.int32, device=device)
    _score_launch(query_rotated, codes, weight, norms, candidates, keys, row_hist, chunk,
                  max(1, triton.cdiv(width, chunk)), False)
    # the level and place passes' chunk: the score pass's, or in a large call larger
    # (_RADIX_LEVEL_MIN_CHUNK; the score pass's histogram goes to the row's whatever its chunks)
    if rows * width >= _RADIX_LEVEL_LARGE_CALL:
        chunk = max(chunk, min(_RADIX_LEVEL_MIN_CHUNK, triton.next_power_of_2(max(1, width))))
    chunks = max(1, triton.cdiv(width, chunk))
    # level 3's suffix counts of the last digit, per chunk (see the comment above _RADIX_BINS)
    counts = torch.empty(rows, chunks, _RADIX_BINS + 1, dtype=torch.int32, device=device)
    sub = min(chunk, _RADIX_SUB)
    for level in range(1, _RADIX_LEVELS):
        _radix_level_kernel[(rows, chunks)](
            keys, row_hist, state, counts, indexed, next_position,
            width, chunks, capacity,
            LEVEL=level, CHUNK=chunk, SUB=sub, BINS=_RADIX_BINS, LEVELS=_RADIX_LEVELS,
        )
    valid_bytes = valid.view(torch.int8)
    token_bytes = token_valid.view(torch.uint8) if token_valid.dtype == torch.bool else token_valid
    _radix_place_kernel[(rows, chunks)](
        keys, candidates, row_hist, done, state, counts, token_bytes, slots, indexed, next_position,
        ids, out_slots, valid_bytes, count,
        heads, width, chunks, capacity, n, triton.cdiv(capacity, chunks),
        *candidates.stride(), *token_bytes.stride(), slots.stride(0),
        CHUNK=chunk, SUB=sub, CHUNKS_BLOCK=max(2, triton.next_power_of_2(chunks)), LEVELS=_RADIX_LEVELS,
        BINS=_RADIX_BINS, PRELOAD=rows * width <= _PRELOAD_CANDIDATES, BLOCK=min(_PLACE_BLOCK, triton.next_power_of_2(triton.cdiv(capacity, chunks))),
    )
    return ids, count, out_slots, valid


def _row(query_rotated, codes, weight, norms, candidates, token_valid, slots, indexed, next_position, capacity):
    """The row method (see the comment above ``_ROW_MAX_WIDTH``): the radix method's score pass, then one
    program a row."""
    batch, heads, n, half = codes.shape
    width = candidates.shape[-1]
    if width > _ROW_MAX_WIDTH:
        raise ValueError(f"triton rerank_select: method 'row' takes at most {_ROW_MAX_WIDTH} candidates a row, "
                         f"got {width}; accepted for more: radix, split, torch")
    device = codes.device
    rows = batch * heads
    ids, out_slots, valid, count = _outputs(batch, heads, capacity, device)
    if rows == 0 or capacity == 0:
        return ids, count.zero_(), out_slots, valid
    chunk = radix_chunk(rows, width)
    keys = torch.empty(rows, max(1, width), dtype=torch.int32, device=device)
    row_hist = scratch.zeroed(device, "rerank_select.row_hist", (rows, _RADIX_LEVELS, _RADIX_BINS))
    _score_launch(query_rotated, codes, weight, norms, candidates, keys, row_hist, chunk,
                  max(1, triton.cdiv(width, chunk)), False)
    block_w = max(16, triton.next_power_of_2(max(1, width)))
    token_bytes = token_valid.view(torch.uint8) if token_valid.dtype == torch.bool else token_valid
    _radix_row_kernel[(rows,)](
        keys, candidates, row_hist, token_bytes, slots, indexed, next_position,
        ids, out_slots, valid.view(torch.int8), count,
        heads, width, capacity, n,
        *candidates.stride(), *token_bytes.stride(), slots.stride(0),
        BLOCK_W=block_w, BLOCK=min(_ROW_BLOCK, triton.next_power_of_2(capacity)), BINS=_RADIX_BINS,
        LEVELS=_RADIX_LEVELS, num_warps=min(16, max(4, block_w // 512)),
    )
    return ids, count, out_slots, valid


def _torch_topk(query_rotated, codes, weight, norms, candidates, token_valid, slots, indexed, next_position,
                capacity):
    """The scores as unique int64 keys (one launch), ``torch.topk`` of the best ``capacity``, then
    the buffer-first composition in PyTorch (the reference's steps)."""
    batch, heads, n, half = codes.shape
    width = candidates.shape[-1]
    device = codes.device
    rows = batch * heads
    if rows == 0 or capacity == 0 or width == 0:
        # nothing listed: the reference's composition of an empty ranking
        best = torch.full((batch, heads, 0), n, dtype=torch.long, device=device)
        return reference_analytic.compose_selection(best, token_valid, slots, indexed, next_position, capacity, n)
    keys = torch.empty(rows, width, dtype=torch.int64, device=device)
    chunk = radix_chunk(rows, width)
    _score_launch(query_rotated, codes, weight, norms, candidates, keys, keys, chunk,
                  triton.cdiv(width, chunk), True)
    best = torch.topk(keys, min(capacity, width), dim=-1, sorted=True).values  # best first
    buffered = (next_position - indexed).clamp(min=0, max=capacity)
    rank = torch.arange(best.shape[-1], device=device)
    chosen = (rank < capacity - buffered) & ((best >> 32) > -(1 << 31))
    index = (width - 1 - (best & 0xFFFFFFFF)).clamp(min=0)
    position = candidates.reshape(rows, width).gather(1, index)
    picked = torch.where(chosen, position, n).sort(-1).values.view(batch, heads, -1)  # by position, n = none
    return reference_analytic.compose_selection(picked, token_valid, slots, indexed, next_position, capacity, n)


def _split(
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
    batch, heads, n, half = codes.shape
    width = candidates.shape[-1]
    device = codes.device
    capacity = int(capacity)
    rows = batch * heads
    ids = torch.empty(batch, heads, capacity, dtype=torch.long, device=device)
    out_slots = torch.empty(batch, heads, capacity, dtype=torch.long, device=device)
    valid = torch.empty(batch, heads, capacity, dtype=torch.bool, device=device)
    count = torch.empty(batch, heads, dtype=torch.long, device=device)
    if rows == 0 or capacity == 0:
        return ids, count.zero_(), out_slots, valid
    chunk = min(_CHUNK, max(_SCORE_SUB, triton.next_power_of_2(triton.cdiv(max(1, width), _CHUNKS_PER_ROW))))
    chunks = max(1, triton.cdiv(width, chunk))
    keys = torch.empty(rows, max(1, width), dtype=torch.int32, device=device)
    hist = torch.empty(rows, chunks, _BINS1, dtype=torch.int32, device=device)
    starts = torch.empty(rows, chunks, 2, dtype=torch.int32, device=device)
    row_state = torch.empty(rows, 4, dtype=torch.int32, device=device)
    above = torch.empty(rows, capacity, 2, dtype=torch.int32, device=device)
    tied = torch.empty(rows, max(1, width), 4, dtype=torch.int32, device=device)
    values = nibble_values(2 * half, device)  # cached on the device
    if query_rotated.dim() == 4:  # rerank="head_softmax": each head's softmax, the same keys
        head_softmax.keys(query_rotated, codes, weight, norms, candidates, keys, hist, chunk, "split", _BINS1)
    else:
        _score_kernel[(rows, chunks)](
            query_rotated, codes, weight, norms, candidates, keys, hist,
            heads, width, chunks,
            *query_rotated.stride(), *codes.stride(), *weight.stride(), *norms.stride(), *candidates.stride(),
            values,
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), CHUNK=chunk, SUB=_SCORE_SUB, BINS=_BINS1,
        )
    _threshold_kernel[(rows,)](hist, indexed, next_position, starts, row_state, chunks, capacity,
                               BINS=_BINS1, CHUNK_BLOCK=_CHUNK_BLOCK)
    _split_kernel[(rows, chunks)](
        keys, candidates, starts, row_state, above, tied,
        heads, width, chunks, capacity, *candidates.stride(),
        CHUNK=chunk, SUB=min(chunk, _SPLIT_SUB),
    )
    valid_bytes = valid.view(torch.int8)
    token_bytes = token_valid.view(torch.uint8) if token_valid.dtype == torch.bool else token_valid
    _finish_kernel[(rows,)](
        row_state, above, tied, token_bytes, slots, indexed, next_position,
        ids, out_slots, valid_bytes, count,
        heads, width, capacity, n,
        *token_bytes.stride(), slots.stride(0),
        BLOCK=_BLOCK, BINS=_BINS2,
    )
    return ids, count, out_slots, valid


if "rerank_select" in OPS:  # registered once dispatch.OPS names the op
    implement("triton", "rerank_select", supports=triton_runs_on)(rerank_select)
