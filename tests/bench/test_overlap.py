"""``bench/overlap.py``: a score bias that makes random weights' selections overlap."""

import pytest
import torch

from kvpolicy.bench.overlap import StickyTopBudget, unit_hash
from kvpolicy.bench.sweeps import louiskv_interval
from kvpolicy.cli.common import floats
from kvpolicy.errors import KVPolicyError
from kvpolicy.selectors.top_budget import TopBudget
from kvpolicy.units.table import UnitTable

B, HQ, H, D, U = 2, 4, 2, 16, 64


def _table():
    """A table of ``U`` units of 4 tokens each per (sequence, head), every one selectable."""
    tokens = U * 4
    keys = torch.randn(B, H, tokens, D, generator=torch.Generator().manual_seed(0))
    labels = (torch.arange(tokens) // 4).expand(B, H, tokens)
    return UnitTable.from_prompt(keys, torch.arange(tokens), torch.ones(B, tokens, dtype=torch.bool), labels, U)


def _selected(selector, table, seed):
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(seed))
    return selector.select(query, table, capacity=64, ops="reference").unit_ids


def test_the_hash_is_fixed_per_unit_and_in_the_unit_interval():
    h = unit_hash(1000, torch.device("cpu"))
    assert torch.equal(h, unit_hash(1000, torch.device("cpu")))
    assert bool((h >= 0).all()) and bool((h < 1).all())
    assert len(torch.unique(h)) == 1000  # distinct: a hash that collapsed would make ties, not overlap


def test_no_stickiness_scores_as_top_budget():
    table = _table()
    for seed in range(3):
        assert torch.equal(_selected(StickyTopBudget(stickiness=0.0), table, seed), _selected(TopBudget(), table, seed))


def test_a_large_bias_selects_the_same_units_for_unrelated_queries_and_a_small_one_does_not():
    table = _table()

    def overlap(selector):
        a, b = _selected(selector, table, 1), _selected(selector, table, 2)
        return sum(len(set(a[i, h].tolist()) & set(b[i, h].tolist()) - {-1}) for i in range(B) for h in range(H))

    chosen = 16 * B * H  # 64 tokens in units of 4
    assert overlap(StickyTopBudget(stickiness=1e4)) == chosen
    assert overlap(StickyTopBudget(stickiness=0.0)) < chosen // 2


def test_the_interval_never_re_selects_less_often_than_the_rate():
    assert louiskv_interval(0.176) == 5 and louiskv_interval(0.2) == 5 and louiskv_interval(0.117) == 8
    assert louiskv_interval(1.0) == 1 and louiskv_interval(2.0) == 1


@pytest.mark.parametrize("text", ["", "a,1", "1;2"])
def test_bad_numbers_are_a_clear_error(text):
    with pytest.raises(KVPolicyError, match="--stickiness"):
        floats(text, "stickiness")
