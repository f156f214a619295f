"""Triton re-selection that reads only the new rows (ops ``resident_rows``, ``refresh_rows``,
``cache_insert`` and ``number_misses``).

Consecutive selections overlap, and the rows they share are already in the retrieved buffer
on the GPU. A fetch runs:

1. ``resident_rows`` (once for keys and values): for each wanted slot, the last held buffer
   row labelled with it, or -1; and the count of -1 per sequence, added with one atomic per
   program. Through a slot -> row map that every layer shares (the held rows mark it, the
   wanted slots read it, the held rows clear it): linear in the rows, fully parallel, and a
   sequence that does not re-select costs nothing (its programs return at once).
2. ``refresh_rows`` fill, keys and values in one launch: one program per ``[ROWS, D]`` tile of
   one part of one (sequence, head) writes its ``scratch`` from the buffer where the slot is
   resident and from the pool otherwise. Both loads are masked per row, so a resident row costs
   no pool byte: with a pinned host pool, only the missing rows cross PCIe. Two masked stores
   (no select on the values) keep every bit.
3. ``refresh_rows`` copy back: ``out = scratch``. Separate, because rows move between
   positions: a program of step 2 may read a buffer row another one would already have replaced.

With a GPU unit cache (``RowCache``, a host pool's recent reads), ``resident_rows`` also runs
against the cache for the rows the buffer lacks, step 2 reads the rows found there from the
cache, and ``cache_insert`` files the rows that came from the pool into the cache afterwards
(after the copy back, so no read of this fetch sees a row it replaces).

Sequences whose ``take`` is False return before reading anything (``number_misses`` writes
their ``cache_dest`` -1, as its reference does). No host syncs and a grid
from shapes alone, so every launch can be graph-captured.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .gather import _TILE_BYTES, _pool_argument, zone_pool_row
from .pdl import pdl_kernel, wait_for_previous

# rows of one (sequence, head) per program of the slot-map launches
_MAP_ROWS = 256


@pdl_kernel
@triton.jit
def _mark_kernel(
    take_ptr, label_ptr, held_ptr, map_ptr,
    RC, M,
    label_sb, label_sh, label_sr,
    held_sb, held_sh, held_sr,
    map_sb, map_sh, map_sm,
    ROWS: tl.constexpr, CLEAR: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    cols = tile * ROWS + tl.arange(0, ROWS)
    col_ok = cols < RC
    label = tl.load(label_ptr + b * label_sb + h * label_sh + cols * label_sr, mask=col_ok, other=-1).to(tl.int64)
    held = tl.load(held_ptr + b * held_sb + h * held_sh + cols * held_sr, mask=col_ok, other=0)
    mark = col_ok & (held != 0) & (label >= 0) & (label < M)
    at = map_ptr + b * map_sb + h * map_sh + tl.where(mark, label, 0) * map_sm
    if CLEAR:
        tl.store(at, tl.full([ROWS], -1, tl.int32), mask=mark)
    else:
        # rows labelled alike: the highest wins, as the reference's "last held row"
        tl.atomic_max(at, cols.to(tl.int32), mask=mark, sem="relaxed")


@pdl_kernel
@triton.jit
def _lookup_kernel(
    slots_ptr, take_ptr, map_ptr, source_ptr, read_ptr, skip_ptr, label_ptr, held_ptr,
    R, M, RC,
    slots_sb, slots_sh, slots_sr,
    map_sb, map_sh, map_sm,
    label_sb, label_sh, label_sr,
    held_sb, held_sh, held_sr,
    source_sb, source_sh, source_sr,
    skip_sb, skip_sh, skip_sr,
    ROWS: tl.constexpr, HAS_SKIP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    wanted = tl.load(slots_ptr + b * slots_sb + h * slots_sh + rows * slots_sr, mask=row_ok, other=-1).to(tl.int64)
    look = row_ok & (wanted >= 0) & (wanted < M)
    if HAS_SKIP:
        # found already in another buffer: not looked up here
        look = look & (tl.load(skip_ptr + b * skip_sb + h * skip_sh + rows * skip_sr, mask=row_ok, other=-1) < 0)
    found = tl.load(map_ptr + b * map_sb + h * map_sh + tl.where(look, wanted, 0) * map_sm, mask=look, other=-1)
    # a row is taken only if it really holds the slot: a stale map entry (a call cut short
    # between its mark and clear launches) costs a pool read, never a wrong row
    found = tl.where(found < RC, found, -1)
    check = row_ok & (found >= 0)
    at = tl.where(check, found, 0).to(tl.int64)
    label = tl.load(label_ptr + b * label_sb + h * label_sh + at * label_sr, mask=check, other=-1).to(tl.int64)
    held = tl.load(held_ptr + b * held_sb + h * held_sh + at * held_sr, mask=check, other=0)
    found = tl.where(check & (label == wanted) & (held != 0), found, -1)
    tl.store(source_ptr + b * source_sb + h * source_sh + rows * source_sr, found, mask=row_ok)
    missing = tl.sum(tl.where(row_ok & (found < 0), 1, 0), axis=0)
    tl.atomic_add(read_ptr + b, missing.to(tl.int64))


@implement("triton", "resident_rows", supports=triton_runs_on)
def resident_rows(slots: torch.Tensor, take: torch.Tensor, buffer, source: torch.Tensor, rows_read: torch.Tensor,
                  slot_map: torch.Tensor, skip: torch.Tensor | None = None) -> None:
    """``source`` = the last held row of ``buffer`` (a ``RetrievedBuffer`` or ``RowCache``)
    labelled with each wanted slot (or -1; also where ``skip >= 0``), and ``rows_read`` += the
    count of -1, for the sequences where ``take``; see the reference.

    Three launches over ``slot_map`` (``(B, H, M)`` int32, all -1, left all -1): the held rows
    write their row number at their slot (an atomic max, so the last of equal labels wins), the
    wanted slots read it (and check that row's label), the held rows write -1 back. A slot of
    ``M`` or more is never found: ``M`` must exceed every slot (the store's is the pool's
    capacity). Calls sharing a map must run one after another (one stream). Linear in the rows, where comparing every
    wanted slot with every buffer row cost 54 us a launch at 4 x 128K on an H200 (session 13).
    """
    current_slots, current_held = buffer.slots, buffer.held
    batch, heads, rows = slots.shape
    current = current_slots.shape[-1]
    if tuple(source.shape) != (batch, heads, rows) or source.dtype != torch.int32:
        raise ValueError(f"triton resident_rows: source must be int32 {(batch, heads, rows)}, got "
                         f"{source.dtype} {tuple(source.shape)}")
    if tuple(current_slots.shape) != (batch, heads, current) or current_held.shape != current_slots.shape:
        raise ValueError(f"triton resident_rows: current slots {tuple(current_slots.shape)} and held "
                         f"{tuple(current_held.shape)} do not fit slots {tuple(slots.shape)}")
    if tuple(rows_read.shape) != (batch,) or rows_read.dtype != torch.long:
        raise ValueError(f"triton resident_rows: rows_read must be long ({batch},), got {rows_read.dtype} "
                         f"{tuple(rows_read.shape)}")
    if slot_map.dim() != 3 or tuple(slot_map.shape[:2]) != (batch, heads) or slot_map.dtype != torch.int32 \
            or slot_map.device != source.device:
        raise ValueError(f"triton resident_rows: slot_map must be int32 ({batch}, {heads}, M) on {source.device}, "
                         f"got {slot_map.dtype} {tuple(slot_map.shape)} on {slot_map.device}")
    if skip is not None and (tuple(skip.shape) != (batch, heads, rows) or skip.device != source.device
                             or skip.dtype.is_floating_point or skip.dtype == torch.bool):
        raise ValueError(f"triton resident_rows: skip must be integer rows {(batch, heads, rows)} on {source.device}, "
                         f"got {skip.dtype} {tuple(skip.shape)} on {skip.device}")
    if batch * heads * rows == 0:
        return
    device = source.device
    slots, current_slots = slots.to(device), current_slots.to(device)  # no-ops when already there
    skip_arg = source if skip is None else skip  # any tensor: never read without HAS_SKIP
    take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
    held = current_held.to(device).view(torch.uint8)
    slots_m = slot_map.shape[-1]
    label_args = (current_slots, held, slot_map, current, slots_m,
                  *current_slots.stride(), *held.stride(), *slot_map.stride())
    mark_grid = (triton.cdiv(current, _MAP_ROWS), heads, batch)
    if current:
        _mark_kernel[mark_grid](take, *label_args, ROWS=_MAP_ROWS, CLEAR=False)
    _lookup_kernel[(triton.cdiv(rows, _MAP_ROWS), heads, batch)](
        slots, take, slot_map, source, rows_read, skip_arg, current_slots, held,
        rows, slots_m, current,
        *slots.stride(), *slot_map.stride(), *current_slots.stride(), *held.stride(), *source.stride(),
        *skip_arg.stride(),
        ROWS=_MAP_ROWS, HAS_SKIP=skip is not None,
    )
    if current:
        _mark_kernel[mark_grid](take, *label_args, ROWS=_MAP_ROWS, CLEAR=True)


@pdl_kernel
@triton.jit
def _refresh_kernel(
    pool0_ptr, pool1_ptr, out0_ptr, out1_ptr, scratch0_ptr, scratch1_ptr, cache0_ptr, cache1_ptr,
    slots_ptr, source_ptr, take_ptr, cache_source_ptr, zone_rows_ptr,
    R, zone_end,
    pool_sb, pool_sh, pool_sr, pool_sd,
    slots_sb, slots_sh, slots_sr,
    source_sb, source_sh, source_sr,
    out_sb, out_sh, out_sr, out_sd,
    scratch_sb, scratch_sh, scratch_sr, scratch_sd,
    cache_sb, cache_sh, cache_sr, cache_sd,
    csrc_sb, csrc_sh, csrc_sr,
    zone_sb, zone_sh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PARTS: tl.constexpr, COPY_BACK: tl.constexpr,
    HAS_CACHE: tl.constexpr, HAS_ZONE: tl.constexpr, PDL: tl.constexpr,
):
    # the parts (keys, values) of one tile are neighbouring programs: both tensors' rows are in
    # flight over PCIe at once, where a launch per tensor left half the requests for later
    wait_for_previous(PDL)
    tile = tl.program_id(0) // PARTS
    part = tl.program_id(0) % PARTS
    if part == 0:
        pool_ptr, out_ptr, scratch_ptr, cache_ptr = pool0_ptr, out0_ptr, scratch0_ptr, cache0_ptr
    else:
        pool_ptr, out_ptr, scratch_ptr, cache_ptr = pool1_ptr, out1_ptr, scratch1_ptr, cache1_ptr
    # int64: pools reach past 2**31 elements
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    here = scratch_ptr + b * scratch_sb + h * scratch_sh + rows[:, None] * scratch_sr + cols[None, :] * scratch_sd
    if COPY_BACK:
        if BLOCK_D == D:
            # mask constant along a row: accesses stay 16-byte vectors
            mask = row_ok[:, None]
        else:
            mask = row_ok[:, None] & col_ok[None, :]
        tile_of = tl.load(here, mask=mask)
        dst = out_ptr + b * out_sb + h * out_sh + rows[:, None] * out_sr + cols[None, :] * out_sd
        tl.store(dst, tile_of, mask=mask)
    else:
        source = tl.load(source_ptr + b * source_sb + h * source_sh + rows * source_sr, mask=row_ok, other=-1)
        source = source.to(tl.int64)
        from_pool = row_ok & (source < 0)
        resident = row_ok & (source >= 0)
        if HAS_CACHE:
            # a row the GPU unit cache holds is read there: only the rest cross from the pool
            cached_at = tl.load(cache_source_ptr + b * csrc_sb + h * csrc_sh + rows * csrc_sr, mask=from_pool, other=-1)
            cached_at = cached_at.to(tl.int64)
            from_cache = from_pool & (cached_at >= 0)
            from_pool = from_pool & (cached_at < 0)
            if BLOCK_D == D:
                cache_mask = from_cache[:, None]
            else:
                cache_mask = from_cache[:, None] & col_ok[None, :]
            at_cache = tl.maximum(cached_at, 0)
            cache_src = cache_ptr + b * cache_sb + h * cache_sh + at_cache[:, None] * cache_sr + cols[None, :] * cache_sd
            tl.store(here, tl.load(cache_src, mask=cache_mask), mask=cache_mask)
        if BLOCK_D == D:
            pool_mask = from_pool[:, None]
            kept_mask = resident[:, None]
        else:
            pool_mask = from_pool[:, None] & col_ok[None, :]
            kept_mask = resident[:, None] & col_ok[None, :]
        slot = tl.load(slots_ptr + b * slots_sb + h * slots_sh + rows * slots_sr, mask=from_pool, other=0)
        slot = slot.to(tl.int64)
        if HAS_ZONE:
            slot = zone_pool_row(slot, zone_rows_ptr + b * zone_sb + h * zone_sh, zone_end, from_pool)
        src = pool_ptr + b * pool_sb + h * pool_sh + slot[:, None] * pool_sr + cols[None, :] * pool_sd
        fetched = tl.load(src, mask=pool_mask)
        tl.store(here, fetched, mask=pool_mask)
        # clamped: rows read from the pool must not form pointers before the buffer either
        at = tl.maximum(source, 0)
        kept_src = out_ptr + b * out_sb + h * out_sh + at[:, None] * out_sr + cols[None, :] * out_sd
        tl.store(here, tl.load(kept_src, mask=kept_mask), mask=kept_mask)


def _same_layout(name: str, parts: Sequence[torch.Tensor]) -> None:
    first = parts[0]
    for other in parts[1:]:
        if other.shape != first.shape or other.stride() != first.stride() or other.dtype != first.dtype \
                or other.device != first.device:
            raise ValueError(f"triton refresh_rows: the {name} parts must share shape, strides, dtype and device, got "
                             + ", ".join(f"{tuple(t.shape)} {t.stride()} {t.dtype} on {t.device}" for t in parts))


@implement("triton", "refresh_rows", supports=triton_runs_on)
def refresh_rows(
    pools: Sequence[torch.Tensor],
    slots: torch.Tensor,
    take: torch.Tensor,
    source: torch.Tensor,
    outs: Sequence[torch.Tensor],
    scratches: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor] | None = None,
    cache_source: torch.Tensor | None = None,
    zone_rows: torch.Tensor | None = None,
) -> None:
    """For each part (the keys, the values): ``out[b, h, r] = out[b, h, source]`` if
    ``source >= 0``, else ``cache[b, h, cache_source]`` if ``caches`` are given and
    ``cache_source >= 0``, else ``pool[b, h, pool_rows(slots, zone_rows)]`` (the reference's),
    where ``take``. Every part in one launch (and one for the copy back); only the rows read
    from the pool are translated.

    A pool is on its ``out``'s device, or in pinned CPU memory for a CUDA ``out``; ``source``
    holds rows of ``out`` (``-1 <= source < R``); a ``scratch`` has its ``out``'s shape and dtype,
    overlaps no ``out``, and is left with unspecified contents; a cache ``(B, H, C, D)`` is on
    ``out``'s device and ``cache_source`` is int32 shaped like ``source`` (``-1 <= cache_source <
    C``). The parts of each argument share one layout.
    """
    if any(isinstance(group, torch.Tensor) for group in (pools, outs, scratches, caches)):
        raise ValueError("triton refresh_rows: pools, outs, scratches and caches are sequences of parts "
                         "(keys, values), not tensors: pass (pool,) for one part")
    parts = len(pools)
    if parts not in (1, 2) or len(outs) != parts or len(scratches) != parts \
            or (caches is not None and len(caches) != parts):
        raise ValueError(f"triton refresh_rows: one or two parts (keys, values) of pools, outs, scratches and caches "
                         f"alike, got {len(pools)}, {len(outs)}, {len(scratches)} and "
                         f"{'no' if caches is None else len(caches)}")
    for name, group in (("pool", pools), ("out", outs), ("scratch", scratches)) + ((("cache", caches),) if caches else ()):
        _same_layout(name, group)
    pool, out, scratch = pools[0], outs[0], scratches[0]
    batch, heads, _, dim = pool.shape
    rows = slots.shape[-1]
    want = (batch, heads, rows)
    if tuple(slots.shape) != want or tuple(source.shape) != want or tuple(out.shape) != (*want, dim):
        raise ValueError(
            f"triton refresh_rows: shapes do not match: pool {tuple(pool.shape)}, slots {tuple(slots.shape)}, "
            f"source {tuple(source.shape)}, out {tuple(out.shape)}"
        )
    if scratch.shape != out.shape or scratch.dtype != out.dtype or scratch.device != out.device:
        raise ValueError(
            f"triton refresh_rows: scratch {tuple(scratch.shape)} {scratch.dtype} on {scratch.device} must match "
            f"out {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.dtype != pool.dtype:
        raise ValueError(f"triton refresh_rows: out is {out.dtype} but the pool is {pool.dtype}")
    cache = caches[0] if caches is not None else None
    has_cache = cache is not None and cache.shape[2] > 0
    if has_cache and (tuple(cache.shape[:2]) != (batch, heads) or cache.shape[3] != dim or cache.dtype != out.dtype
                      or cache.device != out.device or cache_source is None
                      or tuple(cache_source.shape) != want or cache_source.dtype != torch.int32):
        raise ValueError(
            f"triton refresh_rows: the cache {tuple(cache.shape)} {cache.dtype} on {cache.device} must be "
            f"({batch}, {heads}, C, {dim}) {out.dtype} on {out.device}, with an int32 cache_source of {want}"
        )
    has_zone = zone_rows is not None and zone_rows.shape[-1] > 0
    if has_zone and (zone_rows.dim() != 3 or tuple(zone_rows.shape[:2]) != (batch, heads) or zone_rows.stride(-1) != 1
                     or zone_rows.device != out.device or zone_rows.dtype not in (torch.int32, torch.long)):
        raise ValueError(f"triton refresh_rows: zone_rows must be int32 or long ({batch}, {heads}, zone), contiguous "
                         f"in its last dim, on {out.device}; got {zone_rows.dtype} {tuple(zone_rows.shape)} "
                         f"{zone_rows.stride()} on {zone_rows.device}")
    if batch * heads * rows * dim == 0:
        return
    outs_storage = {o.untyped_storage().data_ptr() for o in outs}
    if any(s.untyped_storage().data_ptr() in outs_storage for s in scratches) \
            or (parts == 2 and scratches[0].untyped_storage().data_ptr() == scratches[1].untyped_storage().data_ptr()):
        raise ValueError("triton refresh_rows: a scratch shares memory with an out or the other scratch; rows would "
                         "be overwritten before read")
    device = out.device
    pool_args = [_pool_argument(p, device) for p in pools]
    slots = slots.to(device)  # no-op when already there
    source = source.to(device)
    take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
    block_d = triton.next_power_of_2(dim)
    tile_rows = max(1, min(_TILE_BYTES // (block_d * pool.element_size()), 128))
    tile_rows = min(tile_rows, triton.next_power_of_2(rows))
    grid = (parts * triton.cdiv(rows, tile_rows), heads, batch)
    if not has_cache:  # unused pointers: any tensor of the device, strides unread
        caches, cache_source = outs, source
    # a single part passes its tensors twice: the kernel never takes the second branch
    second = 1 if parts == 2 else 0
    pointers = (pool_args[0], pool_args[second], outs[0], outs[second], scratches[0], scratches[second],
                caches[0], caches[second])
    if not has_zone:
        zone_rows = slots  # any tensor: never read without HAS_ZONE
    zone_end = zone_rows.shape[-1] if has_zone else 0
    strides = (*pool.stride(), *slots.stride(), *source.stride(), *out.stride(), *scratch.stride(),
               *caches[0].stride(), *cache_source.stride(), *zone_rows.stride()[:2])
    for copy_back in (False, True):
        _refresh_kernel[grid](
            *pointers, slots, source, take, cache_source, zone_rows,
            rows, zone_end,
            *strides,
            D=dim, BLOCK_D=block_d, ROWS=tile_rows, PARTS=parts, COPY_BACK=copy_back, HAS_CACHE=has_cache,
            HAS_ZONE=has_zone,
        )


@pdl_kernel
@triton.jit
def _cache_insert_kernel(
    dest_ptr, take_ptr, buf_keys_ptr, buf_values_ptr, buf_slots_ptr, buf_held_ptr,
    c_keys_ptr, c_values_ptr, c_slots_ptr, c_held_ptr,
    R,
    dest_sb, dest_sh, dest_sr,
    bk_sb, bk_sh, bk_sr, bk_sd,
    bv_sb, bv_sh, bv_sr, bv_sd,
    bs_sb, bs_sh, bs_sr,
    bh_sb, bh_sh, bh_sr,
    ck_sb, ck_sh, ck_sr, ck_sd,
    cv_sb, cv_sh, cv_sr, cv_sd,
    cs_sb, cs_sh, cs_sr,
    ch_sb, ch_sh, ch_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if tl.load(take_ptr + b) == 0:
        return
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    dest = tl.load(dest_ptr + b * dest_sb + h * dest_sh + rows * dest_sr, mask=row_ok, other=-1).to(tl.int64)
    writes = row_ok & (dest >= 0)
    at = tl.maximum(dest, 0)
    cols = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        mask = writes[:, None]
    else:
        mask = writes[:, None] & (cols < D)[None, :]
    keys = tl.load(buf_keys_ptr + b * bk_sb + h * bk_sh + rows[:, None] * bk_sr + cols[None, :] * bk_sd, mask=mask)
    tl.store(c_keys_ptr + b * ck_sb + h * ck_sh + at[:, None] * ck_sr + cols[None, :] * ck_sd, keys, mask=mask)
    values = tl.load(buf_values_ptr + b * bv_sb + h * bv_sh + rows[:, None] * bv_sr + cols[None, :] * bv_sd, mask=mask)
    tl.store(c_values_ptr + b * cv_sb + h * cv_sh + at[:, None] * cv_sr + cols[None, :] * cv_sd, values, mask=mask)
    slot = tl.load(buf_slots_ptr + b * bs_sb + h * bs_sh + rows * bs_sr, mask=writes)
    tl.store(c_slots_ptr + b * cs_sb + h * cs_sh + at * cs_sr, slot, mask=writes)
    held = tl.load(buf_held_ptr + b * bh_sb + h * bh_sh + rows * bh_sr, mask=writes)
    tl.store(c_held_ptr + b * ch_sb + h * ch_sh + at * ch_sr, held, mask=writes)


@implement("triton", "cache_insert", supports=triton_runs_on)
def cache_insert(cache, dest: torch.Tensor, take: torch.Tensor, buffer) -> None:
    """Buffer rows with ``dest >= 0`` into those rows of the GPU unit cache (key, value, slot,
    held), for the sequences where ``take``; see the reference. One program per tile of rows of
    one (sequence, head): the destinations are distinct, so no two programs write one row."""
    batch, heads, rows = dest.shape
    dim = buffer.keys.shape[-1]
    if tuple(buffer.slots.shape) != (batch, heads, rows) or tuple(cache.keys.shape[:2]) != (batch, heads) \
            or cache.keys.shape[-1] != dim or cache.keys.dtype != buffer.keys.dtype:
        raise ValueError(f"triton cache_insert: dest {tuple(dest.shape)}, buffer {tuple(buffer.keys.shape)} "
                         f"{buffer.keys.dtype} and cache {tuple(cache.keys.shape)} {cache.keys.dtype} do not fit")
    if batch * heads * rows == 0 or cache.rows == 0:
        return
    take = take.reshape(batch).contiguous().view(torch.uint8)
    buffer_held, cache_held = buffer.held.view(torch.uint8), cache.held.view(torch.uint8)
    block_d = triton.next_power_of_2(dim)
    tile_rows = max(1, min(_TILE_BYTES // (block_d * buffer.keys.element_size()), 128))
    tile_rows = min(tile_rows, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, tile_rows), heads, batch)
    _cache_insert_kernel[grid](
        dest, take, buffer.keys, buffer.values, buffer.slots, buffer_held,
        cache.keys, cache.values, cache.slots, cache_held,
        rows,
        *dest.stride(), *buffer.keys.stride(), *buffer.values.stride(), *buffer.slots.stride(), *buffer_held.stride(),
        *cache.keys.stride(), *cache.values.stride(), *cache.slots.stride(), *cache_held.stride(),
        D=dim, BLOCK_D=block_d, ROWS=tile_rows,
    )


@pdl_kernel
@triton.jit
def _misses_kernel(
    source_ptr, cache_source_ptr, take_ptr, dest_ptr, cursor_ptr, read_ptr,
    R, CR,
    src_sb, src_sh, cs_sb, cs_sh, dest_sb, dest_sh, cur_sb,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    take = tl.load(take_ptr + b) != 0
    cursor = tl.load(cursor_ptr + b * cur_sb + h)
    # the count and the scan in int32 (a row's rank is below R): an int64 scan of a decode's 2,048
    # rows runs as pairs of 32-bit operations; only the cache row and the counters are int64
    count = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    for start in range(0, R, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        ok = rows < R
        miss = ok & take & (tl.load(source_ptr + b * src_sb + h * src_sh + rows, mask=ok, other=0) < 0)
        miss = miss & (tl.load(cache_source_ptr + b * cs_sb + h * cs_sh + rows, mask=ok, other=0) < 0)
        ones = miss.to(tl.int32)
        rank = count + tl.cumsum(ones, axis=0) - ones  # misses before this row
        tl.store(dest_ptr + b * dest_sb + h * dest_sh + rows, tl.where(miss, (cursor + rank) % CR, -1), mask=ok)
        count += tl.sum(ones, axis=0)
    tl.store(cursor_ptr + b * cur_sb + h, (cursor + count) % CR)
    tl.atomic_add(read_ptr + b, count.to(tl.int64))


@implement("triton", "number_misses", supports=triton_runs_on)
def number_misses(store, reselect: torch.Tensor) -> None:
    """One launch of ``reference_step.number_misses``."""
    source, cache_source, dest, cache = store.source, store.cache_source, store.cache_dest, store.cache
    batch, heads, rows = source.shape
    if batch * heads * rows == 0:
        return
    for name, t in (("source", source), ("cache_source", cache_source), ("cache_dest", dest)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton number_misses: {name} must be contiguous in its last dim")
    _misses_kernel[(heads, batch)](
        source, cache_source, reselect.view(torch.uint8), dest, cache.cursor, store.pool_rows_read,
        rows, cache.rows, *source.stride()[:2], *cache_source.stride()[:2], *dest.stride()[:2],
        # the loop's steps run one after another: one block for a decode's 2,048 rows (4,096 int32
        # a program)
        cache.cursor.stride(0), BLOCK=min(4096, triton.next_power_of_2(rows)),
    )
