"""Triton row gather (ops ``gather_rows`` and ``gather_rows_into``).

``out[b, h, r] = pool[b, h, slots[b, h, r]]``; each row is ``D`` contiguous elements.
One program copies a ``[ROWS, D]`` tile (the slots of ``ROWS`` consecutive outputs of one
(sequence, head)), so every thread keeps several independent 16-byte loads in flight.

The pool may sit in pinned host memory while ``out`` is on the GPU: the kernel then reads
the host rows directly over PCIe (zero-copy, through unified virtual addressing), moving only
the rows asked for. Triton refuses CPU tensors as arguments, so the pool goes in as a small
object with ``data_ptr()`` and ``dtype``; the driver still checks that the device can
address the pointer. ``gather_rows_into`` skips whole sequences: a program whose sequence
has ``take[b]`` False returns before reading any pool byte.

No host syncs and the grid comes from shapes alone, so both ops can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous

# bytes one program copies: several loads in flight per thread to cover PCIe latency, while a
# 2048-row gather still spreads over a few hundred programs. H200, pinned bf16 pool, D=128,
# 8 heads x 2048 rows: 45 GB/s (B=1) and 50 GB/s (B=4) against 52-55 GB/s for a pinned H2D
# copy; 4 to 32 KiB tiles all land within 3 GB/s of that
_TILE_BYTES = 16384


class _DevicePointer:
    """What Triton's launcher needs of a pointer argument, for a pinned host tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # keeps the memory alive while the launch is queued
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


@triton.jit
def zone_pool_row(slot, zone_row_ptr, zone_end, mask):
    """The pool row of each ``slot`` (int64; read where ``mask``): the prompt's zone is laid out
    unit by unit (``zone_row_ptr``: this (sequence, head)'s row of ``Pool.zone_rows``), so its slots
    map to rows; later slots are rows."""
    in_zone = slot < zone_end
    zone_slot = tl.minimum(tl.maximum(slot, 0), zone_end - 1)
    mapped = tl.load(zone_row_ptr + zone_slot, mask=mask & in_zone, other=0)
    return tl.where(in_zone, mapped.to(tl.int64), slot)


@pdl_kernel
@triton.jit
def _gather_kernel(
    pool_ptr, slots_ptr, take_ptr, out_ptr,
    R,
    pool_sb, pool_sh, pool_sr, pool_sd,
    slots_sb, slots_sh, slots_sr,
    out_sb, out_sh, out_sr, out_sd,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_TAKE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    tile = tl.program_id(0)
    # int64: pools reach past 2**31 elements
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    # nested: take_ptr is None when HAS_TAKE is off, so it must not be loaded at all
    if HAS_TAKE:  # noqa: SIM102
        if tl.load(take_ptr + b) == 0:
            return
    rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    slot = tl.load(slots_ptr + b * slots_sb + h * slots_sh + rows * slots_sr, mask=row_ok, other=0)
    slot = slot.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        # mask constant along a row: loads stay 16-byte vectors
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (cols < D)[None, :]
    src = pool_ptr + b * pool_sb + h * pool_sh + slot[:, None] * pool_sr + cols[None, :] * pool_sd
    rows_of = tl.load(src, mask=mask)
    dst = out_ptr + b * out_sb + h * out_sh + rows[:, None] * out_sr + cols[None, :] * out_sd
    tl.store(dst, rows_of, mask=mask)


def _pool_argument(pool: torch.Tensor, device: torch.device):
    """The pool as a kernel argument for a launch on ``device``, or a clear refusal."""
    if pool.device == device:
        return pool
    if device.type == "cuda" and pool.device.type == "cpu":
        if not pool.is_pinned():
            raise ValueError(
                "triton gather_rows: the pool is in pageable CPU memory, which the GPU cannot "
                "read directly; allocate it pinned (torch.empty(..., pin_memory=True)) or use "
                "the reference backend"
            )
        return _DevicePointer(pool)
    raise ValueError(
        f"triton gather_rows: pool on {pool.device} cannot be gathered into {device}; the pool "
        "must be on the output's device, or in pinned CPU memory for a CUDA output"
    )


def _launch(pool: torch.Tensor, slots: torch.Tensor, take: torch.Tensor | None, out: torch.Tensor) -> None:
    batch, heads, _, dim = pool.shape
    rows = slots.shape[-1]
    if tuple(slots.shape) != (batch, heads, rows) or tuple(out.shape) != (batch, heads, rows, dim):
        raise ValueError(
            f"triton gather_rows: shapes do not match: pool {tuple(pool.shape)}, slots "
            f"{tuple(slots.shape)}, out {tuple(out.shape)}"
        )
    if out.dtype != pool.dtype:
        raise ValueError(f"triton gather_rows: out is {out.dtype} but the pool is {pool.dtype}")
    if batch * heads * rows * dim == 0:
        return
    device = out.device
    pool_arg = _pool_argument(pool, device)
    slots = slots.to(device)  # no-op when already there
    if take is not None:
        take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
    block_d = triton.next_power_of_2(dim)
    tile_rows = max(1, min(_TILE_BYTES // (block_d * pool.element_size()), 128))
    tile_rows = min(tile_rows, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, tile_rows), heads, batch)
    _gather_kernel[grid](
        pool_arg, slots, take, out,
        rows,
        *pool.stride(),
        *slots.stride(),
        *out.stride(),
        D=dim, BLOCK_D=block_d, ROWS=tile_rows, HAS_TAKE=take is not None,
    )


@implement("triton", "gather_rows", supports=triton_runs_on)
def gather_rows(pool: torch.Tensor, slots: torch.Tensor, out_device: torch.device) -> torch.Tensor:
    """Rows of ``pool (B, H, cap, D)`` at ``slots (B, H, R)`` -> ``(B, H, R, D)`` on ``out_device``.

    ``pool`` is on ``out_device``, or in pinned CPU memory for a CUDA ``out_device``.
    """
    batch, heads, _, dim = pool.shape
    out = torch.empty(batch, heads, slots.shape[-1], dim, dtype=pool.dtype, device=out_device)
    _launch(pool, slots, None, out)
    return out


@implement("triton", "gather_rows_into", supports=triton_runs_on)
def gather_rows_into(pool: torch.Tensor, slots: torch.Tensor, take: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b] = pool[b, :, slots[b]]`` where ``take (B,)``; other sequences move no bytes."""
    _launch(pool, slots, take, out)
