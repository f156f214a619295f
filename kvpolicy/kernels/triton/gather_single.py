"""A single-row gather with its schedule exposed, for ParisKV's fetch from a pinned pool.

``out[b, h, r] = pool[b, h, slots[b, h, r]]`` where ``take[b]``, as ``gather_rows_into``
(kernels/triton/gather.py, whose kernel this file leaves alone). ParisKV fetches single tokens:
at 1M x 4 the selection's 1980 rows of 256 bytes per (sequence, head) lie ~135 KB apart in a
256 MB region, every row on its own 4 KB host page. gather.py's 16 KiB tiles (64 rows a program,
programs of one head side by side) read them at 24 GB/s on the H200 against 52.6 for a plain
pinned copy (session 8), where the same kernel reaches 45-50 GB/s at 128K (32 MB a head).
The gap growing with the pool, not the bytes, points at address translation (one GPU TLB
entry per row) more than at the number of loads in flight.

This kernel keeps gather.py's row copy and makes the schedule a choice, so one H200 run can
tell which of these moves the figure (``benchmarks/pinned_gather.py`` sweeps them):

- ``rows``: rows a program (1 to 128); fewer rows, more programs, each finishing sooner;
- ``warps``: warps a program;
- ``spread``: programs ordered (sequence, head)-fastest, so programs running together read
  from all B x H regions (different translation entries) instead of one region's neighbours;
- ``sort``: the slots sorted ascending before the copy (the rows written in sorted order and
  the permutation applied on the output side), for callers whose order is not the pool's;
- ``programs``: a persistent grid of that many programs walking the tiles in (sequence, head)
  order, ``programs`` tiles apart, so the programs running at any moment read one or two heads'
  regions. With one program per tile the whole gather is resident at once and touches every
  (sequence, head) region together: at 1M x 4 x 8 heads that is 8 GiB of pool and ~63K distinct
  4 KB pages (or ~4K 2 MB ones) in flight, past the GPU's translation reach; walking the heads in
  turn keeps the pages in flight to one region's (256 MB). Fewer rows in flight per program,
  so it needs enough programs to cover PCIe's latency.

Whether huge pages (2 MB host pages behind the registration) change the translation cost is a
property of the pool's memory, not of this kernel: the benchmark measures it with a pool
``madvise``'d to transparent huge pages; it cannot be tested without a GPU.

No host syncs, a grid from shapes alone: graph-capturable (``sort`` adds a torch sort and a
scatter, still capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather import _pool_argument
from .pdl import pdl_kernel, wait_for_previous

MAX_ROWS = 128
MAX_WARPS = 16


@pdl_kernel
@triton.jit
def _gather_single_kernel(
    pool_ptr, slots_ptr, take_ptr, order_ptr, out_ptr,
    R, H, B, TILES,
    pool_sb, pool_sh, pool_sr, pool_sd,
    slots_sb, slots_sh, slots_sr,
    order_sb, order_sh, order_sr,
    out_sb, out_sh, out_sr, out_sd,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_TAKE: tl.constexpr,
    SPREAD: tl.constexpr, HAS_ORDER: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    pid = tl.program_id(0).to(tl.int64)
    _copy_tile(pool_ptr, slots_ptr, take_ptr, order_ptr, out_ptr, pid, R, H, B, TILES,
               pool_sb, pool_sh, pool_sr, pool_sd, slots_sb, slots_sh, slots_sr, order_sb, order_sh, order_sr,
               out_sb, out_sh, out_sr, out_sd, D, BLOCK_D, ROWS, HAS_TAKE, SPREAD, HAS_ORDER)


@pdl_kernel
@triton.jit
def _gather_walk_kernel(
    pool_ptr, slots_ptr, take_ptr, order_ptr, out_ptr,
    R, H, B, TILES, PROGRAMS,
    pool_sb, pool_sh, pool_sr, pool_sd,
    slots_sb, slots_sh, slots_sr,
    order_sb, order_sh, order_sr,
    out_sb, out_sh, out_sr, out_sd,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_TAKE: tl.constexpr,
    HAS_ORDER: tl.constexpr, PDL: tl.constexpr,
):
    # persistent: program p copies tiles p, p + PROGRAMS, ... of the (sequence, head)-major order
    wait_for_previous(PDL)
    first = tl.program_id(0)
    walks = (TILES * H * B - first + PROGRAMS - 1) // PROGRAMS
    for walk in range(0, walks):
        index = first.to(tl.int64) + walk * PROGRAMS
        _copy_tile(pool_ptr, slots_ptr, take_ptr, order_ptr, out_ptr, index, R, H, B, TILES,
                   pool_sb, pool_sh, pool_sr, pool_sd, slots_sb, slots_sh, slots_sr, order_sb, order_sh, order_sr,
                   out_sb, out_sh, out_sr, out_sd, D, BLOCK_D, ROWS, HAS_TAKE, False, HAS_ORDER)


@triton.jit
def _copy_tile(
    pool_ptr, slots_ptr, take_ptr, order_ptr, out_ptr, pid, R, H, B, TILES,
    pool_sb, pool_sh, pool_sr, pool_sd, slots_sb, slots_sh, slots_sr, order_sb, order_sh, order_sr,
    out_sb, out_sh, out_sr, out_sd,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_TAKE: tl.constexpr,
    SPREAD: tl.constexpr, HAS_ORDER: tl.constexpr,
):
    if SPREAD:
        # (sequence, head) fastest: neighbouring programs read different regions of the pool
        bh = pid % (B * H)
        tile = pid // (B * H)
    else:
        # tile fastest: neighbouring programs read neighbouring rows of one region (gather.py's)
        tile = pid % TILES
        bh = pid // TILES
    h = bh % H
    b = bh // H
    rows = tile * ROWS + tl.arange(0, ROWS).to(tl.int64)
    # take_ptr is None when HAS_TAKE is off, so it must not be loaded at all; a sequence not taken
    # has no rows (none read, as a return would do, which a helper cannot do for its caller)
    limit = R
    if HAS_TAKE:
        limit = tl.where(tl.load(take_ptr + b) != 0, R, 0)
    row_ok = rows < limit
    slot = tl.load(slots_ptr + b * slots_sb + h * slots_sh + rows * slots_sr, mask=row_ok, other=0).to(tl.int64)
    if HAS_ORDER:
        # row r of the sorted slots goes to output row order[r]
        dest = tl.load(order_ptr + b * order_sb + h * order_sh + rows * order_sr, mask=row_ok, other=0).to(tl.int64)
    else:
        dest = rows
    cols = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (cols < D)[None, :]
    src = pool_ptr + b * pool_sb + h * pool_sh + slot[:, None] * pool_sr + cols[None, :] * pool_sd
    values = tl.load(src, mask=mask)
    dst = out_ptr + b * out_sb + h * out_sh + dest[:, None] * out_sr + cols[None, :] * out_sd
    tl.store(dst, values, mask=mask)


def gather_single_rows_into(
    pool: torch.Tensor, slots: torch.Tensor, take: torch.Tensor | None, out: torch.Tensor, *,
    rows: int = 16, warps: int = 4, spread: bool = False, sort: bool = False, programs: int | None = None,
) -> None:
    """``out[b] = pool[b, :, slots[b]]`` where ``take (B,)`` (None: every sequence).

    ``pool (B, H, cap, D)`` on ``out``'s device or in pinned CPU memory for a CUDA ``out``;
    ``slots (B, H, R)`` integer, each in ``[0, cap)`` (not checked on the device: checking would
    sync); ``out (B, H, R, D)`` of the pool's dtype. Sequences with ``take`` False keep ``out``.
    """
    if pool.dim() != 4 or slots.dim() != 3 or out.dim() != 4:
        raise ValueError(
            f"gather_single_rows_into: expected pool (B, H, cap, D), slots (B, H, R), out (B, H, R, D); got "
            f"{tuple(pool.shape)}, {tuple(slots.shape)}, {tuple(out.shape)}"
        )
    batch, heads, _, dim = pool.shape
    count = slots.shape[-1]
    if tuple(slots.shape) != (batch, heads, count) or tuple(out.shape) != (batch, heads, count, dim):
        raise ValueError(
            f"gather_single_rows_into: shapes do not match: pool {tuple(pool.shape)}, slots "
            f"{tuple(slots.shape)}, out {tuple(out.shape)}"
        )
    if slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(f"gather_single_rows_into: slots must be integers, got {slots.dtype}")
    if out.dtype != pool.dtype:
        raise ValueError(f"gather_single_rows_into: out is {out.dtype} but the pool is {pool.dtype}")
    if not (1 <= rows <= MAX_ROWS) or rows & (rows - 1):
        raise ValueError(f"gather_single_rows_into: rows must be a power of two in [1, {MAX_ROWS}], got {rows}")
    if not (1 <= warps <= MAX_WARPS) or warps & (warps - 1):
        raise ValueError(f"gather_single_rows_into: warps must be a power of two in [1, {MAX_WARPS}], got {warps}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"gather_single_rows_into: programs must be None or a positive int, got {programs!r}")
    if programs is not None and spread:
        raise ValueError("gather_single_rows_into: programs walks the tiles in (sequence, head) order; spread does not apply")
    if take is not None and take.numel() != batch:
        raise ValueError(f"gather_single_rows_into: take must have {batch} entries, got {take.numel()}")
    if batch * heads * count * dim == 0:
        return
    device = out.device
    pool_arg = _pool_argument(pool, device)
    slots = slots.to(device)
    order = None
    if sort:
        slots, order = slots.sort(-1)
    if take is not None:
        take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
    block_d = triton.next_power_of_2(dim)
    tile_rows = min(rows, triton.next_power_of_2(count))
    tiles = triton.cdiv(count, tile_rows)
    order_strides = order.stride() if order is not None else (0, 0, 0)
    if programs is not None:
        walkers = min(programs, tiles * heads * batch)
        _gather_walk_kernel[(walkers,)](
            pool_arg, slots, take, order, out,
            count, heads, batch, tiles, walkers,
            *pool.stride(),
            *slots.stride(),
            *order_strides,
            *out.stride(),
            D=dim, BLOCK_D=block_d, ROWS=tile_rows, HAS_TAKE=take is not None, HAS_ORDER=order is not None,
            num_warps=warps,
        )
        return
    _gather_single_kernel[(tiles * heads * batch,)](
        pool_arg, slots, take, order, out,
        count, heads, batch, tiles,
        *pool.stride(),
        *slots.stride(),
        *order_strides,
        *out.stride(),
        D=dim, BLOCK_D=block_d, ROWS=tile_rows, HAS_TAKE=take is not None,
        SPREAD=spread, HAS_ORDER=order is not None,
        num_warps=warps,
    )
