"""Triton row write (op ``write_row``): one decode token into the pool at a device counter.

The twin of the gather: the pool may be in pinned host memory while the token is on the GPU;
the kernel writes the host row directly (through unified virtual addressing), at the slot read
from a device tensor, so a captured decode step writes each replay's token to its own slot.
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
def _write_kernel(
    pool_ptr, slot_ptr, row_ptr,
    pool_sb, pool_sh, pool_sr, pool_sd,
    row_sb, row_sh, row_sd,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    values = tl.load(row_ptr + b * row_sb + h * row_sh + cols * row_sd, mask=mask)
    dst = pool_ptr + b * pool_sb + h * pool_sh + slot * pool_sr + cols * pool_sd
    tl.store(dst, values.to(pool_ptr.dtype.element_ty), mask=mask)


@implement("triton", "write_row", supports=triton_runs_on)
def write_row(pool: torch.Tensor, slot: torch.Tensor, row: torch.Tensor) -> None:
    """``pool[:, :, slot] = row`` for ``row (B, H, D)`` and a 0-dim long ``slot`` on ``row``'s device."""
    batch, heads, _, dim = pool.shape
    if tuple(row.shape) != (batch, heads, dim):
        raise ValueError(f"triton write_row: row {tuple(row.shape)} does not fit pool {tuple(pool.shape)}")
    if slot.numel() != 1 or slot.device != row.device:
        raise ValueError("triton write_row: slot must be a one-element tensor on the row's device")
    if batch * heads * dim == 0:
        return
    pool_arg = _pool_argument(pool, row.device)
    _write_kernel[(heads, batch)](
        pool_arg, slot, row,
        *pool.stride(),
        *row.stride(),
        D=dim, BLOCK_D=triton.next_power_of_2(dim),
    )
