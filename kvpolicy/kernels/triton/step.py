"""Triton decode-step bookkeeping (ops ``append_token``, ``note_decision``, ``query_cosine_fire``,
``interval_fire``, ``interval_decision``, ``commit_selection``), one launch each; the semantics are ``kernels/reference_step.py``'s.

On a step that keeps its selection these launches and attention are all a policy adds to the
model, and in a replayed graph every launch costs about as much as a small kernel runs, so
each op is one launch where the reference takes 10-17. Slots and counters are read from device
tensors and grids come from shapes alone: the launches can be graph-captured. A program that
owns a value reads it before it writes it, and no program reads what another writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .gather import _pool_argument
from .pdl import pdl_kernel, wait_for_previous


@pdl_kernel
@triton.jit
def _append_token_kernel(
    pool_k_ptr, pool_v_ptr, local_k_ptr, local_v_ptr, local_valid_ptr, slot_valid_ptr, next_slot_ptr,
    key_ptr, value_ptr, ev_k_ptr, ev_v_ptr, ev_valid_ptr, ev_slot_ptr, current_ptr,
    sink_slots_ptr, sink_valid_ptr,
    H, L, S, sink_sb, sv_sb, sv_sh,
    pk_sb, pk_sh, pk_sr, pv_sb, pv_sh, pv_sr,
    lk_sb, lk_sh, lk_sr, lv_sb, lv_sh, lv_sr,
    lvalid_sb, lvalid_sh, svalid_sb,
    k_sb, k_sh, v_sb, v_sh, ek_sb, ek_sh, ev_sb, ev_sh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    slot = tl.load(next_slot_ptr).to(tl.int64)
    position = slot % L
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    k = tl.load(key_ptr + b * k_sb + h * k_sh + cols, mask=mask)
    v = tl.load(value_ptr + b * v_sb + h * v_sh + cols, mask=mask)
    tl.store(pool_k_ptr + b * pk_sb + h * pk_sh + slot * pk_sr + cols, k.to(pool_k_ptr.dtype.element_ty), mask=mask)
    tl.store(pool_v_ptr + b * pv_sb + h * pv_sh + slot * pv_sr + cols, v.to(pool_v_ptr.dtype.element_ty), mask=mask)
    # the ring position's old token is pushed out before the new one takes it
    ring_k = local_k_ptr + b * lk_sb + h * lk_sh + position * lk_sr + cols
    ring_v = local_v_ptr + b * lv_sb + h * lv_sh + position * lv_sr + cols
    old_k = tl.load(ring_k, mask=mask)
    old_v = tl.load(ring_v, mask=mask)
    tl.store(ev_k_ptr + b * ek_sb + h * ek_sh + cols, old_k, mask=mask)
    tl.store(ev_v_ptr + b * ev_sb + h * ev_sh + cols, old_v, mask=mask)
    tl.store(ring_k, k.to(local_k_ptr.dtype.element_ty), mask=mask)
    tl.store(ring_v, v.to(local_v_ptr.dtype.element_ty), mask=mask)
    # the ring's validity is kept per head (the attended buffer's); each program reads its own
    # head's flag before writing it (they are equal across heads)
    valid_at = local_valid_ptr + b * lvalid_sb + h * lvalid_sh + position
    leaving = (tl.load(valid_at) != 0) & (slot >= L)
    # a prompt sink token leaving the ring: its sink row (this head's) becomes valid
    j = tl.arange(0, BLOCK_S)
    j_ok = j < S
    sink_slot = tl.load(sink_slots_ptr + b * sink_sb + j, mask=j_ok, other=-1)
    sink_at = sink_valid_ptr + b * sv_sb + h * sv_sh + j
    sink_off = tl.load(sink_at, mask=j_ok, other=1) == 0
    # (!= 0: Triton's interpreter would hand the store an int32 mask)
    to_sink = (j_ok & (sink_slot == slot - L) & sink_off & leaving) != 0
    tl.store(sink_at, tl.full([BLOCK_S], 1, tl.uint8), mask=to_sink)
    if h == 0:  # per-sequence state: one program of the sequence owns it
        handed_on = leaving & (tl.sum(to_sink.to(tl.int32), 0) == 0)
        tl.store(ev_valid_ptr + b, handed_on.to(tl.uint8))
        tl.store(slot_valid_ptr + b * svalid_sb + slot, tl.full([], 1, tl.uint8))
        if b == 0:
            tl.store(ev_slot_ptr, tl.maximum(slot - L, 0))
            tl.store(current_ptr, slot)
    tl.store(valid_at, tl.full([], 1, tl.uint8))


@implement("triton", "append_token", supports=triton_runs_on)
def append_token(store, key: torch.Tensor, value: torch.Tensor) -> None:
    """One launch of ``reference_step.append_token``."""
    batch, heads, dim = key.shape
    evicted, pool, ring, sink = store.evicted, store.pool, store.local, store.sink
    for name, t in (("local.keys", ring.keys), ("local.values", ring.values)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton append_token: {name} must be contiguous in its last dim")
    if batch * heads == 0:
        return
    device = key.device
    pool_k, pool_v = _pool_argument(pool.keys, device), _pool_argument(pool.values, device)
    key, value = key.contiguous(), value.contiguous()
    _append_token_kernel[(heads, batch)](
        pool_k, pool_v, ring.keys, ring.values, ring.valid.view(torch.uint8),
        pool.valid.view(torch.uint8), store.next_slot,
        key, value, evicted.key, evicted.value, evicted.valid.view(torch.uint8), evicted.slot, store.current_slot,
        sink.slots, sink.valid.view(torch.uint8),
        heads, ring.rows, sink.rows, sink.slots.stride(0), *sink.valid.stride()[:2],
        *pool.keys.stride()[:3], *pool.values.stride()[:3],
        *ring.keys.stride()[:3], *ring.values.stride()[:3],
        *ring.valid.stride()[:2], pool.valid.stride(0),
        *key.stride()[:2], *value.stride()[:2], *evicted.key.stride()[:2], *evicted.value.stride()[:2],
        D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_S=triton.next_power_of_2(max(sink.rows, 1)),
    )


@triton.jit
def note_rows(fire, b, ok, has_ptr, count_ptr, boundary_ptr, slot_ptr, out_ptr, boundary_sb):
    """``reference_step.note_decision`` for the sequences ``b`` (a vector, masked by ``ok``, or one
    sequence): what every launch that writes a step's decision stores (``note_decision``, the
    interval trigger's and score_gap's fused ops)."""
    decided = fire | (tl.load(has_ptr + b, mask=ok, other=0) == 0)
    flag = decided.to(tl.uint8)
    tl.store(out_ptr + b, flag, mask=ok)
    at = boundary_ptr + b * boundary_sb + tl.load(slot_ptr).to(tl.int64)
    tl.store(at, flag | tl.load(at, mask=ok, other=0), mask=ok)
    tl.store(has_ptr + b, flag | 1, mask=ok)
    tl.store(count_ptr + b, tl.load(count_ptr + b, mask=ok, other=0) + decided.to(tl.int64), mask=ok)


@pdl_kernel
@triton.jit
def _note_decision_kernel(
    fire_ptr, has_ptr, count_ptr, boundary_ptr, slot_ptr, out_ptr, B, boundary_sb, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    fire = tl.load(fire_ptr + b, mask=ok, other=0) != 0
    note_rows(fire, b, ok, has_ptr, count_ptr, boundary_ptr, slot_ptr, out_ptr, boundary_sb)


@implement("triton", "note_decision", supports=triton_runs_on)
def note_decision(fire, has_selection, reselections, boundary, slot, reselect) -> None:
    """One launch of ``reference_step.note_decision``."""
    batch = fire.shape[0]
    if batch == 0:
        return
    _note_decision_kernel[(1,)](
        fire.view(torch.uint8), has_selection.view(torch.uint8), reselections, boundary.view(torch.uint8), slot,
        reselect.view(torch.uint8), batch, boundary.stride(0), BLOCK_B=triton.next_power_of_2(batch),
    )


@pdl_kernel
@triton.jit
def _query_cosine_kernel(
    q_ptr, prev_ptr, has_ptr, fire_ptr, tau, HQ, q_sb, q_sh, p_sb, p_sh,
    ANCHOR: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < HQ) & (cols[None, :] < D)
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    prev_at = prev_ptr + b * p_sb + heads[:, None] * p_sh + cols[None, :]
    p = tl.load(prev_at, mask=mask, other=0.0)
    # as torch.cosine_similarity: each vector divided by max(norm, 1e-8), then the dot product
    qn = tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), 1e-8)
    pn = tl.maximum(tl.sqrt(tl.sum(p * p, axis=1)), 1e-8)
    cos = tl.sum((q / qn[:, None]) * (p / pn[:, None]), axis=1)
    cos = tl.where(heads < HQ, cos, 0.0)
    similarity = tl.sum(cos, axis=0) / HQ
    has = tl.load(has_ptr + b) != 0
    fire = (similarity < tau) | ~has
    tl.store(fire_ptr + b, fire.to(tl.uint8))
    if ANCHOR:
        q = tl.where(fire, q, p)
    tl.store(prev_at, q, mask=mask)
    tl.store(has_ptr + b, tl.full([], 1, tl.uint8))


@implement("triton", "query_cosine_fire", supports=triton_runs_on)
def query_cosine_fire(query, previous, has_previous, tau: float, anchor: bool) -> torch.Tensor:
    """One launch of ``reference_step.query_cosine_fire``."""
    batch, q_heads, dim = query.shape
    fire = torch.empty(batch, dtype=torch.bool, device=query.device)
    if batch == 0:
        return fire
    if previous.stride(-1) != 1:
        raise ValueError("triton query_cosine_fire: previous must be contiguous in its last dim")
    query = query.contiguous()
    _query_cosine_kernel[(batch,)](
        query, previous, has_previous.view(torch.uint8), fire.view(torch.uint8), float(tau), q_heads,
        query.stride(0), query.stride(1), previous.stride(0), previous.stride(1),
        ANCHOR=bool(anchor), D=dim, BLOCK_H=triton.next_power_of_2(q_heads), BLOCK_D=triton.next_power_of_2(dim),
    )
    return fire


@pdl_kernel
@triton.jit
def _interval_kernel(steps_ptr, fire_ptr, n, B, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    steps = tl.load(steps_ptr + b, mask=ok, other=0)
    tl.store(fire_ptr + b, (steps % n == 0).to(tl.uint8), mask=ok)
    tl.store(steps_ptr + b, steps + 1, mask=ok)


@pdl_kernel
@triton.jit
def _interval_decision_kernel(
    steps_ptr, n, has_ptr, count_ptr, boundary_ptr, slot_ptr, out_ptr, B, boundary_sb, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    steps = tl.load(steps_ptr + b, mask=ok, other=0)
    tl.store(steps_ptr + b, steps + 1, mask=ok)
    note_rows(steps % n == 0, b, ok, has_ptr, count_ptr, boundary_ptr, slot_ptr, out_ptr, boundary_sb)


@implement("triton", "interval_decision", supports=triton_runs_on)
def interval_decision(steps, n: int, has_selection, reselections, boundary, slot, reselect) -> None:
    """One launch of ``reference_step.interval_decision`` (two launches' worth: the fire and the note)."""
    batch = steps.shape[0]
    if batch == 0:
        return
    _interval_decision_kernel[(1,)](
        steps, int(n), has_selection.view(torch.uint8), reselections, boundary.view(torch.uint8), slot,
        reselect.view(torch.uint8), batch, boundary.stride(0), BLOCK_B=triton.next_power_of_2(batch),
    )


@implement("triton", "interval_fire", supports=triton_runs_on)
def interval_fire(steps: torch.Tensor, n: int) -> torch.Tensor:
    """One launch of ``reference_step.interval_fire``."""
    batch = steps.shape[0]
    fire = torch.empty(batch, dtype=torch.bool, device=steps.device)
    if batch:
        _interval_kernel[(1,)](steps, fire.view(torch.uint8), int(n), batch, BLOCK_B=triton.next_power_of_2(batch))
    return fire


# rows of one (sequence, head) per program of the commit
_COMMIT_ROWS = 256


@pdl_kernel
@triton.jit
def _commit_kernel(
    slots_ptr, sv_ptr, take_ptr, pool_valid_ptr, next_slot_ptr,
    rvalid_ptr, rslots_ptr, rfill_ptr, rheld_ptr,
    H, R,
    s_sb, s_sh, sv_sb, sv_sh, pv_sb, rv_sb, rv_sh, rs_sb, rs_sh, rf_sb, rh_sb, rh_sh,
    ROWS: tl.constexpr, FILL_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # a tile of rows a program: one program a (sequence, head), looping over blocks of 1,024 rows
    # with a pool-validity load waiting on each slot load, took 11.5 us at 4 x 128K on an H200
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    next_slot = tl.load(next_slot_ptr)
    rows = tile * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    slot = tl.load(slots_ptr + b * s_sb + h * s_sh + rows, mask=ok, other=0)
    listed = tl.load(sv_ptr + b * sv_sb + h * sv_sh + rows, mask=ok, other=0) != 0
    real = tl.load(pool_valid_ptr + b * pv_sb + slot, mask=ok, other=0) != 0
    tl.store(rvalid_ptr + b * rv_sb + h * rv_sh + rows, (listed & real).to(tl.uint8), mask=ok)
    tl.store(rslots_ptr + b * rs_sb + h * rs_sh + rows, slot, mask=ok)
    held = (slot >= 0) & (slot < next_slot)
    tl.store(rheld_ptr + b * rh_sb + h * rh_sh + rows, held.to(tl.uint8), mask=ok)
    if tile == 0:
        # the fill counts the listed rows: independent loads, no atomics to zero first
        fill = tl.sum(tl.zeros([FILL_BLOCK], tl.int64), axis=0)
        for r0 in range(0, R, FILL_BLOCK):
            every = r0 + tl.arange(0, FILL_BLOCK)
            fill += tl.sum((tl.load(sv_ptr + b * sv_sb + h * sv_sh + every, mask=every < R, other=0) != 0).to(tl.int64),
                           axis=0)
        tl.store(rfill_ptr + b * rf_sb + h, fill)


@implement("triton", "commit_selection", supports=triton_runs_on)
def commit_selection(store, slots: torch.Tensor, slot_valid: torch.Tensor, reselect: torch.Tensor) -> None:
    """One launch of ``reference_step.commit_selection``."""
    batch, heads, rows = slots.shape
    if batch * heads * rows == 0:
        return
    buffer, pool = store.retrieved, store.pool
    for name, t in (("slots", slots), ("slot_valid", slot_valid), ("retrieved.valid", buffer.valid),
                    ("retrieved.slots", buffer.slots), ("retrieved.held", buffer.held)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton commit_selection: {name} must be contiguous in its last dim")
    _commit_kernel[(triton.cdiv(rows, _COMMIT_ROWS), heads, batch)](
        slots, slot_valid.view(torch.uint8), reselect.view(torch.uint8), pool.valid.view(torch.uint8),
        store.next_slot, buffer.valid.view(torch.uint8), buffer.slots, buffer.fill,
        buffer.held.view(torch.uint8),
        heads, rows,
        *slots.stride()[:2], *slot_valid.stride()[:2], pool.valid.stride(0),
        *buffer.valid.stride()[:2], *buffer.slots.stride()[:2], buffer.fill.stride(0),
        *buffer.held.stride()[:2],
        ROWS=min(_COMMIT_ROWS, triton.next_power_of_2(rows)), FILL_BLOCK=min(1024, triton.next_power_of_2(rows)),
    )
