"""Triton score-gap trigger ops: its step (``score_gap_fire``), two launches where the reference
(``kernels/reference_step.py``) takes about sixty small ones, and its bookkeeping after a
re-selection (``score_gap_selected``), one launch where the reference takes about twenty.

On a step that keeps its selection this is what the louiskv preset's trigger adds to the unit
scoring, and every small launch of a replayed graph costs about what it runs, so it is fused:

1. ``_follow_and_gap_kernel``, one program per (KV head, sequence): follows the token that
   left the local window in the held list, scatters the held list into that head's row of a
   byte mask, then reads the scores once, taking the best unheld unit and the held units' side
   (the weakest score, or the log of their estimated mass) and clearing the mask behind it.
2. ``_decide_kernel``, one program: the largest gap over the heads decides each sequence.

The mask is a scratch row per (sequence, head) that is all zeros between steps (each step
clears what it set), so no launch zeroes it. Per-sequence state (``seen_open``) is written by
the second launch, after every head read it.

``_selected_kernel``, one program per (KV head, sequence) that re-selected: the held list
becomes the selection's units, each with the buffer row where it ends (a running sum of sizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on


@triton.jit
def _follow_and_gap_kernel(
    scores_ptr, size_ptr, open_ptr, seen_open_ptr, seen_size_ptr, admitted_ptr, seen_admitted_ptr,
    held_ptr, held_end_ptr, held_count_ptr, kept_ptr, at_selection_ptr, mask_ptr, gap_ptr,
    scale, H, U, R, num_prompt_units,
    sc_sb, sc_sh, sz_sb, sz_sh, ss_sb, ad_sb, sa_sb, hl_sb, hl_sh, he_sb, he_sh, hc_sb, kp_sb, mk_sb, mk_sh,
    MASS: tl.constexpr, EVICT: tl.constexpr, LEAVING_UNHELD: tl.constexpr, LEAVING_IGNORED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    # what the last step's leaving token did: the open unit took it (moved on, or grew) and the
    # retrieved buffer admitted it (its count grew) or not
    unit = tl.load(open_ptr + b)
    size_now = tl.load(size_ptr + b * sz_sb + h * sz_sh + tl.maximum(unit, 0))
    moved = unit != tl.load(seen_open_ptr + b)
    appended = (unit >= 0) & (moved | (size_now != tl.load(seen_size_ptr + b * ss_sb + h)))
    admitted_now = tl.load(admitted_ptr + b * ad_sb + h)
    admitted = admitted_now > tl.load(seen_admitted_ptr + b * sa_sb + h)
    held_at = held_ptr + b * hl_sb + h * hl_sh
    end_at = held_end_ptr + b * he_sb + h * he_sh
    listed = tl.sum(tl.zeros([BLOCK_R], tl.int32), axis=0)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(held_at + rows, mask=rows < R, other=-1)
        listed += tl.sum((ids == unit).to(tl.int32), axis=0)
    add = appended & admitted & (listed == 0)
    drop = appended & ~admitted
    count = tl.load(held_count_ptr + b * hc_sb + h)
    position = tl.minimum(count, R - 1)
    kept = tl.load(kept_ptr + b * kp_sb + h)  # read only when evicting
    mask_at = mask_ptr + b * mk_sb + h * mk_sh
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
        tl.store(held_at + rows, ids, mask=ok & (ids != old))
        tl.store(end_at + rows, new_end, mask=ok & (new_end != end))
        tl.store(mask_at + ids, tl.full([BLOCK_R], 1, tl.uint8), mask=ok & (ids >= 0) & (ids < U))
    tl.store(held_count_ptr + b * hc_sb + h, count + add.to(tl.int64))
    tl.store(seen_size_ptr + b * ss_sb + h, size_now)
    tl.store(seen_admitted_ptr + b * sa_sb + h, admitted_now)
    tl.debug_barrier()  # the mask's writes are seen by the whole program before it is read

    first_new = num_prompt_units + tl.load(at_selection_ptr + b)
    best_unheld = tl.full([], float("-inf"), tl.float32)
    held_side = tl.full([], float("inf"), tl.float32)  # weakest: the lowest held score
    held_max = tl.full([], float("-inf"), tl.float32)  # mass: a running logsumexp of the held
    held_sum = tl.full([], 0.0, tl.float32)
    any_held = tl.full([], 0, tl.int32)
    scores_at = scores_ptr + b * sc_sb + h * sc_sh
    for u0 in range(0, U, BLOCK_U):
        ids = u0 + tl.arange(0, BLOCK_U)
        ok = ids < U
        s = tl.load(scores_at + ids, mask=ok, other=float("-inf")) * scale
        marked = tl.load(mask_at + ids, mask=ok, other=0)
        tl.store(mask_at + ids, tl.zeros([BLOCK_U], tl.uint8), mask=marked != 0)
        is_held = marked != 0
        if MASS:
            sizes = tl.load(size_ptr + b * sz_sb + h * sz_sh + ids, mask=ok, other=1)
            s = s + tl.log(tl.maximum(sizes, 1).to(tl.float32))
        finite = s > float("-inf")
        candidate = ~is_held & finite
        if LEAVING_IGNORED:  # units opened since the selection that the buffer did not admit
            candidate = candidate & (ids < first_new)
        best_unheld = tl.maximum(best_unheld, tl.max(tl.where(candidate, s, float("-inf")), axis=0))
        counted = is_held & finite
        any_held += tl.sum(counted.to(tl.int32), axis=0)
        if MASS:
            block_max = tl.max(tl.where(counted, s, float("-inf")), axis=0)
            new_max = tl.maximum(held_max, block_max)
            shift = tl.where(new_max > float("-inf"), new_max, 0.0)
            held_sum = held_sum * tl.exp(held_max - shift) + tl.sum(tl.where(counted, tl.exp(s - shift), 0.0), axis=0)
            held_max = new_max
        else:
            held_side = tl.minimum(held_side, tl.min(tl.where(counted, s, float("inf")), axis=0))
    if MASS:
        some = held_max > float("-inf")
        held_mass = tl.where(some, held_max + tl.log(tl.where(some, held_sum, 1.0)), float("-inf"))
        gap = best_unheld - held_mass
    else:
        nothing_held = any_held == 0
        gap = tl.where(nothing_held, tl.where(best_unheld > float("-inf"), float("inf"), float("-inf")),
                       best_unheld - held_side)
    tl.store(gap_ptr + b * H + h, gap)


@triton.jit
def _decide_kernel(
    gap_ptr, has_ptr, above_ptr, open_ptr, seen_open_ptr, fire_ptr, out_gap_ptr,
    B, H, margin, follow_margin,
    FOLLOW: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.arange(0, BLOCK_B)
    heads = tl.arange(0, BLOCK_H)
    ok = b < B
    tile = ok[:, None] & (heads[None, :] < H)
    g = tl.load(gap_ptr + b[:, None] * H + heads[None, :], mask=tile, other=float("-inf"))
    # the worst head decides; a NaN head (nothing held or unheld, in mass) makes a NaN gap, as amax
    nan = tl.max((g != g).to(tl.int32), axis=1) > 0
    gap = tl.where(nan, float("nan"), tl.max(tl.where(g != g, float("-inf"), g), axis=1))
    fire = (gap > margin) | (tl.load(has_ptr + b, mask=ok, other=1) == 0)
    if FOLLOW:  # the layer above re-selected at this step: a lower margin
        fire = fire | ((tl.load(above_ptr + b, mask=ok, other=0) != 0) & (gap > follow_margin))
    tl.store(fire_ptr + b, fire.to(tl.uint8), mask=ok)
    tl.store(out_gap_ptr + b, tl.where(gap > 1e4, 1e4, tl.where(gap < -1e4, -1e4, gap)), mask=ok)
    tl.store(seen_open_ptr + b, tl.load(open_ptr + b, mask=ok, other=0), mask=ok)


def _scratch_mask(state, batch: int, heads: int, units: int, device: torch.device) -> torch.Tensor:
    """The state's ``(B, H, U)`` byte mask, all zeros between steps; made again when the table
    grew (outside the step: a table grows in the layer's plan, before it)."""
    mask = getattr(state, "held_scratch", None)
    if mask is None or mask.shape != (batch, heads, units) or mask.device != device:
        mask = torch.zeros(batch, heads, units, dtype=torch.uint8, device=device)
        state.held_scratch = mask
    return mask


@implement("triton", "score_gap_fire", supports=triton_runs_on)
def score_gap_fire(trigger, state, scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Two launches of ``reference_step.score_gap_fire``."""
    batch, heads, units = scores.shape
    layer = state.layer
    table, store = layer.units, layer.store
    device = scores.device
    fire = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return fire
    for name, t in (("scores", scores), ("held", state.held), ("held_end", state.held_end),
                    ("units.size", table.size)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton score_gap_fire: {name} must be contiguous in its last dim")
    room = state.held.shape[-1]
    mask = _scratch_mask(state, batch, heads, units, device)
    gaps = torch.empty(batch, heads, dtype=torch.float32, device=device)
    evict = layer.policy.admit == "evict"
    kept = store.kept if evict else store.admitted  # read only when evicting
    _follow_and_gap_kernel[(heads, batch)](
        scores, table.size, table.open_unit, state.seen_open, state.seen_size, store.admitted, state.seen_admitted,
        state.held, state.held_end, state.held_count, kept, state.units_at_selection, mask, gaps,
        float(scale), heads, units, room, int(table.num_prompt_units),
        *scores.stride()[:2], *table.size.stride()[:2], state.seen_size.stride(0), store.admitted.stride(0),
        state.seen_admitted.stride(0), *state.held.stride()[:2], *state.held_end.stride()[:2],
        state.held_count.stride(0), kept.stride(0), *mask.stride()[:2],
        MASS=trigger.measure == "mass", EVICT=evict, LEAVING_UNHELD=trigger.leaving == "unheld",
        LEAVING_IGNORED=trigger.leaving == "ignored",
        BLOCK_R=min(1024, triton.next_power_of_2(room)), BLOCK_U=min(1024, triton.next_power_of_2(units)),
    )
    follow = trigger.follow > 0 and state.above is not None
    above = state.above.reselect if follow else state.has_selection  # read only when following
    _decide_kernel[(1,)](
        gaps, state.has_selection.view(torch.uint8), above.view(torch.uint8), table.open_unit, state.seen_open,
        fire.view(torch.uint8), state.gap, batch, heads, float(trigger.margin),
        float(trigger.margin - trigger.follow) if follow else 0.0,
        FOLLOW=follow, BLOCK_B=triton.next_power_of_2(batch), BLOCK_H=triton.next_power_of_2(heads),
    )
    return fire


@triton.jit
def _selected_kernel(
    ids_ptr, take_ptr, size_ptr, open_ptr, decode_units_ptr, admitted_ptr,
    held_ptr, held_end_ptr, held_count_ptr, seen_open_ptr, seen_size_ptr, seen_admitted_ptr,
    at_selection_ptr, has_ptr,
    K, R, capacity,
    id_sb, id_sh, sz_sb, sz_sh, ad_sb, hl_sb, hl_sh, he_sb, he_sh, hc_sb, ss_sb, sa_sb,
    BLOCK_R: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
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
    _selected_kernel[(heads, batch)](
        unit_ids, reselect.view(torch.uint8), table.size, table.open_unit, table.decode_units, store.admitted,
        state.held, state.held_end, state.held_count, state.seen_open, state.seen_size, state.seen_admitted,
        state.units_at_selection, state.has_selection.view(torch.uint8),
        listed, room, store.retrieval_capacity,
        *unit_ids.stride()[:2], *table.size.stride()[:2], store.admitted.stride(0),
        *state.held.stride()[:2], *state.held_end.stride()[:2], state.held_count.stride(0),
        state.seen_size.stride(0), state.seen_admitted.stride(0),
        BLOCK_R=min(1024, triton.next_power_of_2(room)),
    )
