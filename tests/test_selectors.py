"""Selector scores against their defining formulas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvpolicy.selectors.bound import Bound


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bound_is_quests_upper_bound_and_holds_for_every_key(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, group, units, per_unit, dim = 2, 3, 4, 20, 5, 16
    keys = torch.randn(batch, heads, units, per_unit, dim, generator=gen)
    low, high = keys.amin(3), keys.amax(3)
    filled = torch.rand(batch, heads, units, generator=gen) > 0.2
    low = torch.where(filled[..., None], low, float("inf"))  # empty units, as the unit table keeps them
    high = torch.where(filled[..., None], high, float("-inf"))
    query = torch.randn(batch, heads, group, dim, generator=gen)
    score = Bound().score(query, SimpleNamespace(key_min=low, key_max=high, selectable=filled))
    # Quest's definition: sum_d max(q_d lo_d, q_d hi_d), max over the group's query heads
    q = query.unsqueeze(3)
    defined = torch.maximum(q * low.unsqueeze(2), q * high.unsqueeze(2)).sum(-1).amax(2)
    torch.testing.assert_close(score[filled], defined[filled], rtol=1e-5, atol=1e-5)
    # an upper bound on q . k for every key of the unit and every head of the group
    dots = torch.einsum("bhgd,bhukd->bhguk", query, keys).amax(dim=(2, 4))
    assert (score[filled] >= dots[filled] - 1e-5).all()
    assert torch.isfinite(score).all()
