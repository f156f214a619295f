"""Triton mapped fetch (op ``fetch_mapped``): a host pool's re-selection in three launches.

The comparing path (``resident_rows`` + ``refresh_rows`` + ``cache_insert``) looked each wanted
slot up by comparing it with every buffer row and every cache row (R x R and R x C compares per
(sequence, head)), then numbered the misses, mapped slots to pool rows, filled and copied back
keys and values apart, committed and inserted: about twenty launches. Here the store keeps a
slot map (``TieredStore.slot_map``: per pool slot and head, the buffer row or cache row that may
hold it; see ``reference_step.fetch_mapped`` for what it holds and why it stays exact):

1. ``_locate`` (one program per (sequence, head), rows in chunks): the held buffer rows enter
   the map; each wanted slot is looked up there and checked against the row it names; the misses
   are numbered in row order (the cache's first-in-first-out rows), counted, and each missed
   slot's entry is marked pending with its rank (an ``atomic_max``: the last miss of a slot wins).
   Ordered work, so one program per (sequence, head); a barrier between its passes.
2. ``_assemble`` (one program per tile of rows): keys and values of each row into the scratch
   pair, from the buffer, the cache or (only the misses) the pool, over PCIe for a pinned pool.
3. ``_commit`` (one program per tile of rows): the scratch into the buffer, the buffer's slots,
   validity, held flags and fill, the misses into their cache rows, and each missed slot's
   pending entry (its last miss only) into that cache row.

Same results as the reference, bit for bit. Sequences whose ``take`` is False return before
reading anything. No host syncs and grids from shapes alone, so every launch can be captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from ..reference_step import MAP_PENDING
from .gather import _TILE_BYTES, _pool_argument

# wanted rows one program of ``_locate`` handles per pass of its loops: a 2K budget's rows in
# one pass, so a program waits on a few dependent loads per pass, not per chunk (tests lower it
# to run several chunks)
_LOCATE_BLOCK = 2048
_LOCATE_WARPS = 8


@triton.jit
def _cache_holds(code, slot, ok, c_slots_ptr, c_held_ptr, cs_row, ch_row, C):
    """Where the map entry ``code`` names a held cache row labelled ``slot``."""
    row = -2 - code
    named = ok & (code <= -2) & (row < C)
    at = tl.maximum(row, 0).to(tl.int64)
    label = tl.load(c_slots_ptr + cs_row + at, mask=named, other=-1)
    held = tl.load(c_held_ptr + ch_row + at, mask=named, other=0)
    return named & (label == slot) & (held != 0)


@triton.jit
def _locate_kernel(
    slots_ptr, take_ptr, map_ptr, b_slots_ptr, b_held_ptr, c_slots_ptr, c_held_ptr, cursor_ptr,
    source_ptr, dest_ptr, read_ptr, fetched_ptr,
    H, R, C, CAP,
    s_sb, s_sh, m_sb, m_sh, bs_sb, bs_sh, bh_sb, bh_sh, cs_sb, cs_sh, ch_sb, ch_sh, cur_sb,
    src_sb, src_sh, d_sb, d_sh,
    PENDING: tl.constexpr, HAS_CACHE: tl.constexpr, BLOCK: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    entry = map_ptr + b * m_sb + h * m_sh
    cs_row = b * cs_sb + h * cs_sh
    ch_row = b * ch_sb + h * ch_sh
    # 1. the held buffer rows enter the map: first their entries are cleared (a row of a slot
    # the cache holds leaves its entry alone), then the highest row of each slot wins
    for start in range(0, R, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        ok = rows < R
        label = tl.load(b_slots_ptr + b * bs_sb + h * bs_sh + rows, mask=ok, other=-1)
        held = tl.load(b_held_ptr + b * bh_sb + h * bh_sh + rows, mask=ok, other=0)
        listed = ok & (held != 0) & (label >= 0) & (label < CAP)
        enters = listed
        if HAS_CACHE:
            code = tl.load(entry + label, mask=listed, other=-1)
            enters = listed & ~_cache_holds(code, label, listed, c_slots_ptr, c_held_ptr, cs_row, ch_row, C)
        # every row of one slot decides alike: a cleared entry reads as "not cached" as well
        tl.store(entry + label, tl.full([BLOCK], -1, tl.int32), mask=enters)
    tl.debug_barrier()
    for start in range(0, R, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        ok = rows < R
        label = tl.load(b_slots_ptr + b * bs_sb + h * bs_sh + rows, mask=ok, other=-1)
        held = tl.load(b_held_ptr + b * bh_sb + h * bh_sh + rows, mask=ok, other=0)
        listed = ok & (held != 0) & (label >= 0) & (label < CAP)
        enters = listed
        if HAS_CACHE:
            # a cleared (or already raised) entry names no cache row: the same decision as above
            code = tl.load(entry + label, mask=listed, other=-1, cache_modifier=".cg")
            enters = listed & ~_cache_holds(code, label, listed, c_slots_ptr, c_held_ptr, cs_row, ch_row, C)
        tl.atomic_max(entry + label, rows.to(tl.int32), mask=enters)
    tl.debug_barrier()
    # 2. the lookups, the misses numbered in row order
    if HAS_CACHE:
        cursor = tl.load(cursor_ptr + b * cur_sb + h)
    missed = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    for start in range(0, R, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        ok = rows < R
        slot = tl.load(slots_ptr + b * s_sb + h * s_sh + rows, mask=ok, other=-1)
        known = ok & (slot >= 0) & (slot < CAP)
        code = tl.load(entry + slot, mask=known, other=-1, cache_modifier=".cg")
        named = known & (code >= 0) & (code < R)
        at = tl.maximum(code, 0).to(tl.int64)
        label = tl.load(b_slots_ptr + b * bs_sb + h * bs_sh + at, mask=named, other=-1)
        held = tl.load(b_held_ptr + b * bh_sb + h * bh_sh + at, mask=named, other=0)
        found = named & (label == slot) & (held != 0)
        if HAS_CACHE:
            found = found | _cache_holds(code, slot, known & ~found, c_slots_ptr, c_held_ptr, cs_row, ch_row, C)
        miss = ok & ~found
        as_int = miss.to(tl.int32)
        rank = missed + tl.cumsum(as_int, axis=0) - as_int
        # a miss's source is -PENDING - rank: below every cache row's -2 - c
        tl.store(source_ptr + b * src_sb + h * src_sh + rows, tl.where(miss, -PENDING - rank, code), mask=ok)
        if HAS_CACHE:
            dest = tl.where(miss, (cursor + rank) % C, -1)
            tl.store(dest_ptr + b * d_sb + h * d_sh + rows, dest, mask=ok)
            tl.atomic_max(entry + slot, PENDING + rank, mask=miss & known)
        missed += tl.sum(as_int, axis=0)
    tl.atomic_add(read_ptr + b, missed.to(tl.int64))
    if HAS_CACHE:
        tl.store(cursor_ptr + b * cur_sb + h, (cursor + missed) % C)
    if h == 0:
        # one program per sequence adds the sequence's rows: no atomics
        tl.store(fetched_ptr + b, tl.load(fetched_ptr + b) + H * R)


@triton.jit
def _assemble_kernel(
    pool_k_ptr, pool_v_ptr, zone_rows_ptr, slots_ptr, source_ptr, take_ptr,
    buf_k_ptr, buf_v_ptr, c_k_ptr, c_v_ptr, sk_ptr, sv_ptr,
    R, zone_end,
    pk_sb, pk_sh, pk_sr, pv_sb, pv_sh, pv_sr, z_sb, z_sh, s_sb, s_sh, src_sb, src_sh,
    bk_sb, bk_sh, bk_sr, bv_sb, bv_sh, bv_sr, ck_sb, ck_sh, ck_sr, cv_sb, cv_sh, cv_sr,
    sk_sb, sk_sh, sk_sr, sv_sb, sv_sh, sv_sr,
    PENDING: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    HAS_ZONE: tl.constexpr, HAS_CACHE: tl.constexpr,
):
    tile = tl.program_id(0)
    # int64: pools reach past 2**31 elements
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    source = tl.load(source_ptr + b * src_sb + h * src_sh + rows, mask=row_ok, other=0).to(tl.int64)
    from_buffer = row_ok & (source >= 0)
    from_pool = row_ok & (source <= -PENDING)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    sk_at = sk_ptr + b * sk_sb + h * sk_sh + rows[:, None] * sk_sr + cols[None, :]
    sv_at = sv_ptr + b * sv_sb + h * sv_sh + rows[:, None] * sv_sr + cols[None, :]
    # masks constant along a row where BLOCK_D == D: accesses stay 16-byte vectors
    if HAS_CACHE:
        from_cache = row_ok & (source <= -2) & (source > -PENDING)
        if BLOCK_D == D:
            mask = from_cache[:, None]
        else:
            mask = from_cache[:, None] & col_ok[None, :]
        at = tl.maximum(-2 - source, 0)
        tl.store(sk_at, tl.load(c_k_ptr + b * ck_sb + h * ck_sh + at[:, None] * ck_sr + cols[None, :], mask=mask),
                 mask=mask)
        tl.store(sv_at, tl.load(c_v_ptr + b * cv_sb + h * cv_sh + at[:, None] * cv_sr + cols[None, :], mask=mask),
                 mask=mask)
    if BLOCK_D == D:
        mask = from_buffer[:, None]
    else:
        mask = from_buffer[:, None] & col_ok[None, :]
    at = tl.maximum(source, 0)
    tl.store(sk_at, tl.load(buf_k_ptr + b * bk_sb + h * bk_sh + at[:, None] * bk_sr + cols[None, :], mask=mask),
             mask=mask)
    tl.store(sv_at, tl.load(buf_v_ptr + b * bv_sb + h * bv_sh + at[:, None] * bv_sr + cols[None, :], mask=mask),
             mask=mask)
    # the misses: only these rows' bytes are read from the pool
    slot = tl.load(slots_ptr + b * s_sb + h * s_sh + rows, mask=from_pool, other=0).to(tl.int64)
    pool_row = slot
    if HAS_ZONE:
        # the prompt's zone is laid out unit by unit: its slots map to rows; later slots are rows
        in_zone = slot < zone_end
        zone_slot = tl.minimum(tl.maximum(slot, 0), zone_end - 1)
        mapped = tl.load(zone_rows_ptr + b * z_sb + h * z_sh + zone_slot, mask=from_pool & in_zone, other=0)
        pool_row = tl.where(in_zone, mapped.to(tl.int64), slot)
    if BLOCK_D == D:
        mask = from_pool[:, None]
    else:
        mask = from_pool[:, None] & col_ok[None, :]
    keys = tl.load(pool_k_ptr + b * pk_sb + h * pk_sh + pool_row[:, None] * pk_sr + cols[None, :], mask=mask)
    values = tl.load(pool_v_ptr + b * pv_sb + h * pv_sh + pool_row[:, None] * pv_sr + cols[None, :], mask=mask)
    tl.store(sk_at, keys, mask=mask)
    tl.store(sv_at, values, mask=mask)


@triton.jit
def _commit_kernel(
    slots_ptr, sv_ptr, take_ptr, pool_valid_ptr, next_slot_ptr, source_ptr, dest_ptr, map_ptr,
    sk_ptr, sval_ptr, out_k_ptr, out_v_ptr, rvalid_ptr, rslots_ptr, rheld_ptr, rfill_ptr,
    c_k_ptr, c_v_ptr, c_slots_ptr, c_held_ptr,
    R, CAP,
    s_sb, s_sh, svl_sb, svl_sh, valid_sb, src_sb, src_sh, d_sb, d_sh, m_sb, m_sh,
    sk_sb, sk_sh, sk_sr, sval_sb, sval_sh, sval_sr, ok_sb, ok_sh, ok_sr, ov_sb, ov_sh, ov_sr,
    rv_sb, rv_sh, rs_sb, rs_sh, rh_sb, rh_sh, rf_sb,
    ck_sb, ck_sh, ck_sr, cv_sb, cv_sh, cv_sr, cs_sb, cs_sh, ch_sb, ch_sh,
    PENDING: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    HAS_CACHE: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (cols < D)[None, :]
    keys = tl.load(sk_ptr + b * sk_sb + h * sk_sh + rows[:, None] * sk_sr + cols[None, :], mask=mask)
    values = tl.load(sval_ptr + b * sval_sb + h * sval_sh + rows[:, None] * sval_sr + cols[None, :], mask=mask)
    tl.store(out_k_ptr + b * ok_sb + h * ok_sh + rows[:, None] * ok_sr + cols[None, :], keys, mask=mask)
    tl.store(out_v_ptr + b * ov_sb + h * ov_sh + rows[:, None] * ov_sr + cols[None, :], values, mask=mask)
    # the commit: slot, attended (listed and a real token), held (written already)
    slot = tl.load(slots_ptr + b * s_sb + h * s_sh + rows, mask=row_ok, other=0).to(tl.int64)
    listed = tl.load(sv_ptr + b * svl_sb + h * svl_sh + rows, mask=row_ok, other=0) != 0
    real = tl.load(pool_valid_ptr + b * valid_sb + slot, mask=row_ok & (slot >= 0), other=0) != 0
    tl.store(rvalid_ptr + b * rv_sb + h * rv_sh + rows, (listed & real).to(tl.uint8), mask=row_ok)
    tl.store(rslots_ptr + b * rs_sb + h * rs_sh + rows, slot, mask=row_ok)
    held = (slot >= 0) & (slot < tl.load(next_slot_ptr))
    tl.store(rheld_ptr + b * rh_sb + h * rh_sh + rows, held.to(tl.uint8), mask=row_ok)
    if tile == 0:
        fill = tl.sum(tl.zeros([FILL_BLOCK], tl.int64), axis=0)
        for r0 in range(0, R, FILL_BLOCK):
            upto = r0 + tl.arange(0, FILL_BLOCK)
            listed_at = tl.load(sv_ptr + b * svl_sb + h * svl_sh + upto, mask=upto < R, other=0) != 0
            fill += tl.sum(listed_at.to(tl.int64), axis=0)
        tl.store(rfill_ptr + b * rf_sb + h, fill)
    if HAS_CACHE:
        # the misses into their cache rows (distinct per (sequence, head))
        dest = tl.load(dest_ptr + b * d_sb + h * d_sh + rows, mask=row_ok, other=-1).to(tl.int64)
        writes = row_ok & (dest >= 0)
        at = tl.maximum(dest, 0)
        if BLOCK_D == D:
            mask = writes[:, None]
        else:
            mask = writes[:, None] & (cols < D)[None, :]
        tl.store(c_k_ptr + b * ck_sb + h * ck_sh + at[:, None] * ck_sr + cols[None, :], keys, mask=mask)
        tl.store(c_v_ptr + b * cv_sb + h * cv_sh + at[:, None] * cv_sr + cols[None, :], values, mask=mask)
        tl.store(c_slots_ptr + b * cs_sb + h * cs_sh + at, slot, mask=writes)
        tl.store(c_held_ptr + b * ch_sb + h * ch_sh + at, held.to(tl.uint8), mask=writes)
        # the missed slot's entry: the cache row of its last miss (whose rank the entry holds)
        source = tl.load(source_ptr + b * src_sb + h * src_sh + rows, mask=writes, other=0)
        mapped = writes & (slot >= 0) & (slot < CAP)
        entry = map_ptr + b * m_sb + h * m_sh + slot
        pending = tl.load(entry, mask=mapped, other=-1)
        tl.store(entry, (-2 - dest).to(tl.int32), mask=mapped & (pending == -source))


@implement("triton", "fetch_mapped", supports=triton_runs_on)
def fetch_mapped(store, slots: torch.Tensor, slot_valid: torch.Tensor, reselect: torch.Tensor) -> None:
    """Three launches of ``reference_step.fetch_mapped`` (see the module docstring): the pool may
    be in pinned host memory; the buffer, the cache, the map and the scratch on the GPU."""
    batch, heads, rows = slots.shape
    buffer, pool, cache, where = store.retrieved, store.pool, store.cache, store.slot_map
    device = buffer.keys.device
    dim = pool.keys.shape[-1]
    if where is None or tuple(where.shape[:2]) != (batch, heads) or where.shape[2] <= pool.capacity \
            or where.dtype != torch.int32 or where.device != device:
        raise ValueError("triton fetch_mapped: the store needs an int32 slot map of its pool's capacity + 1 "
                         "on the buffer's device (reserve first)")
    if tuple(buffer.keys.shape) != (batch, heads, rows, dim):
        raise ValueError(f"triton fetch_mapped: slots {tuple(slots.shape)} do not fit the retrieved buffer "
                         f"{tuple(buffer.keys.shape)}")
    scratch_k, scratch_v, source = store.scratch, store.scratch_values, store.source
    if scratch_k.shape != buffer.keys.shape or scratch_v.shape != buffer.keys.shape \
            or tuple(source.shape) != (batch, heads, rows) or source.dtype != torch.int32:
        raise ValueError("triton fetch_mapped: the store's scratch does not fit its retrieved buffer")
    has_cache = cache is not None and cache.rows > 0
    dest = store.cache_dest if has_cache else source  # any tensor: never read without a cache
    c_rows = cache.rows if has_cache else 0
    for name, t in (("slots", slots), ("slot_valid", slot_valid), ("slot map", where), ("pool keys", pool.keys),
                    ("pool values", pool.values), ("retrieved keys", buffer.keys),
                    ("retrieved values", buffer.values), ("retrieved.valid", buffer.valid),
                    ("retrieved.slots", buffer.slots), ("retrieved.held", buffer.held), ("pool valid", pool.valid),
                    ("source", source), ("dest", dest), ("scratch", scratch_k), ("scratch", scratch_v)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton fetch_mapped: {name} must be contiguous in its last dim")
    if has_cache:
        for name, t in (("cache keys", cache.keys), ("cache values", cache.values), ("cache slots", cache.slots),
                        ("cache held", cache.held), ("cache cursor", cache.cursor)):
            if t.stride(-1) != 1:
                raise ValueError(f"triton fetch_mapped: {name} must be contiguous in its last dim")
    if batch * heads * rows == 0:
        return
    take = reselect.reshape(batch).contiguous().view(torch.uint8)
    # without a cache any tensors of the device stand in for its (never read) arguments
    c_keys, c_values = (cache.keys, cache.values) if has_cache else (buffer.keys, buffer.values)
    c_slots, c_held = (cache.slots, cache.held.view(torch.uint8)) if has_cache else (buffer.slots, take)
    cursor = cache.cursor if has_cache else buffer.fill
    b_held = buffer.held.view(torch.uint8)
    capacity = where.shape[2] - 1

    _locate_kernel[(heads, batch)](
        slots, take, where, buffer.slots, b_held, c_slots, c_held, cursor,
        source, dest, store.pool_rows_read, store.rows_fetched,
        heads, rows, c_rows, capacity,
        *slots.stride()[:2], *where.stride()[:2], *buffer.slots.stride()[:2], *b_held.stride()[:2],
        *c_slots.stride()[:2], *(c_held.stride()[:2] if has_cache else (0, 0)), cursor.stride(0),
        *source.stride()[:2], *dest.stride()[:2],
        PENDING=MAP_PENDING, HAS_CACHE=has_cache, BLOCK=min(_LOCATE_BLOCK, triton.next_power_of_2(rows)),
        num_warps=_LOCATE_WARPS,
    )

    zone_rows = pool.zone_rows
    has_zone = zone_rows is not None and store.zone_end > 0
    zone = zone_rows if has_zone else slots  # any tensor: never read without HAS_ZONE
    block_d = triton.next_power_of_2(dim)
    # one program moves a tile of keys and one of values: each the gather's tile size
    tile_rows = max(1, min(_TILE_BYTES // (block_d * pool.keys.element_size()), 128))
    tile_rows = min(tile_rows, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, tile_rows), heads, batch)
    _assemble_kernel[grid](
        _pool_argument(pool.keys, device), _pool_argument(pool.values, device), zone, slots, source, take,
        buffer.keys, buffer.values, c_keys, c_values, scratch_k, scratch_v,
        rows, store.zone_end,
        *pool.keys.stride()[:3], *pool.values.stride()[:3], *zone.stride()[:2], *slots.stride()[:2],
        *source.stride()[:2],
        *buffer.keys.stride()[:3], *buffer.values.stride()[:3], *c_keys.stride()[:3], *c_values.stride()[:3],
        *scratch_k.stride()[:3], *scratch_v.stride()[:3],
        PENDING=MAP_PENDING, D=dim, BLOCK_D=block_d, ROWS=tile_rows, HAS_ZONE=has_zone, HAS_CACHE=has_cache,
    )

    c_held_strides = c_held.stride()[:2] if has_cache else (0, 0)
    _commit_kernel[grid](
        slots, slot_valid.view(torch.uint8), take, pool.valid.view(torch.uint8), store.next_slot, source, dest,
        where, scratch_k, scratch_v, buffer.keys, buffer.values, buffer.valid.view(torch.uint8), buffer.slots,
        b_held, buffer.fill, c_keys, c_values, c_slots, c_held,
        rows, capacity,
        *slots.stride()[:2], *slot_valid.stride()[:2], pool.valid.stride(0), *source.stride()[:2],
        *dest.stride()[:2], *where.stride()[:2],
        *scratch_k.stride()[:3], *scratch_v.stride()[:3], *buffer.keys.stride()[:3], *buffer.values.stride()[:3],
        *buffer.valid.stride()[:2], *buffer.slots.stride()[:2], *b_held.stride()[:2], buffer.fill.stride(0),
        *c_keys.stride()[:3], *c_values.stride()[:3], *c_slots.stride()[:2], *c_held_strides,
        PENDING=MAP_PENDING, D=dim, BLOCK_D=block_d, ROWS=tile_rows, HAS_CACHE=has_cache,
        FILL_BLOCK=min(1024, triton.next_power_of_2(rows)),
    )
