"""The sticky score bias of ``overlap.StickyTopBudget`` in one Triton launch.

As a dozen PyTorch ops (finite mask, count, mean, spread, hash, add) it ran 12 launches per
re-selecting layer inside the benchmark's captured step, about 25 us a layer of GPU time at 4x128K
that a real model's policy never pays (H200, session 15 profile). One program per (sequence, head)
row reads its scores three times (mean, spread, write), from L2 after the first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .overlap import HASH_MULTIPLIER

_BLOCK = 1024  # scores a program reads per iteration


@triton.jit
def _sticky_kernel(scores_ptr, out_ptr, U, stickiness, multiplier, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    scores_at, out_at = scores_ptr + row * U, out_ptr + row * U
    count = tl.zeros([BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for u0 in range(0, U, BLOCK):
        units = u0 + tl.arange(0, BLOCK)
        score = tl.load(scores_at + units, mask=units < U, other=float("-inf"))
        finite = tl.abs(score) < float("inf")  # False for NaN too
        count += finite.to(tl.float32)
        total += tl.where(finite, score, 0.0)
    count_all = tl.maximum(tl.sum(count, axis=0), 1.0)
    mean = tl.sum(total, axis=0) / count_all
    squares = tl.zeros([BLOCK], tl.float32)
    for u0 in range(0, U, BLOCK):
        units = u0 + tl.arange(0, BLOCK)
        score = tl.load(scores_at + units, mask=units < U, other=float("-inf"))
        finite = tl.abs(score) < float("inf")
        deviation = tl.where(finite, score - mean, 0.0)
        squares += deviation * deviation
    spread = tl.sqrt(tl.sum(squares, axis=0) / count_all)
    for u0 in range(0, U, BLOCK):
        units = u0 + tl.arange(0, BLOCK)
        ok = units < U
        score = tl.load(scores_at + units, mask=ok, other=0.0)
        # the multiplier is passed at run time, so Triton types it int64 (a constant above 2**31 is uint32)
        unit_hash = ((units.to(tl.int64) * multiplier) % 4294967296).to(tl.float32) / 4294967296.0
        tl.store(out_at + units, score + stickiness * spread * unit_hash, mask=ok)


def sticky_bias(scores: torch.Tensor, stickiness: float) -> torch.Tensor:
    """``(..., U)`` float32 scores -> the same plus ``stickiness * spread * unit_hash`` per row
    (``overlap.sticky_bias``, the reference), in a new tensor."""
    if scores.dtype != torch.float32:
        raise ValueError(f"triton sticky_bias: scores must be float32, got {scores.dtype}")
    scores = scores.contiguous()
    out = torch.empty_like(scores)
    units = scores.shape[-1]
    rows = scores.numel() // units if units else 0
    if rows:
        _sticky_kernel[(rows,)](scores, out, units, float(stickiness), HASH_MULTIPLIER,
                                BLOCK=min(_BLOCK, triton.next_power_of_2(units)))
    return out
