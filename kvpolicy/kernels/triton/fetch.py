"""Triton whole fetch (op ``fetch_whole``): a GPU pool's re-selection in one launch.

Where the pool sits in GPU memory (``TieredStore.read_whole``) a fetch reads every selected row
from it. Done op by op that was the slot -> pool row map (two PyTorch kernels), a gather each
for keys and values, ``commit_selection`` and two counter updates: seven launches of a few
microseconds each, plus the commit's own 11 us (one program per (sequence, head), on a chain of
dependent loads). Here one program copies a ``[ROWS, D]`` tile of keys and of values for one
(sequence, head) and writes the same rows' slot, validity and held flags; the first tile of a
row also counts its fill, and the first of a sequence the counters. Same results as the
reference, bit for bit (``reference_step.fetch_whole``).

Where the store attends the pool by slot (``TieredStore.attends_pool_by_slot``) no row moves:
the launch is the commit and the counters alone, on tiles of ``COMMIT_ROWS`` rows.

Sequences whose ``take`` is False read and write nothing (every access masked by it). No host
syncs and a grid from shapes alone, so the launch can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .gather import _TILE_BYTES, zone_pool_row
from .pdl import pdl_kernel, wait_for_previous

# bytes of keys (and as many of values) a program copies, and its warps: the gather's tile and
# Triton's default warps, as measured so far (benchmarks/fetch_whole.py times the others)
TILE_BYTES = _TILE_BYTES
WARPS = 4
# flags per step of tile 0's fill count: a budget of 2,048 rows in the one step loaded up front
FILL_BLOCK = 2048
# rows a program commits where no row is copied (as ``commit_selection``'s programs)
COMMIT_ROWS = 256


@pdl_kernel
@triton.jit
def _fetch_whole_kernel(
    pool_k_ptr, pool_v_ptr, zone_rows_ptr, slots_ptr, sv_ptr, take_ptr, pool_valid_ptr, next_slot_ptr,
    out_k_ptr, out_v_ptr, rvalid_ptr, rslots_ptr, rheld_ptr, rfill_ptr, fetched_ptr, read_ptr,
    H, R, zone_end,
    pk_sb, pk_sh, pk_sr, pv_sb, pv_sh, pv_sr,
    z_sb, z_sh, s_sb, s_sh, sv_sb, sv_sh, valid_sb,
    ok_sb, ok_sh, ok_sr, ov_sb, ov_sh, ov_sr,
    rv_sb, rv_sh, rs_sb, rs_sh, rh_sb, rh_sh, rf_sb,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_ZONE: tl.constexpr, FILL_BLOCK: tl.constexpr,
    COPY: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    # int64: pools reach past 2**31 elements
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    # the sequence's flag masks every access instead of an early return: its load then runs beside
    # the slots' (one dependent load fewer before the rows' copies)
    take = tl.load(take_ptr + b) != 0
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < tl.where(take, R, 0)  # (a scalar flag and'ed with a vector trips the interpreter)
    slot = tl.load(slots_ptr + b * s_sb + h * s_sh + rows, mask=row_ok, other=0).to(tl.int64)
    # tile 0 also counts the fill and the counters: their first loads issued here, beside the
    # slots', not after its copy (there, a chain of loads that ended the kernel after the others)
    first = (tile == 0) & take
    lanes = tl.arange(0, FILL_BLOCK)
    listed_head = tl.load(sv_ptr + b * sv_sb + h * sv_sh + lanes, mask=lanes < tl.where(first, R, 0), other=0)
    fetched = tl.load(fetched_ptr + b)
    read = tl.load(read_ptr + b)
    if COPY:
        pool_row = slot
        if HAS_ZONE:
            pool_row = zone_pool_row(slot, zone_rows_ptr + b * z_sb + h * z_sh, zone_end, row_ok)
        cols = tl.arange(0, BLOCK_D)
        if BLOCK_D == D:
            mask = row_ok[:, None]  # constant along a row: loads stay 16-byte vectors
        else:
            mask = row_ok[:, None] & (cols < D)[None, :]
        keys = tl.load(pool_k_ptr + b * pk_sb + h * pk_sh + pool_row[:, None] * pk_sr + cols[None, :], mask=mask)
        values = tl.load(pool_v_ptr + b * pv_sb + h * pv_sh + pool_row[:, None] * pv_sr + cols[None, :], mask=mask)
        tl.store(out_k_ptr + b * ok_sb + h * ok_sh + rows[:, None] * ok_sr + cols[None, :], keys, mask=mask)
        tl.store(out_v_ptr + b * ov_sb + h * ov_sh + rows[:, None] * ov_sr + cols[None, :], values, mask=mask)
    # the commit: slot, attended (listed and a real token), held (written already)
    listed = tl.load(sv_ptr + b * sv_sb + h * sv_sh + rows, mask=row_ok, other=0) != 0
    real = tl.load(pool_valid_ptr + b * valid_sb + slot, mask=row_ok, other=0) != 0
    tl.store(rvalid_ptr + b * rv_sb + h * rv_sh + rows, (listed & real).to(tl.uint8), mask=row_ok)
    tl.store(rslots_ptr + b * rs_sb + h * rs_sh + rows, slot, mask=row_ok)
    held = (slot >= 0) & (slot < tl.load(next_slot_ptr))
    tl.store(rheld_ptr + b * rh_sb + h * rh_sh + rows, held.to(tl.uint8), mask=row_ok)
    if first:
        fill = tl.sum((listed_head != 0).to(tl.int64), axis=0)
        for r0 in range(FILL_BLOCK, R, FILL_BLOCK):  # rows past the first block (R over FILL_BLOCK)
            at = r0 + lanes
            fill += tl.sum((tl.load(sv_ptr + b * sv_sb + h * sv_sh + at, mask=at < R, other=0) != 0).to(tl.int64), axis=0)
        tl.store(rfill_ptr + b * rf_sb + h, fill)
        if h == 0:
            # one program per sequence adds the sequence's rows: no atomics
            tl.store(fetched_ptr + b, fetched + H * R)
            tl.store(read_ptr + b, read + H * R)


@implement("triton", "fetch_whole", supports=triton_runs_on)
def fetch_whole(store, slots: torch.Tensor, slot_valid: torch.Tensor, reselect: torch.Tensor) -> None:
    """One launch of ``reference_step.fetch_whole``: ``store``'s pool on the attention device."""
    batch, heads, rows = slots.shape
    buffer, pool = store.retrieved, store.pool
    device = buffer.keys.device
    if pool.keys.device != device or pool.values.device != device:
        raise ValueError(f"triton fetch_whole: the pool must be on the buffer's device {device}, got "
                         f"{pool.keys.device}; a host pool is fetched by resident_rows + refresh_rows")
    dim = pool.keys.shape[-1]
    for name, t in (("slots", slots), ("slot_valid", slot_valid), ("pool keys", pool.keys),
                    ("pool values", pool.values), ("retrieved keys", buffer.keys),
                    ("retrieved values", buffer.values), ("retrieved.valid", buffer.valid),
                    ("retrieved.slots", buffer.slots), ("retrieved.held", buffer.held), ("pool valid", pool.valid)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton fetch_whole: {name} must be contiguous in its last dim")
    if tuple(buffer.keys.shape) != (batch, heads, rows, dim):
        raise ValueError(f"triton fetch_whole: slots {tuple(slots.shape)} do not fit the retrieved buffer "
                         f"{tuple(buffer.keys.shape)}")
    if batch * heads * rows == 0:
        return
    zone_rows = pool.zone_rows
    has_zone = zone_rows is not None and store.zone_end > 0
    zone = zone_rows if has_zone else slots  # any tensor: never read without HAS_ZONE
    block_d = triton.next_power_of_2(dim)
    copy = not store.attends_pool_by_slot
    # one program moves a tile of keys and one of values, each of about TILE_BYTES (or commits
    # COMMIT_ROWS rows, where nothing moves)
    tile_rows = max(1, min(TILE_BYTES // (block_d * pool.keys.element_size()), 128)) if copy else COMMIT_ROWS
    tile_rows = min(tile_rows, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, tile_rows), heads, batch)
    _fetch_whole_kernel[grid](
        pool.keys, pool.values, zone, slots, slot_valid.view(torch.uint8),
        reselect.reshape(batch).contiguous().view(torch.uint8), pool.valid.view(torch.uint8), store.next_slot,
        buffer.keys, buffer.values, buffer.valid.view(torch.uint8), buffer.slots, buffer.held.view(torch.uint8),
        buffer.fill, store.rows_fetched, store.pool_rows_read,
        heads, rows, store.zone_end,
        *pool.keys.stride()[:3], *pool.values.stride()[:3],
        *zone.stride()[:2], *slots.stride()[:2], *slot_valid.stride()[:2], pool.valid.stride(0),
        *buffer.keys.stride()[:3], *buffer.values.stride()[:3],
        *buffer.valid.stride()[:2], *buffer.slots.stride()[:2], *buffer.held.stride()[:2], buffer.fill.stride(0),
        D=dim, BLOCK_D=block_d, ROWS=tile_rows, HAS_ZONE=has_zone, FILL_BLOCK=min(FILL_BLOCK, triton.next_power_of_2(rows)),
        COPY=copy, num_warps=WARPS,
    )
