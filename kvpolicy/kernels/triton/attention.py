"""Triton ``sparse_decode_attention``: split-K flash decoding over several KV parts, GQA-aware.

Stage 1 launches once per part over ``(batch * kv_head, split)``. A program streams
its split's K/V tiles once and scores them against all ``G = Hq / H`` query heads of its KV head
in one ``tl.dot`` (the ``G`` rows padded to 16, the smallest ``tl.dot`` tile: decode is
memory-bound, so the padded rows cost no extra bytes). It writes the split's running max (log2
domain), sum of exponentials and unnormalised ``(G, D)`` accumulator in float32. Stage 2 merges
all splits of all parts for each query head. Long parts get enough splits to fill the GPU;
short ones stay in one.

A part may name rows it reads from a GPU pool instead (a ``PoolRows``: rows ``[start, start + R)``
by slot): those rows load from the pool row of their slot (mapped through the prompt zone's
``zone_rows``), the others from the part (``_load_rows``), so a GPU pool's re-selection moves no rows
at all (an every-step policy's: ``store.ATTEND_POOL_BY_SLOT``).

Semantics beyond the reference: positions whose ``valid`` is False are never read (their cache
slots may hold garbage or NaN), and a query head with no valid position in any part gets a zero
output rather than the reference's NaN.

Shapes alone decide grids, splits and buffers; nothing reads tensor values on the host, so the
op can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .gather import zone_pool_row
from .pdl import pdl_kernel, wait_for_previous

# finite stand-in for -inf: NEG - NEG stays 0, so empty splits never produce NaN
_NEG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634
_HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# stage 1 aims at this many programs per SM on long parts: several resident CTAs hide memory
# latency and shrink the last wave's tail (2, 4 and 8 measured on an H200; 8 was best)
PROGRAMS_PER_SM = 8
# ... down to one K/V tile a split: a budget's 2,048 tokens at batch 1 (8 rows) then run as 256
# programs, not 64 (session 29, H100: 9.2 against 14.6 us a layer for a GPU pool's rows by slot, 6.5
# against 9.7 for a dense part; 1, 2 and 4 measured, docs/bench/session29/t1)
MIN_TILES_PER_SPLIT = 1
# ... and a part at most this many splits: stage 2 walks a row's splits serially, which
# dominated when few rows (batch * kv_head = 1) had over 500 splits
MAX_SPLITS = 256
_DEFAULT_SMS = 132  # an H100/H200; used off-GPU (the interpreter) so split choice matches
_COMBINE_BLOCK = 16  # splits merged per step in stage 2
NUM_WARPS = 4
NUM_STAGES = 3
# ... and for a part with rows read from a pool by slot, whose K/V loads wait on their slots': 2 stages
# timed faster than 3 at batches 1, 4 and 8 of a 2,048-row budget (session 42, H100, 2,304 tokens, the
# kernel alone as 36 replayed calls: 9.8 / 19.3 / 38.2 us a call against 10.2 / 22.7 / 46.5;
# benchmarks/attention_by_slot.py, docs/bench/session42/s1; timed with the slots' loads masked by the
# range alone, a load order since removed as no faster end to end). Offline (Triton 3.9, sm_90) the
# variant through the zone map takes 140 registers at 2 stages, 205 at 3
NUM_STAGES_BY_SLOT = 2
# how a part's pool rows load (``_load_rows``): True, one load through a pointer chosen per row;
# False, a second masked load and a choice of values. Compiled offline for sm_90 as a launch
# specialises them (benchmarks/kernel_resources.py, Triton 3.9, head_dim 128; at 3 stages, session 20):
# 142 registers against 175 (197 against 232 through the zone map; a part alone 135), both as 16-byte
# cp.async loads with no spill; at 2 stages (session 42) 140 against 152 (140 against 178 through the
# map); which is faster is not measured yet
POOL_ROWS_BY_POINTER = True


@triton.jit
def _load_rows(
    k_base, v_base, offs, keep, d, stride_kn, stride_vn,
    pk_ptr, pv_ptr, slots_ptr, zone_ptr, b, h, pool_lo, pool_n, zone_end,
    pk_sb, pk_sh, pk_sn, pv_sb, pv_sh, pv_sn, s_sb, s_sh, z_sb, z_sh,
    FROM_POOL: tl.constexpr, HAS_ZONE: tl.constexpr, BY_POINTER: tl.constexpr,
):
    """The ``[BLOCK_N, D]`` key and value tiles of the rows ``offs`` where ``keep`` (zeros
    elsewhere: invalid rows are not read, they may hold garbage): the part's rows, and with
    ``FROM_POOL`` the pool row of the slot of each row in ``[pool_lo, pool_lo + pool_n)``, through a
    pointer chosen per row (``BY_POINTER``) or a second masked load (``POOL_ROWS_BY_POINTER``)."""
    if FROM_POOL:
        pooled = keep & (offs >= pool_lo) & (offs < pool_lo + pool_n)
        slot = tl.load(slots_ptr + b * s_sb + h * s_sh + (offs - pool_lo), mask=pooled, other=0).to(tl.int64)
        row = slot
        if HAS_ZONE:
            row = zone_pool_row(slot, zone_ptr + b * z_sb + h * z_sh, zone_end, pooled)
        k_rows = pk_ptr + b * pk_sb + h * pk_sh + row[:, None] * pk_sn + d[None, :]
        v_rows = pv_ptr + b * pv_sb + h * pv_sh + row[:, None] * pv_sn + d[None, :]
        k_own = k_base + offs[:, None] * stride_kn + d[None, :]
        v_own = v_base + offs[:, None] * stride_vn + d[None, :]
        if BY_POINTER:
            k = tl.load(tl.where(pooled[:, None], k_rows, k_own), mask=keep[:, None], other=0.0)
            v = tl.load(tl.where(pooled[:, None], v_rows, v_own), mask=keep[:, None], other=0.0)
        else:
            own = keep & ~pooled
            k = tl.where(pooled[:, None], tl.load(k_rows, mask=pooled[:, None], other=0.0),
                         tl.load(k_own, mask=own[:, None], other=0.0))
            v = tl.where(pooled[:, None], tl.load(v_rows, mask=pooled[:, None], other=0.0),
                         tl.load(v_own, mask=own[:, None], other=0.0))
    else:
        k = tl.load(k_base + offs[:, None] * stride_kn + d[None, :], mask=keep[:, None], other=0.0)
        v = tl.load(v_base + offs[:, None] * stride_vn + d[None, :], mask=keep[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_split(
    q, k_ptr, v_ptr, valid_ptr, b, h, n, split, tiles_per_split, qk_scale,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mn,
    pk_ptr, pv_ptr, slots_ptr, zone_ptr, pool_lo, pool_n, zone_end,
    pk_sb, pk_sh, pk_sn, pv_sb, pv_sh, pv_sn, s_sb, s_sh, z_sb, z_sh,
    G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr, FROM_POOL: tl.constexpr, HAS_ZONE: tl.constexpr,
    BY_POINTER: tl.constexpr,
):
    """Online softmax of one split of one part for the ``G_PAD`` query rows ``q``."""
    d = tl.arange(0, D)
    if QK_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    valid_base = valid_ptr + b * stride_mb + h * stride_mh

    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, n)
    for lo in range(start, end, BLOCK_N):
        offs = lo + tl.arange(0, BLOCK_N)
        inside = offs < n
        keep = (tl.load(valid_base + offs * stride_mn, mask=inside, other=0) != 0) & inside
        k, v = _load_rows(
            k_base, v_base, offs, keep, d, stride_kn, stride_vn,
            pk_ptr, pv_ptr, slots_ptr, zone_ptr, b, h, pool_lo, pool_n, zone_end,
            pk_sb, pk_sh, pk_sn, pv_sb, pv_sh, pv_sn, s_sb, s_sh, z_sb, z_sh, FROM_POOL, HAS_ZONE, BY_POINTER,
        )
        if QK_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(keep[None, :], s * qk_scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        # guard: while a row has seen no valid token m_new is _NEG and s - m_new is 0
        p = tl.where(keep[None, :], tl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PV_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@pdl_kernel
@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr,
    n, heads, total_splits, split_offset, tiles_per_split, qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mn,
    pk_ptr, pv_ptr, slots_ptr, zone_ptr, pool_lo, pool_n, zone_end,
    pk_sb, pk_sh, pk_sn, pv_sb, pv_sh, pv_sn, s_sb, s_sh, z_sb, z_sh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr, FROM_POOL: tl.constexpr, HAS_ZONE: tl.constexpr,
    BY_POINTER: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    # the G query heads of KV head h, padded to a tl.dot tile
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
    m_i, l_i, acc = _attend_split(
        q, k_ptr, v_ptr, valid_ptr, b, h, n, split, tiles_per_split, qk_scale,
        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mn,
        pk_ptr, pv_ptr, slots_ptr, zone_ptr, pool_lo, pool_n, zone_end,
        pk_sb, pk_sh, pk_sn, pv_sb, pv_sh, pv_sn, s_sb, s_sh, z_sb, z_sh,
        G_PAD, D, BLOCK_N, QK_FP32, PV_FP32, FROM_POOL, HAS_ZONE, BY_POINTER,
    )
    # partials are laid out (B * Hq, total_splits[, D]); row = b * Hq + h * G + g
    row = bh * G + g
    slot = row * total_splits + split_offset + split
    tl.store(m_ptr + slot, m_i, mask=g < G)
    tl.store(l_ptr + slot, l_i, mask=g < G)
    tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc, mask=g[:, None] < G)


@pdl_kernel
@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    q_heads, total_splits, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // q_heads
    hq = row % q_heads
    d = tl.arange(0, D)

    m_run = tl.max(tl.full([BLOCK_S], _NEG, tl.float32), axis=0)
    l_run = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, total_splits, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        inside = offs < total_splits
        slot = row * total_splits + offs
        m = tl.load(m_ptr + slot, mask=inside, other=_NEG)
        l = tl.load(l_ptr + slot, mask=inside, other=0.0)
        a = tl.load(acc_ptr + slot[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp2(m_run - m_new)
        # empty splits carry l = 0 and acc = 0, so their weight (even 1) adds nothing
        w = tl.exp2(m - m_new)
        l_run = l_run * alpha + tl.sum(w * l, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m_run = m_new

    # no valid token anywhere: zeros, not NaN
    denom = tl.where(l_run > 0, l_run, 1.0)
    out = tl.where(l_run > 0, acc / denom, 0.0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def _block_n(dim: int, itemsize: int = 2) -> int:
    # a K tile of at most 16 KiB keeps the pipelined K/V stages within shared memory
    return max(16, min(64, 16384 // (dim * itemsize)))


def _tiles_per_split(n: int, programs: int, block_n: int, sms: int, split_tokens: int | None) -> int:
    """K/V tiles each split of an ``n``-token part streams; shapes alone decide it."""
    tiles = triton.cdiv(n, block_n)
    if split_tokens is not None:
        return max(1, triton.cdiv(split_tokens, block_n))
    # enough splits to fill the GPU with ``programs`` (batch * kv_head) rows, none too short
    wanted = min(triton.cdiv(PROGRAMS_PER_SM * sms, max(programs, 1)), MAX_SPLITS)
    splits = max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT))
    return triton.cdiv(tiles, splits)


def _part_args(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, tiles_per_split: int) -> tuple:
    """Kernel arguments of one part: k, v, valid, n, tiles per split, then 9 strides."""
    batch, heads, n, _ = keys.shape
    keys, values = _unit_last_stride(keys), _unit_last_stride(values)
    if valid.dim() == 2:
        valid = valid[:, None, :].expand(batch, heads, n)  # stride 0 over heads
    valid = valid.view(torch.uint8)
    strides = (*keys.stride()[:3], *values.stride()[:3], *valid.stride())
    return (keys, values, valid, n, tiles_per_split, *strides)


def _pool_args(part) -> tuple[tuple, bool, bool]:
    """A part's pool-rows arguments (pool keys, values, slots, zone rows, start, rows, zone end,
    10 strides), whether it has any, and whether a zone maps its slots; placeholders without."""
    from_pool = part[3] if len(part) > 3 else None
    if from_pool is None:
        keys = part[0]
        return (keys, keys, keys, keys, 0, 0, 0, *(0,) * 10), False, False
    has_zone = from_pool.zone_rows is not None and from_pool.zone_end > 0
    zone = from_pool.zone_rows if has_zone else from_pool.slots  # any tensor: never read without a zone
    pk, pv, slots = from_pool.keys, from_pool.values, from_pool.slots
    args = (pk, pv, slots, zone, from_pool.start, slots.shape[-1], from_pool.zone_end,
            *pk.stride()[:3], *pv.stride()[:3], *slots.stride()[:2], *zone.stride()[:2])
    return args, True, has_zone


def _check_pool_rows(part, batch: int, kv_heads: int, dim: int) -> None:
    """A part's ``PoolRows`` must fit it: pool rows of its shape and dtype on its device, slots
    for rows inside the part, dense in their last dim."""
    keys, from_pool = part[0], part[3]
    pool_keys, pool_values, slots = from_pool.keys, from_pool.values, from_pool.slots
    capacity = pool_keys.shape[2] if pool_keys.dim() == 4 else -1
    if tuple(pool_keys.shape) != (batch, kv_heads, capacity, dim) or pool_values.shape != pool_keys.shape:
        raise ValueError(f"pool rows: keys and values must be (B, H, capacity, D) = ({batch}, {kv_heads}, capacity, "
                         f"{dim}), got {tuple(pool_keys.shape)} and {tuple(pool_values.shape)}")
    if pool_keys.dtype != keys.dtype or pool_values.dtype != part[1].dtype or pool_keys.device != keys.device:
        raise ValueError(f"pool rows: the pool must be {keys.dtype} on {keys.device} like its part, got "
                         f"{pool_keys.dtype} on {pool_keys.device}")
    if slots.dtype != torch.long or slots.dim() != 3 or tuple(slots.shape[:2]) != (batch, kv_heads):
        raise ValueError(f"pool rows: slots must be long (B, H, R), got {slots.dtype} {tuple(slots.shape)}")
    if not 0 <= from_pool.start <= keys.shape[2] - slots.shape[-1]:
        raise ValueError(f"pool rows: rows [{from_pool.start}, {from_pool.start + slots.shape[-1]}) must lie "
                         f"inside the part's {keys.shape[2]} rows")
    for name, t in (("keys", pool_keys), ("values", pool_values), ("slots", slots)):
        if t.stride(-1) != 1:
            raise ValueError(f"pool rows: {name} must be contiguous in the last dim")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # the kernels take strides for every dim but the last, which must be dense
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check(query: torch.Tensor, parts) -> tuple[int, int, int, int]:
    if query.dim() != 3:
        raise ValueError(f"query must be (B, Hq, D), got shape {tuple(query.shape)}")
    batch, q_heads, dim = query.shape
    if dim not in _HEAD_DIMS:
        raise ValueError(f"triton sparse_decode_attention supports head_dim in {_HEAD_DIMS}, got {dim}")
    if len(parts) == 0:
        raise ValueError("sparse_decode_attention needs at least one KV part")
    kv_heads = parts[0][0].shape[1]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    for tensor in (query, *(t for part in parts for t in part[:2])):
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"triton sparse_decode_attention supports dtypes {_DTYPES}, got {tensor.dtype}")
    for part in parts:
        keys, values, valid = part[:3]
        n = keys.shape[2] if keys.dim() == 4 else -1
        expected = (batch, kv_heads, n, dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise ValueError(
                f"keys and values must be (B, H, n, D) = {expected[:2]} x n x {dim}, "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if valid.dtype != torch.bool or tuple(valid.shape) not in ((batch, kv_heads, n), (batch, n)):
            raise ValueError(f"valid must be bool (B, H, n) or (B, n), got {valid.dtype} {tuple(valid.shape)}")
        if len(part) > 3 and part[3] is not None:
            _check_pool_rows(part, batch, kv_heads, dim)
    return batch, q_heads, kv_heads, dim


@implement("triton", "sparse_decode_attention", supports=triton_runs_on)
def sparse_decode_attention(
    query: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
    *,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.sparse_decode_attention``; see the module docstring.

    ``split_tokens`` forces the tokens per split (rounded up to whole tiles); by default the
    split count is chosen from the shapes so that long parts fill the GPU.
    """
    batch, q_heads, kv_heads, dim = _check(query, parts)
    group = q_heads // kv_heads
    out = torch.empty(batch, q_heads, dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    query = _unit_last_stride(query)
    block_n = _block_n(dim, max(t.element_size() for part in parts for t in part[:2]))
    sms = _sm_count(query.device)

    plans = []  # (args for one part, its pool rows' args and flags, its splits), parts with no token left out
    for part in parts:
        keys, values, valid = part[:3]
        n = keys.shape[2]
        if n == 0:
            continue
        tiles_per_split = _tiles_per_split(n, batch * kv_heads, block_n, sms, split_tokens)
        splits = triton.cdiv(triton.cdiv(n, block_n), tiles_per_split)
        plans.append((_part_args(keys, values, valid, tiles_per_split), _pool_args(part), splits))
    total_splits = sum(splits for *_, splits in plans)

    # every slot below is written by exactly one stage-1 program, so empty is enough
    rows = batch * q_heads
    m_part = torch.empty(rows, total_splits, dtype=torch.float32, device=query.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(rows, total_splits, dim, dtype=torch.float32, device=query.device)

    group_pad = max(16, triton.next_power_of_2(group))
    qk_scale = float(scale) * _LOG2E
    # Triton's interpreter (CPU) multiplies bf16 dot operands as their raw uint16 bits (seen
    # in 3.9), so there bf16 tiles go through float32 dots
    fp32_dots_for = (torch.bfloat16,) if query.device.type == "cpu" else ()
    offset = 0
    # one launch per part: a launch taking all parts at once was slower on the GPU (its
    # branches' shared memory added up) and costlier on the host (Triton binds per argument)
    for args, (pool_args, from_pool, has_zone), splits in plans:
        keys, values = args[0], args[1]
        _split_kernel[(batch * kv_heads, splits)](
            query, *args[:3], m_part, l_part, acc_part,
            args[3], kv_heads, total_splits, offset, args[4], qk_scale,
            query.stride(0), query.stride(1), *args[5:], *pool_args,
            G=group, G_PAD=group_pad, D=dim, BLOCK_N=block_n, FROM_POOL=from_pool, HAS_ZONE=has_zone,
            BY_POINTER=POOL_ROWS_BY_POINTER,
            # float32 tiles, or a query of another dtype, take exact float32 dots
            QK_FP32=keys.dtype == torch.float32 or keys.dtype != query.dtype or keys.dtype in fp32_dots_for,
            PV_FP32=values.dtype == torch.float32 or values.dtype in fp32_dots_for,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES_BY_SLOT if from_pool else NUM_STAGES,
        )
        offset += splits

    _combine_kernel[(rows,)](
        m_part, l_part, acc_part, out,
        q_heads, total_splits, out.stride(0), out.stride(1),
        D=dim, BLOCK_S=_COMBINE_BLOCK,
        num_warps=4,
    )
    return out


