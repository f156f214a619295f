"""Triton score-gap trigger ops: its step (``score_gap_fire``), three launches (four past 64 blocks
a row) where the reference (``kernels/reference_step.py``) takes about sixty small ones, and its
bookkeeping after a re-selection (``score_gap_selected``), one launch where the reference takes
about twenty.

On a step that keeps its selection the first is what the louiskv preset's trigger adds to the
unit scoring, and every small launch of a replayed graph costs about what it runs, so it is fused:

1. ``_follow_kernel``, one program per (KV head, sequence): follows the token that left the
   local window in the held list, and keeps the held marks in step with it.
2. ``_gap_blocks_kernel``, one program per block of units of each (head, sequence): reads the
   scores and the held marks once, and takes the block's best unheld unit and its held units' side (the
   weakest score, or a logsumexp of their estimated mass). Blocks run in parallel:
   one program walking a head's whole table was latency-bound (24 us a layer at 4x128K, H200).
3. ``_decide_kernel``, one program per sequence: combines the blocks (``_DECIDE_BLOCK`` at a time;
   past that many a row, ``_row_parts_kernel`` first makes them one a row, a few rows a program)
   and heads, and the largest
   gap over the heads decides; given the layer's ``Decision``, it also writes the step's decision
   there (``note_decision``'s work, so the step launches no note).

Measure ``rank``: the first launch also takes the held units' mean score (over the held list, a unit
listed once), the second counts the unheld units above it per block, the third sums the counts.
``cap``: the third launch counts the selection's age. ``every``: it also counts the layer's steps, and
on a step that does not measure the gap the second launch returns at once
(reading no score or key) and the third keeps the selection. ``margins``: each layer's launch takes its own
margin. ``estimate="outlier"`` is its own op (``score_gap_outlier.py``; with ``challengers``, the
follow launch also checks them and the row stage always runs: ``score_gap_challengers.py``); the
reference-only options (the other ``estimate``s, ``group="each"`` without outliers, ``count``) are
refused with a ConfigError (``unsupported``), at attach and here.

The held marks (``ScoreGapState.held_marks``, ``held_marks``) are the held list as a byte mask over the unit
table, a row per (sequence, head): made from the list where the state has none (or the table grew), then kept
in step with it by every op that changes the list, so a step reads a unit's mark where the list would take a
scan (a unit is listed once). Per-sequence state (``seen_open``) is written by the last launch, after every
head read it.

``_selected_kernel``, one program per (KV head, sequence) that re-selected: the held list
becomes the selection's units, each with the buffer row where it ends (a running sum of sizes), and
their marks replace the old list's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from ..dispatch import implement, triton_runs_on
from ..reference_step import held_units_mask
from .pdl import pdl_kernel, wait_for_previous
from .score_gap_challengers import check_challengers, measures_whole, merge_challengers
from .step import note_rows

_GAP_BLOCK = 1024  # units a program of the gap pass reads
_DECIDE_BLOCK = 64  # blocks' parts the decide launch reads at a time, a row each (more: a stage a row first)
# that stage: rows a program combines, and blocks' parts it reads at a time (a power of two). A row a
# program, 256 parts at once: 2.1 us a layer at 1x128K against 5.5 for 4 rows, 64 at a time (H100, session 28)
_ROW_BLOCK = 1
_ROW_SPAN = 256


@triton.jit
def _measures(steps_ptr, b, offset, EVERY: tl.constexpr):
    """Whether sequence ``b``'s layer measures the gap at this step (``ScoreGap.every``: its step
    count plus the layer's ``offset`` a multiple of ``EVERY``). Called under ``if EVERY > 1`` only,
    so the default step (``EVERY`` 1) compiles as it did without it."""
    return (tl.load(steps_ptr + b) + offset) % EVERY == 0


@triton.jit
def leaving_token(b, h, ok, unit, seen_open_ptr, size_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr,
                  marks_ptr, U, sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, mk_sb, mk_sh):
    """What the last step's leaving token did, for KV head(s) ``h`` of sequence ``b`` (where ``ok``): whether
    the open unit ``unit`` took it (moved on, or grew), whether the retrieved buffer admitted it (its count grew),
    and whether the held list lists that unit (its mark); then the unit's size and the admitted count now.
    (Scalars meet vectors in wheres, not ands: the interpreter makes a vector-and-scalar int32.)"""
    size_now = tl.load(size_ptr + b * sz_sb + h * sz_sh + tl.maximum(unit, 0), mask=ok, other=0)
    moved = unit != tl.load(seen_open_ptr + b)
    grew = size_now != tl.load(seen_size_ptr + b * ss_sb + h, mask=ok, other=0)
    appended = tl.where(unit >= 0, tl.where(moved, True, grew), False)
    admitted_now = tl.load(admitted_ptr + b * ad_sb + h, mask=ok, other=0)
    admitted = admitted_now > tl.load(seen_admitted_ptr + b * sa_sb + h, mask=ok, other=0)
    listed = tl.load(marks_ptr + b * mk_sb + h * mk_sh + tl.maximum(unit, 0),
                     mask=tl.where(ok, (unit >= 0) & (unit < U), False), other=0) != 0
    return appended, admitted, listed, size_now, admitted_now


@triton.jit
def read_leaving_token(b, open_ptr, seen_open_ptr, size_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr,
                       marks_ptr, held_ptr, held_end_ptr, held_count_ptr, KV, U, R,
                       sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, mk_sb, mk_sh, hl_sb, hl_sh, he_sb, he_sh, hc_sb,
                       BLOCK_KV: tl.constexpr):
    """``_follow_kernel``'s reads for every KV head of sequence ``b`` at once (``[BLOCK_KV]``), without
    ``admit="evict"`` or ``leaving="unheld"`` (neither drops a unit then): the open unit ``unit``; ``add``, where
    it joins the held list (the buffer admitted its token); the list's ``count``; the entry it takes and what that
    listed (``replaced``: -1 but in a full list); the unit's size and the admitted count now, the next last look.
    ``write_leaving_token`` makes the writes. (The arguments after ``b``: ``leaving_inputs``.)"""
    heads = tl.arange(0, BLOCK_KV).to(tl.int64)
    ok = heads < KV
    unit = tl.load(open_ptr + b)
    appended, admitted, listed, size_now, admitted_now = leaving_token(
        b, heads, ok, unit, seen_open_ptr, size_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr, marks_ptr, U,
        sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, mk_sb, mk_sh)
    add = tl.where(ok, appended & admitted & ~listed, False)
    count = tl.load(held_count_ptr + b * hc_sb + heads, mask=ok, other=0)
    replaced = tl.load(held_ptr + b * hl_sb + heads * hl_sh + tl.minimum(count, R - 1), mask=add, other=-1)
    return unit, add, count, replaced, size_now, admitted_now


@triton.jit
def write_leaving_token(b, unit, add, count, replaced, size_now, admitted_now,
                        open_ptr, seen_open_ptr, size_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr,
                        marks_ptr, held_ptr, held_end_ptr, held_count_ptr, KV, U, R,
                        sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, mk_sb, mk_sh, hl_sb, hl_sh, he_sb, he_sh, hc_sb,
                        BLOCK_KV: tl.constexpr):
    """``_follow_kernel``'s writes from ``read_leaving_token``'s values: the open unit in the held list's next
    entry (marked; what that entry listed unmarked) where it joins, the counts, and the last look moved on. For a
    launch after every program that reads the list's marks as they were (the outlier blocks launch's last program
    of a sequence, or the decide launch after it), so the step needs no follow launch; ``seen_open`` is the
    decision's to write."""
    heads = tl.arange(0, BLOCK_KV).to(tl.int64)
    ok = heads < KV
    position = tl.minimum(count, R - 1)
    tl.store(held_ptr + b * hl_sb + heads * hl_sh + position, tl.zeros_like(count) + unit, mask=add)
    tl.store(held_end_ptr + b * he_sb + heads * he_sh + position, tl.zeros_like(count), mask=add)
    marks_at = marks_ptr + b * mk_sb + heads * mk_sh
    tl.store(marks_at + replaced, tl.zeros([BLOCK_KV], tl.uint8), mask=add & (replaced >= 0) & (replaced < U))
    tl.store(marks_at + unit, tl.full([BLOCK_KV], 1, tl.uint8), mask=tl.where(add, unit < U, False))
    tl.store(held_count_ptr + b * hc_sb + heads, count + add.to(tl.int64), mask=ok)
    tl.store(seen_size_ptr + b * ss_sb + heads, size_now, mask=ok)
    tl.store(seen_admitted_ptr + b * sa_sb + heads, admitted_now, mask=ok)


