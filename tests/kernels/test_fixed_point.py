"""``kernels/fixed_point.py``: a query in 14-bit fixed point, what ``ScoreGap.fixed_query`` multiplies the int8
outlier keys by (the fused op splits the integers into two int8 digits)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import ConfigError
from kvpolicy.kernels.fixed_point import fixed_point, fixed_query
from kvpolicy.triggers.score_gap import ScoreGap


def test_a_query_in_fixed_point_is_within_half_a_step_and_its_digits_are_int8():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 5, 128, generator=gen) * torch.rand(3, 5, 1, generator=gen) * 40
    query[0, 0] = 0.0  # a head of zeros stays zeros
    query[0, 1, :] = 1e-40  # subnormal: the step is bounded, every element rounds to 0
    x, step = fixed_point(query)
    assert torch.equal(x, x.round()) and x.abs().max() <= 2 ** 14
    largest = query.abs().amax(-1)
    # the step is a power of two 2**-13 of the largest's leading power of two: at most 2**-13 of the largest
    assert torch.equal(torch.frexp(step).mantissa, torch.full_like(step, 0.5))
    normal = largest > 1e-30
    assert (step[normal] <= largest[normal] * 2 ** -13).all() and (step[normal] > largest[normal] * 2 ** -15).all()
    error = (fixed_query(query) - query).abs()
    assert (error <= step.unsqueeze(-1) / 2).all()
    assert not fixed_query(query)[0, 0].any() and not fixed_query(query)[0, 1].any()
    # the fused op's digits: x = 256 * hi + lo, hi = (x + 128) >> 8 in [-64, 64], lo in [-128, 127]
    whole = x.to(torch.int32)
    hi = (whole + 128) >> 8
    lo = whole - 256 * hi
    assert hi.abs().max() <= 64 and lo.min() >= -128 and lo.max() <= 127


def test_a_query_already_on_the_grid_is_kept_exactly():
    # a bfloat16 query's elements within 2**6 of its largest have at most 8 significant bits: exact on the grid
    query = torch.tensor([[100.0, -3.25, 0.75, 64.5, -0.5]])
    assert torch.equal(fixed_query(query), query)


def test_fixed_query_is_checked():
    with pytest.raises(ConfigError, match="fixed_query is read by estimate 'outlier' only"):
        ScoreGap(measure="mass", fixed_query=True).validate()
    with pytest.raises(ConfigError, match="fixed_query must be true or false"):
        ScoreGap(measure="mass", estimate="outlier", fixed_query=1).validate()
