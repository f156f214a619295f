"""Triton prompt-unit statistics (op ``unit_stats``): each unit's key sum, min and max in one pass.

The reference scatters every key into its unit three times (a float32 ``scatter_add``, then
``amin`` and ``amax``); on the GPU those contend on atomics, about 0.7 ms a layer at 8K tokens,
most of a louiskv prefill's time over full attention's. Here one program owns one (sequence,
head, unit): it reads its unit's tokens through the sorted ``order`` (a unit's tokens are one run
of it) and adds them one at a time in that order, so every float32 sum is rounded exactly as the
reference's sequential ``scatter_add`` rounds it (bit-identical to the CPU reference). The loads
of a block of tokens are issued together; only the additions are sequential.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous

# tokens whose rows are loaded together before they are added in order
_BLOCK_T = 16


@pdl_kernel
@triton.jit
def _unit_stats_kernel(
    keys_ptr, order_ptr, start_ptr, size_ptr, sum_ptr, min_ptr, max_ptr,
    H,
    keys_sb, keys_sh, keys_sn, keys_sd,
    order_sb, order_sh, order_sn,
    run_sb, run_sh, run_su,
    out_sb, out_sh, out_su, out_sd,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    u = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    run = b * run_sb + h * run_sh + u * run_su
    first = tl.load(start_ptr + run).to(tl.int64)
    count = tl.load(size_ptr + run).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < D
    order_row = order_ptr + b * order_sb + h * order_sh
    key_row = keys_ptr + b * keys_sb + h * keys_sh + cols * keys_sd
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    low = tl.full([BLOCK_D], float("inf"), dtype=tl.float32)
    high = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
    for t0 in range(0, count, BLOCK_T):
        for i in tl.static_range(BLOCK_T):
            live = t0 + i < count
            # past the unit's end, re-read its last token (always in bounds) and add nothing
            at = first + tl.minimum(t0 + i, count - 1)
            token = tl.load(order_row + at * order_sn).to(tl.int64)
            key = tl.load(key_row + token * keys_sn, mask=in_row, other=0.0).to(tl.float32)
            total = tl.where(live, total + key, total)
            low = tl.where(live, tl.minimum(low, key), low)
            high = tl.where(live, tl.maximum(high, key), high)
    out = b * out_sb + h * out_sh + u * out_su + cols * out_sd
    tl.store(sum_ptr + out, total, mask=in_row)
    tl.store(min_ptr + out, low, mask=in_row)
    tl.store(max_ptr + out, high, mask=in_row)


@implement("triton", "unit_stats", supports=triton_runs_on)
def unit_stats(keys: torch.Tensor, labels: torch.Tensor, order: torch.Tensor, start: torch.Tensor,
               size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``reference.unit_stats`` (reads ``order``, ``start`` and ``size``; ``labels`` is unused)."""
    batch, heads, n, dim = keys.shape
    units = start.shape[-1]
    if tuple(order.shape) != (batch, heads, n) or tuple(size.shape) != tuple(start.shape) or start.shape[:2] != (batch, heads):
        raise ValueError(f"triton unit_stats: order {tuple(order.shape)}, start {tuple(start.shape)} and size "
                         f"{tuple(size.shape)} do not fit keys {tuple(keys.shape)}")
    if batch * heads > 65535:  # the grid's second axis
        raise ValueError(f"triton unit_stats: {batch} x {heads} (sequence, head) rows, at most 65,535")
    start, size = start.contiguous(), size.contiguous()  # one set of strides serves both
    key_sum = torch.empty(batch, heads, units, dim, dtype=torch.float32, device=keys.device)
    key_min, key_max = torch.empty_like(key_sum), torch.empty_like(key_sum)
    if units == 0 or batch * heads == 0:
        return key_sum, key_min, key_max
    block_d = triton.next_power_of_2(dim)
    _unit_stats_kernel[(units, batch * heads)](
        keys, order, start, size, key_sum, key_min, key_max,
        heads,
        *keys.stride(), *order.stride(), *start.stride(), *key_sum.stride(),
        D=dim, BLOCK_D=block_d, BLOCK_T=_BLOCK_T, num_warps=1 if block_d <= 128 else 2,
    )
    return key_sum, key_min, key_max