@pdl_kernel
@triton.jit
def _follow_kernel(
    size_ptr, open_ptr, seen_open_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr,
    held_ptr, held_end_ptr, held_count_ptr, kept_ptr, mask_ptr, scores_ptr, middle_ptr,
    chal_ptr, flags_ptr, selectable_ptr,
    U, R, scale,
    sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, hl_sb, hl_sh, he_sb, he_sh, hc_sb, kp_sb, mk_sb, mk_sh, sc_sb, sc_sh,
    ch_sb, ch_sh, sl_sb, sl_sh,
    EVICT: tl.constexpr, LEAVING_UNHELD: tl.constexpr, RANK: tl.constexpr,
    CHALLENGERS: tl.constexpr, GC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_GC: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    unit = tl.load(open_ptr + b)
    appended, admitted, listed, size_now, admitted_now = leaving_token(
        b, h, h >= 0, unit, seen_open_ptr, size_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr, mask_ptr, U,
        sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, mk_sb, mk_sh)
    held_at = held_ptr + b * hl_sb + h * hl_sh
    end_at = held_end_ptr + b * he_sb + h * he_sh
    mask_at = mask_ptr + b * mk_sb + h * mk_sh
    add = appended & admitted & ~listed
    drop = appended & ~admitted
    count = tl.load(held_count_ptr + b * hc_sb + h)
    position = tl.minimum(count, R - 1)
    kept = tl.load(kept_ptr + b * kp_sb + h)  # read only when evicting
    # measure "rank": the held units' mean score (each held unit listed once)
    held_sum = tl.sum(tl.zeros([BLOCK_R], tl.float32), axis=0)
    held_n = tl.sum(tl.zeros([BLOCK_R], tl.float32), axis=0)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < R
        old = tl.load(held_at + rows, mask=ok, other=-1)
        end = tl.load(end_at + rows, mask=ok, other=0)
        taken = (rows == position) & add
        ids = tl.where(taken, unit, old)
        new_end = tl.where(taken, 0, end)
        if EVICT:  # the selected units whose last rows a leaving token took
            ids = tl.where(new_end > kept, -1, ids)
        if LEAVING_UNHELD:  # a held unit's token the buffer did not admit: not all attended
            ids = tl.where(drop & (old == unit), -1, ids)
        changed = ok & (ids != old)
        tl.store(held_at + rows, ids, mask=changed)
        tl.store(end_at + rows, new_end, mask=ok & (new_end != end))
        # the marks follow the list: a unit that left it unmarked, one that joined marked (never the same unit)
        tl.store(mask_at + old, tl.zeros([BLOCK_R], tl.uint8), mask=changed & (old >= 0) & (old < U))
        tl.store(mask_at + ids, tl.full([BLOCK_R], 1, tl.uint8), mask=changed & (ids >= 0) & (ids < U))
        if RANK:
            real = ok & (ids >= 0) & (ids < U)
            s = tl.load(scores_ptr + b * sc_sb + h * sc_sh + tl.maximum(ids, 0), mask=real,
                        other=float("-inf")) * scale
            finite = real & (s > float("-inf"))
            held_sum += tl.sum(tl.where(finite, s, 0.0), axis=0)
            held_n += tl.sum(finite.to(tl.float32), axis=0)
    if RANK:
        tl.store(middle_ptr + b * tl.num_programs(0) + h, held_sum / tl.maximum(held_n, 1.0))
    if CHALLENGERS:
        check_challengers(chal_ptr, flags_ptr, selectable_ptr, mask_at, b, h, U, ch_sb, ch_sh, sl_sb, sl_sh,
                          GC, BLOCK_GC)
    tl.store(held_count_ptr + b * hc_sb + h, count + add.to(tl.int64))
    tl.store(seen_size_ptr + b * ss_sb + h, size_now)
    tl.store(seen_admitted_ptr + b * sa_sb + h, admitted_now)


@pdl_kernel
@triton.jit
def _gap_blocks_kernel(
    scores_ptr, size_ptr, mask_ptr, at_selection_ptr, parts_ptr, middle_ptr, steps_ptr,
    scale, U, num_prompt_units, parts_sk, H, offset,
    sc_sb, sc_sh, sz_sb, sz_sh, mk_sb, mk_sh, pt_sb, pt_sh,
    MASS: tl.constexpr, RANK: tl.constexpr, LEAVING_IGNORED: tl.constexpr, EVERY: tl.constexpr,
    BLOCK_U: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if EVERY > 1:
        if not _measures(steps_ptr, b, offset, EVERY):
            return  # a step between measured ones: nothing marked, and the decide launch reads no part
    ids = block * BLOCK_U + tl.arange(0, BLOCK_U).to(tl.int64)
    ok = ids < U
    s = tl.load(scores_ptr + b * sc_sb + h * sc_sh + ids, mask=ok, other=float("-inf")) * scale
    mask_at = mask_ptr + b * mk_sb + h * mk_sh + ids
    held = tl.load(mask_at, mask=ok, other=0) != 0
    if MASS:
        sizes = tl.load(size_ptr + b * sz_sb + h * sz_sh + ids, mask=ok, other=1)
        s = s + tl.log(tl.maximum(sizes, 1).to(tl.float32))
    finite = s > float("-inf")
    candidate = ~held & finite
    if LEAVING_IGNORED:  # units opened since the selection that the buffer did not admit
        candidate = candidate & (ids < num_prompt_units + tl.load(at_selection_ptr + b))
    counted = held & finite
    # the block's parts: best unheld; held units counted; the weakest held score, or the held
    # log masses' max and their exp-sum below it (a logsumexp the decide launch combines)
    out = parts_ptr + b * pt_sb + h * pt_sh + block
    tl.store(out + parts_sk, tl.sum(counted.to(tl.float32), axis=0))
    if RANK:
        # the block's unheld units above the held units' mean score, and its candidates
        middle = tl.load(middle_ptr + b * H + h)
        tl.store(out, tl.sum((candidate & (s > middle)).to(tl.float32), axis=0))
        tl.store(out + 2 * parts_sk, tl.sum(candidate.to(tl.float32), axis=0))
    else:
        tl.store(out, tl.max(tl.where(candidate, s, float("-inf")), axis=0))
    if MASS:
        top = tl.max(tl.where(counted, s, float("-inf")), axis=0)
        # an infinite top shifts by 0, so an overflowed +inf score sums to +inf, as logsumexp's
        shift = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
        tl.store(out + 2 * parts_sk, top)
        tl.store(out + 3 * parts_sk, tl.sum(tl.where(counted, tl.exp(s - shift), 0.0), axis=0))
    elif not RANK:
        tl.store(out + 2 * parts_sk, tl.min(tl.where(counted, s, float("inf")), axis=0))


@triton.jit
def _combine_parts(parts_ptr, b, heads, H, S, parts_sk, pt_sb, pt_sh,
                   MASS: tl.constexpr, RANK: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Rows ``heads`` of sequence ``b``'s block parts combined, ``BLOCK_S`` blocks at a time: the held
    count; with ``RANK`` the counts above and of candidates; else the best unheld score and, with
    ``MASS``, the held units' running logsumexp (``top``, ``total``), or the weakest held score.
    ``CACHE``: the loads' cache modifier ("": the default; ".cg", past L1, where other programs of the same
    launch wrote the parts)."""
    held_count = tl.zeros(heads.shape, tl.float32)
    above = tl.zeros(heads.shape, tl.float32)
    candidates = tl.zeros(heads.shape, tl.float32)
    best_unheld = tl.full(heads.shape, float("-inf"), tl.float32)
    weakest = tl.full(heads.shape, float("inf"), tl.float32)
    top = tl.full(heads.shape, float("-inf"), tl.float32)
    total = tl.zeros(heads.shape, tl.float32)
    for start in range(0, S, BLOCK_S):
        blocks = start + tl.arange(0, BLOCK_S)
        tile = (heads[:, None] < H) & (blocks[None, :] < S)
        at = parts_ptr + b * pt_sb + heads[:, None] * pt_sh + blocks[None, :]
        held_count += tl.sum(tl.load(at + parts_sk, mask=tile, other=0.0, cache_modifier=CACHE), axis=1)
        if RANK:
            above += tl.sum(tl.load(at, mask=tile, other=0.0), axis=1)
            candidates += tl.sum(tl.load(at + 2 * parts_sk, mask=tile, other=0.0), axis=1)
        elif MASS:
            best_unheld = tl.maximum(best_unheld, tl.max(tl.load(at, mask=tile, other=float("-inf"),
                                                                 cache_modifier=CACHE), axis=1))
            tops = tl.load(at + 2 * parts_sk, mask=tile, other=float("-inf"), cache_modifier=CACHE)
            sums = tl.load(at + 3 * parts_sk, mask=tile, other=0.0, cache_modifier=CACHE)
            new_top = tl.maximum(top, tl.max(tops, axis=1))
            old_shift = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
            new_shift = tl.where((new_top > float("-inf")) & (new_top < float("inf")), new_top, 0.0)
            total = tl.where(total > 0, total * tl.exp(old_shift - new_shift), total)
            total += tl.sum(sums * tl.exp(tops - new_shift[:, None]), axis=1)
            top = new_top
        else:
            best_unheld = tl.maximum(best_unheld, tl.max(tl.load(at, mask=tile, other=float("-inf")), axis=1))
            weakest = tl.minimum(weakest, tl.min(tl.load(at + 2 * parts_sk, mask=tile, other=float("inf")), axis=1))
    return held_count, above, candidates, best_unheld, weakest, top, total


@pdl_kernel
@triton.jit
def _row_parts_kernel(parts_ptr, out_ptr, H, S, parts_sk, pt_sb, pt_sh, out_sk, out_sb, out_sh,
                      flags_ptr, steps_ptr, mass_ptr, chal_ptr, KV, U, S_BETWEEN, offset, ms_sb, ms_sr, ch_sb,
                      MASS: tl.constexpr, RANK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                      CHALLENGERS: tl.constexpr, EVERY: tl.constexpr, C: tl.constexpr, BLOCK_KV: tl.constexpr,
                      BLOCK_B: tl.constexpr, BLOCK_U: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_H`` rows of a sequence's block parts combined into one block's parts each (as
    ``_combine_parts``), so the decide launch, one program a sequence, reads a part a row. With
    ``CHALLENGERS`` (``score_gap_challengers``; ``KV`` heads' flags say which step this is): a step
    between measured ones has ``S_BETWEEN`` parts a row (a chunk of the held list each, then the
    challengers'); on a measured one the rows' next challengers are merged from the candidates' masses
    (``merge_challengers``)."""
    wait_for_previous(PDL)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1).to(tl.int64)
    parts_read = S
    if CHALLENGERS:
        whole = measures_whole(flags_ptr, steps_ptr, b, offset, KV, EVERY, BLOCK_KV)
        if whole:
            rows = heads.to(tl.int64)
            merge_challengers(parts_ptr + b * pt_sb + rows * pt_sh, mass_ptr + b * ms_sb + rows * ms_sr,
                              chal_ptr + b * ch_sb + rows * C, heads < H, S, U, C, BLOCK_H, BLOCK_B, BLOCK_U)
        # (a where: S may be a compile-time 1, which an if cannot reassign)
        parts_read = tl.where(whole, S, S_BETWEEN)
    held_count, above, candidates, best_unheld, weakest, top, total = _combine_parts(
        parts_ptr, b, heads, H, parts_read, parts_sk, pt_sb, pt_sh, MASS, RANK, BLOCK_S, "")
    out = out_ptr + b * out_sb + heads * out_sh
    ok = heads < H
    tl.store(out + out_sk, held_count, mask=ok)
    if RANK:
        tl.store(out, above, mask=ok)
        tl.store(out + 2 * out_sk, candidates, mask=ok)
    elif MASS:
        tl.store(out, best_unheld, mask=ok)
        tl.store(out + 2 * out_sk, top, mask=ok)
        tl.store(out + 3 * out_sk, total, mask=ok)
    else:
        tl.store(out, best_unheld, mask=ok)
        tl.store(out + 2 * out_sk, weakest, mask=ok)


@pdl_kernel
@triton.jit
def _decide_kernel(
    parts_ptr, H, S, parts_sk, pt_sb, pt_sh, steps_ptr, offset,
    has_ptr, above_ptr, open_ptr, seen_open_ptr, fire_ptr, out_gap_ptr, age_ptr, margin, follow_margin, cap,
    noted_ptr, count_ptr, boundary_ptr, slot_ptr, reselect_ptr, boundary_sb,
    lv_open_ptr, lv_seen_open_ptr, lv_size_ptr, lv_seen_size_ptr, lv_admitted_ptr, lv_seen_admitted_ptr, lv_marks_ptr,
    lv_held_ptr, lv_end_ptr, lv_count_ptr, KV, U, R,
    lv_sz_sb, lv_sz_sh, lv_ss_sb, lv_ad_sb, lv_sa_sb, lv_mk_sb, lv_mk_sh, lv_hl_sb, lv_hl_sh, lv_he_sb, lv_he_sh,
    lv_hc_sb,
    MASS: tl.constexpr, RANK: tl.constexpr, FOLLOW: tl.constexpr, CAP: tl.constexpr, NOTE: tl.constexpr,
    EVERY: tl.constexpr, CHALLENGERS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    LEAVING: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr,
):
    """A program a sequence: its decision (``decide_sequence``); with ``LEAVING``, first the follow launch's
    writes (``read_leaving_token``, ``write_leaving_token``), where the launches before it read the held marks as
    they were."""
    wait_for_previous(PDL)
    if LEAVING:
        b = tl.program_id(0).to(tl.int64)
        unit, add, count, replaced, size_now, admitted_now = read_leaving_token(
            b, lv_open_ptr, lv_seen_open_ptr, lv_size_ptr, lv_seen_size_ptr, lv_admitted_ptr, lv_seen_admitted_ptr,
            lv_marks_ptr, lv_held_ptr, lv_end_ptr, lv_count_ptr, KV, U, R, lv_sz_sb, lv_sz_sh, lv_ss_sb, lv_ad_sb,
            lv_sa_sb, lv_mk_sb, lv_mk_sh, lv_hl_sb, lv_hl_sh, lv_he_sb, lv_he_sh, lv_hc_sb, BLOCK_KV)
        write_leaving_token(
            b, unit, add, count, replaced, size_now, admitted_now, lv_open_ptr, lv_seen_open_ptr, lv_size_ptr,
            lv_seen_size_ptr, lv_admitted_ptr, lv_seen_admitted_ptr, lv_marks_ptr, lv_held_ptr, lv_end_ptr,
            lv_count_ptr, KV, U, R, lv_sz_sb, lv_sz_sh, lv_ss_sb, lv_ad_sb, lv_sa_sb, lv_mk_sb, lv_mk_sh, lv_hl_sb,
            lv_hl_sh, lv_he_sb, lv_he_sh, lv_hc_sb, BLOCK_KV)
        tl.debug_barrier()  # its reads of ``seen_open`` before the decision writes it
    decide_sequence(
        tl.program_id(0).to(tl.int64), parts_ptr, H, S, parts_sk, pt_sb, pt_sh, steps_ptr, offset,
        has_ptr, above_ptr, open_ptr, seen_open_ptr, fire_ptr, out_gap_ptr, age_ptr, margin, follow_margin, cap,
        noted_ptr, count_ptr, boundary_ptr, slot_ptr, reselect_ptr, boundary_sb,
        MASS, RANK, FOLLOW, CAP, NOTE, EVERY, CHALLENGERS, BLOCK_H, BLOCK_S, "")


@triton.jit
def decide_sequence(
    b, parts_ptr, H, S, parts_sk, pt_sb, pt_sh, steps_ptr, offset,
    has_ptr, above_ptr, open_ptr, seen_open_ptr, fire_ptr, out_gap_ptr, age_ptr, margin, follow_margin, cap,
    noted_ptr, count_ptr, boundary_ptr, slot_ptr, reselect_ptr, boundary_sb,
    MASS: tl.constexpr, RANK: tl.constexpr, FOLLOW: tl.constexpr, CAP: tl.constexpr, NOTE: tl.constexpr,
    EVERY: tl.constexpr, CHALLENGERS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Sequence ``b``'s decision from its ``H`` rows of ``S`` block parts (``_decide_kernel``'s program, or the
    outlier blocks launch's last program of the sequence, whose ``CACHE`` reads past L1)."""
    heads = tl.arange(0, BLOCK_H)
    held_count, above, candidates, best_unheld, weakest, top, total = _combine_parts(
        parts_ptr, b, heads, H, S, parts_sk, pt_sb, pt_sh, MASS, RANK, BLOCK_S, CACHE)
    any_held = held_count > 0
    if RANK:
        gap = tl.where(~any_held & (candidates > 0), float("inf"), above)
    elif MASS:
        some = top > float("-inf")
        held_mass = tl.where(some, top + tl.log(tl.where(some, total, 1.0)), float("-inf"))
        gap = best_unheld - held_mass
    else:
        gap = tl.where(any_held, best_unheld - weakest,
                       tl.where(best_unheld > float("-inf"), float("inf"), float("-inf")))
    gap = tl.where(heads < H, gap, float("-inf"))
    # the worst head decides; a NaN head (nothing held or unheld, in mass) makes a NaN gap, as amax
    nan = tl.max((gap != gap).to(tl.int32), axis=0) > 0
    worst = tl.where(nan, float("nan"), tl.max(tl.where(gap != gap, float("-inf"), gap), axis=0))
    if EVERY > 1:
        if not CHALLENGERS:  # a step between measured ones has no gap (its block parts were not written)
            worst = tl.where(_measures(steps_ptr, b, offset, EVERY), worst, float("-inf"))
        tl.store(steps_ptr + b, tl.load(steps_ptr + b) + 1)
    fire = (worst > margin) | (tl.load(has_ptr + b) == 0)
    if FOLLOW:  # the layer above re-selected at this step: a lower margin
        fire = fire | ((tl.load(above_ptr + b) != 0) & (worst > follow_margin))
    if CAP:  # steps since the last selection, this one included: at most ``cap``
        age = tl.load(age_ptr + b) + 1
        tl.store(age_ptr + b, age)
        fire = fire | (age >= cap)
    tl.store(fire_ptr + b, fire.to(tl.uint8))
    tl.store(out_gap_ptr + b, tl.where(worst > 1e4, 1e4, tl.where(worst < -1e4, -1e4, worst)))
    tl.store(seen_open_ptr + b, tl.load(open_ptr + b))
    if NOTE:  # note_decision's work for this sequence: the layer's decision, its boundary and counters
        note_rows(fire, b, True, noted_ptr, count_ptr, boundary_ptr, slot_ptr, reselect_ptr, boundary_sb)


def held_marks(state, units: int) -> torch.Tensor:
    """The state's ``(B, H, U)`` held marks over a table of ``units``: 1 where the held list lists the unit. Made
    from the list where the state has none or the table grew (outside the step: a table grows in the layer's
    plan, before it); the ops that change the list keep them in step."""
    marks = state.held_marks
    batch, heads = state.held.shape[:2]
    if marks is None or marks.shape != (batch, heads, units) or marks.device != state.held.device:
        marks = held_units_mask(state.held, units).to(torch.uint8)
        state.held_marks = marks
    return marks


@implement("triton", "score_gap_fire", supports=triton_runs_on)
def score_gap_fire(trigger, state, scores: torch.Tensor, scale: float, *, decision=None) -> torch.Tensor:
    """Three or four launches of ``reference_step.score_gap_fire`` (the last also writes ``decision``)."""
    batch, heads, units = scores.shape
    layer = state.layer
    table = layer.units
    device = scores.device
    fire = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return fire
    for name, t in (("scores", scores), ("held", state.held), ("held_end", state.held_end),
                    ("units.size", table.size)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton score_gap_fire: {name} must be contiguous in its last dim")
    why = unsupported(trigger)
    if why is not None:
        raise ConfigError(why)
    if trigger.estimate == "outlier":
        raise ConfigError("triton score_gap_fire: estimate 'outlier' scores its own keys; call "
                          "score_gap_outlier_fire (ScoreGap does)")
    if units != table.capacity:
        raise ValueError(f"triton score_gap_fire: scores must cover the unit table's {table.capacity} units, got {units}")
    mask = held_marks(state, units)
    rank = trigger.measure == "rank"
    middle = torch.empty(batch, heads, dtype=torch.float32, device=device) if rank else state.gap  # read if rank
    follow_and_mark(trigger, state, mask, scores, middle, scale, rank)
    mass = trigger.measure == "mass"
    block = min(_GAP_BLOCK, triton.next_power_of_2(max(units, 1)))
    blocks = triton.cdiv(units, block)
    parts = torch.empty(4, batch, heads, blocks, dtype=torch.float32, device=device)
    _gap_blocks_kernel[(blocks, heads, batch)](
        scores, table.size, mask, state.units_at_selection, parts, middle, state.steps,
        float(scale), units, int(table.num_prompt_units), parts.stride(0), heads, step_offset(trigger, layer),
        *scores.stride()[:2], *table.size.stride()[:2], *mask.stride()[:2], *parts.stride()[1:3],
        MASS=mass, RANK=rank, LEAVING_IGNORED=trigger.leaving == "ignored", EVERY=trigger.every,
        BLOCK_U=block,
    )
    decide_from_parts(trigger, state, parts, fire, mass, rank, decision)
    return fire


def step_offset(trigger, layer) -> int:
    """The layer's offset in ``trigger.every``'s steps: layer ``i`` measures at the steps ``s`` where
    ``(s + i) % every`` is 0 (``reference_step._fire_on_gap``)."""
    return layer.layer_idx % trigger.every


def follow_and_mark(trigger, state, mask: torch.Tensor, scores: torch.Tensor, middle: torch.Tensor,
                    scale: float, rank: bool, challengers: torch.Tensor | None = None,
                    flags: torch.Tensor | None = None) -> None:
    """The first launch of a fused score-gap step (``_follow_kernel``): follow the leaving token in
    the held list and mark the held units in ``mask``; with ``rank``, the held units' mean of
    ``scores * scale`` into ``middle`` (otherwise neither is read). Given the ``(B, H, G, C)``
    ``challengers``, each KV head's check of them into ``flags (B, H)`` (``check_challengers``)."""
    layer = state.layer
    table, store = layer.units, layer.store
    batch, heads, room = state.held.shape
    evict = layer.policy.admit == "evict"
    kept = store.kept if evict else store.admitted  # read only when evicting
    challenging = challengers is not None
    # without challengers, any tensors of the right kinds as placeholders (never read)
    chal, flags, selectable = (challengers, flags, table.selectable.view(torch.uint8)) if challenging else (
        state.held, state.held_count, mask)
    per_head = chal.shape[-2] * chal.shape[-1] if challenging else 1
    _follow_kernel[(heads, batch)](
        table.size, table.open_unit, state.seen_open, state.seen_size, store.admitted, state.seen_admitted,
        state.held, state.held_end, state.held_count, kept, mask, scores, middle,
        chal, flags, selectable,
        mask.shape[-1], room, float(scale),
        *table.size.stride()[:2], state.seen_size.stride(0), store.admitted.stride(0),
        state.seen_admitted.stride(0), *state.held.stride()[:2], *state.held_end.stride()[:2],
        state.held_count.stride(0), kept.stride(0), *mask.stride()[:2], *scores.stride()[:2],
        *chal.stride()[:2], *selectable.stride()[:2],
        EVICT=evict, LEAVING_UNHELD=trigger.leaving == "unheld", RANK=rank,
        CHALLENGERS=challenging, GC=per_head, BLOCK_R=min(4096, triton.next_power_of_2(room)),
        BLOCK_GC=max(16, triton.next_power_of_2(per_head)),
    )


def decide_from_parts(trigger, state, parts: torch.Tensor, fire: torch.Tensor, mass: bool, rank: bool,
                      decision, challenge=None, leaving: bool = False) -> None:
    """The last launch of a fused score-gap step (``_decide_kernel``): combine the ``(4, B, rows,
    blocks)`` block parts (a row a KV head, or a query head), decide into ``fire`` with the layer's
    margin, ``follow`` and ``cap``, and write ``decision`` when given. ``challenge``: the outlier op's
    ``score_gap_challengers.Challenge``: the row stage then always runs, and merges the next challengers.
    ``leaving``: it also makes the follow launch's writes (``write_leaving_token``), where no follow launch ran."""
    layer = state.layer
    rows, blocks = parts.shape[2], parts.shape[3]
    if blocks > _DECIDE_BLOCK or challenge is not None:
        # one program a sequence reading every row's blocks ran latency-bound (15 us a layer at 256
        # blocks a row, H100, session 25): first a part a row, from programs of a few rows each
        row_parts = torch.empty(4, parts.shape[1], rows, 1, dtype=parts.dtype, device=parts.device)
        if challenge is not None:
            c = challenge
            blocks = c.blocks  # a measured step's parts; a step between has c.between_parts (the kernel picks)
            chal_args = (c.flags, state.steps, c.mass, c.ids, c.flags.shape[-1], c.mass.shape[-1], c.between_parts,
                         step_offset(trigger, layer), *c.mass.stride()[:2], c.ids.stride(0))
            chal_settings = dict(CHALLENGERS=True, EVERY=trigger.every, C=c.ids.shape[-1],
                                 BLOCK_KV=triton.next_power_of_2(c.flags.shape[-1]),
                                 BLOCK_B=triton.next_power_of_2(c.blocks), BLOCK_U=c.block)
        else:  # any tensors of the right kinds as placeholders (never read)
            chal_args = (state.held_count, state.steps, parts, state.held, 1, 1, 1, 0, 0, 0, 0)
            chal_settings = dict(CHALLENGERS=False, EVERY=trigger.every, C=1, BLOCK_KV=1, BLOCK_B=1, BLOCK_U=16)
        _row_parts_kernel[(triton.cdiv(rows, _ROW_BLOCK), parts.shape[1])](
            parts, row_parts, rows, blocks, parts.stride(0), *parts.stride()[1:3],
            row_parts.stride(0), *row_parts.stride()[1:3], *chal_args,
            MASS=mass, RANK=rank, BLOCK_H=_ROW_BLOCK, BLOCK_S=min(_ROW_SPAN, triton.next_power_of_2(blocks)),
            **chal_settings,
        )
        parts, blocks = row_parts, 1
    inputs, settings = decision_inputs(trigger, state, fire, decision)
    _decide_kernel[(fire.shape[0],)](
        parts, rows, blocks, parts.stride(0), *parts.stride()[1:3], state.steps, step_offset(trigger, layer),
        *inputs, *leaving_inputs(state), MASS=mass, RANK=rank, EVERY=trigger.every, CHALLENGERS=challenge is not None,
        BLOCK_H=triton.next_power_of_2(rows), BLOCK_S=min(_DECIDE_BLOCK, triton.next_power_of_2(blocks)),
        LEAVING=leaving, BLOCK_KV=triton.next_power_of_2(state.held.shape[1]), **settings,
    )


def leaving_inputs(state) -> tuple:
    """What ``read_leaving_token`` and ``write_leaving_token`` read and write (the kernels' arguments from
    ``lv_open_ptr`` to ``lv_hc_sb``): the table's open unit and sizes, the buffer's admitted counts, the state's
    last look, held marks (made where missing: ``held_marks``), held list, ends and counts, then their sizes and
    strides."""
    table, store = state.layer.units, state.layer.store
    marks = held_marks(state, table.capacity)
    return (table.open_unit, state.seen_open, table.size, state.seen_size, store.admitted, state.seen_admitted, marks,
            state.held, state.held_end, state.held_count, state.held.shape[1], table.capacity, state.held.shape[2],
            *table.size.stride()[:2], state.seen_size.stride(0), store.admitted.stride(0),
            state.seen_admitted.stride(0), *marks.stride()[:2], *state.held.stride()[:2],
            *state.held_end.stride()[:2], state.held_count.stride(0))


def decision_inputs(trigger, state, fire: torch.Tensor, decision) -> tuple[tuple, dict]:
    """What ``decide_sequence`` reads and writes besides the parts and the step count: its runtime arguments from
    ``has_ptr`` to ``boundary_sb``, and its ``FOLLOW``, ``CAP`` and ``NOTE`` settings (``decision``, the layer's
    ``Decision``, or None)."""
    layer = state.layer
    follow = trigger.follow > 0 and state.above is not None
    margin = trigger.margin_of(layer.layer_idx)  # a host number per layer: a captured step keeps its own
    above = state.above.reselect if follow else state.has_selection  # read only when following
    cap = trigger.cap > 0
    age = state.age if cap else layer.units.open_unit  # read only with a cap
    note = decision is not None
    # without a decision, any tensors of the right kinds as placeholders (never read: NOTE False)
    noted, count, boundary, slot, reselect = decision if note else (fire, age, fire.view(1, -1), age, fire)
    inputs = (state.has_selection.view(torch.uint8), above.view(torch.uint8), layer.units.open_unit, state.seen_open,
              fire.view(torch.uint8), state.gap, age, float(margin), float(margin - trigger.follow) if follow else 0.0,
              int(trigger.cap), noted.view(torch.uint8), count, boundary.view(torch.uint8), slot,
              reselect.view(torch.uint8), boundary.stride(0))
    return inputs, dict(FOLLOW=follow, CAP=cap, NOTE=note)


def unsupported(trigger) -> str | None:
    """Why the fused ops cannot run ``trigger``'s options (None where they can): the measures
    ``weakest``, ``mass`` and ``rank``, ``cap``, ``margins``, ``follow`` and both ``leaving``s, with
    ``estimate`` ``"mean"`` or ``"outlier"`` (its own op, ``score_gap_outlier_fire``), ``group="each"``
    with ``"outlier"`` only (``challengers`` too), ``count=0`` and ``low_rank=0`` (the others are the reference's)."""
    wrong = []
    if trigger.estimate not in ("mean", "outlier"):
        wrong.append(f"estimate={trigger.estimate!r} (accepted: 'mean', 'outlier')")
    if trigger.group != "mean" and trigger.estimate != "outlier":
        wrong.append(f"group={trigger.group!r} (accepted: 'mean'; 'each' with estimate 'outlier')")
    if trigger.count not in (0, 0.0):
        wrong.append(f"count={trigger.count!r} (accepted: 0)")
    if getattr(trigger, "low_rank", 0):
        wrong.append(f"low_rank={trigger.low_rank!r} (accepted: 0)")
    if not wrong:
        return None
    return ("score_gap trigger: the triton backend's score_gap_fire does not implement " + ", ".join(wrong) +
            "; use those values, or backend='reference'")


score_gap_fire.unsupported = unsupported


@pdl_kernel
@triton.jit
def _selected_kernel(
    ids_ptr, take_ptr, size_ptr, open_ptr, decode_units_ptr, admitted_ptr,
    held_ptr, held_end_ptr, held_count_ptr, seen_open_ptr, seen_size_ptr, seen_admitted_ptr,
    at_selection_ptr, has_ptr, age_ptr, marks_ptr,
    K, R, capacity, U,
    id_sb, id_sh, sz_sb, sz_sh, ad_sb, hl_sb, hl_sh, he_sb, he_sh, hc_sb, ss_sb, sa_sb, mk_sb, mk_sh,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    # the old list's marks cleared, then (after a barrier: a unit may be in both lists) the new one's set
    marks_at = marks_ptr + b * mk_sb + h * mk_sh
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        old = tl.load(held_ptr + b * hl_sb + h * hl_sh + rows, mask=rows < R, other=-1)
        tl.store(marks_at + old, tl.zeros([BLOCK_R], tl.uint8), mask=(old >= 0) & (old < U))
    tl.debug_barrier()
    sizes_at = size_ptr + b * sz_sb + h * sz_sh
    carry = tl.sum(tl.zeros([BLOCK_R], tl.int64), axis=0)  # the sizes summed so far
    count = tl.sum(tl.zeros([BLOCK_R], tl.int64), axis=0)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < R
        ids = tl.load(ids_ptr + b * id_sb + h * id_sh + rows, mask=ok & (rows < K), other=-1)
        listed = ids >= 0
        sizes = tl.load(sizes_at + tl.maximum(ids, 0), mask=ok & listed, other=0)
        ends = tl.minimum(carry + tl.cumsum(sizes, axis=0), capacity)
        tl.store(held_ptr + b * hl_sb + h * hl_sh + rows, ids, mask=ok)
        tl.store(held_end_ptr + b * he_sb + h * he_sh + rows, tl.where(listed, ends, 0), mask=ok)
        tl.store(marks_at + ids, tl.full([BLOCK_R], 1, tl.uint8), mask=ok & listed & (ids < U))
        carry += tl.sum(sizes, axis=0)
        count += tl.sum(listed.to(tl.int64), axis=0)
    tl.store(held_count_ptr + b * hc_sb + h, count)
    unit = tl.load(open_ptr + b)
    tl.store(seen_size_ptr + b * ss_sb + h, tl.load(sizes_at + tl.maximum(unit, 0)))
    tl.store(seen_admitted_ptr + b * sa_sb + h, tl.load(admitted_ptr + b * ad_sb + h))
    if h == 0:  # per-sequence state: one program of the sequence owns it
        tl.store(seen_open_ptr + b, unit)
        tl.store(at_selection_ptr + b, tl.load(decode_units_ptr + b))
        tl.store(has_ptr + b, tl.full([], 1, tl.uint8))
        tl.store(age_ptr + b, tl.zeros([], tl.int64))


@implement("triton", "score_gap_selected", supports=triton_runs_on)
def score_gap_selected(state, unit_ids: torch.Tensor, reselect: torch.Tensor) -> None:
    """One launch of ``reference_step.score_gap_selected``."""
    batch, heads, listed = unit_ids.shape
    if batch * heads == 0:
        return
    table, store = state.layer.units, state.layer.store
    for name, t in (("unit_ids", unit_ids), ("held", state.held), ("held_end", state.held_end),
                    ("units.size", table.size)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton score_gap_selected: {name} must be contiguous in its last dim")
    room = state.held.shape[-1]
    marks = held_marks(state, table.capacity)
    _selected_kernel[(heads, batch)](
        unit_ids, reselect.view(torch.uint8), table.size, table.open_unit, table.decode_units, store.admitted,
        state.held, state.held_end, state.held_count, state.seen_open, state.seen_size, state.seen_admitted,
        state.units_at_selection, state.has_selection.view(torch.uint8), state.age, marks,
        listed, room, store.retrieval_capacity, table.capacity,
        *unit_ids.stride()[:2], *table.size.stride()[:2], store.admitted.stride(0),
        *state.held.stride()[:2], *state.held_end.stride()[:2], state.held_count.stride(0),
        state.seen_size.stride(0), state.seen_admitted.stride(0), *marks.stride()[:2],
        BLOCK_R=min(1024, triton.next_power_of_2(room)),
    )
