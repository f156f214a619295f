"""A query in 14-bit fixed point: what ``ScoreGap.fixed_query`` multiplies the outlier keys by.

Each query head's elements become integers ``x`` times a power of two ``step``, from the head's largest
magnitude ``a``: ``step = 2 ** (e - 13)`` with ``2 ** e <= a < 2 ** (e + 1)``, so ``|x| <= 2 ** 14`` and
``x = floor(q / step + 0.5)``. Every operation is exact in float32 but that one rounding (at most half a step:
``2 ** -14`` of ``a``), so the fused op (``kernels/triton/score_gap_outlier.py``) computes the same integers from
the same float32 query: it splits ``x`` into two int8 digits,
``x = 256 * hi + lo`` with ``hi = (x + 128) >> 8`` in [-64, 64] and ``lo`` in [-128, 127], and multiplies the
int8 keys by each on tensor cores into int32, ``256 * (k . hi) + k . lo = k . x`` exactly.
"""

from __future__ import annotations

import torch

# the fixed point's bits below the largest element's leading one
FRACTION_BITS = 13
# the smallest step's exponent is bounded so that 1 / step stays a normal float32
LOWEST_STEP_EXPONENT = -126


def fixed_point(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, step)``: ``query`` (float32, heads by elements last) as integers ``x`` (float32 values, ``|x| <=
    2 ** 14``) times ``step`` (float32, a power of two a head, ``query``'s shape less its last dimension)."""
    largest = query.abs().amax(-1)
    exponent = torch.frexp(largest).exponent - 1  # 2 ** exponent <= largest < 2 ** (exponent + 1)
    shift = (exponent - FRACTION_BITS).clamp(min=LOWEST_STEP_EXPONENT)
    step = torch.ldexp(torch.ones_like(largest), shift)
    return torch.floor(torch.ldexp(query, -shift.unsqueeze(-1)) + 0.5), step


def fixed_query(query: torch.Tensor) -> torch.Tensor:
    """``query`` (float32) rounded to its fixed point, ``x * step``: exact in float32."""
    x, step = fixed_point(query)
    return x * step.unsqueeze(-1)
