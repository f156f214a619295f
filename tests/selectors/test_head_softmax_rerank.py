"""collision_rerank's rerank="head_softmax": each query head's 4-bit logit, softmaxed over the
candidates and summed over the group, against the group mean's rerank (ParisKV's) and by hand."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import ConfigError, analytic, preset
from kvpolicy.kernels import reference_analytic
from kvpolicy.selectors import CollisionRerank
from kvpolicy.units import Analytic

N, DIM, TARGET = 300, 64, 123


def _index(seed: int = 5):
    keys = torch.randn(1, 1, N, DIM, generator=torch.Generator().manual_seed(seed))
    index = Analytic(update_buffer=4).build_index(keys, torch.ones(1, N, dtype=torch.bool), "reference", layer_idx=0)
    return index, keys


def _one_head_wants_the_target(keys):
    # head 0 points at the target key (its logit about 2 |k|^2 / sqrt(D) = 16, about 1 of its mass),
    # heads 1-3 weakly away from it (logits of a few units over 300 keys: their mass spread thin);
    # the group's mean query, (2 - 1 - 1 - 1) / 4 = -0.25 times the key, ranks it among the last
    target = keys[0, 0, TARGET]
    return torch.stack([2 * target, -target, -target, -target])[None, None]  # (1, 1, 4, D)


def test_head_softmax_is_each_heads_softmax_of_its_logits_summed():
    # by hand: head g's logit is its 4-bit estimate of q·k / |q| times |q| / sqrt(D)
    index, _ = _index()
    group = torch.randn(1, 1, 3, DIM, generator=torch.Generator().manual_seed(1))
    candidates = torch.tensor([[[0, 7, 42, -1, 299, 150]]])
    listed = candidates >= 0
    args = (index.codes, index.weight, index.norms, candidates)
    probs = []
    for g in range(3):
        unit = analytic.rotate(group[:, :, g], index.signs)
        logit = reference_analytic.rerank_scores(unit, *args) * group[:, :, g].norm() / DIM**0.5
        probs.append(torch.softmax(logit, -1))
    want = torch.stack(probs).sum(0)
    got = reference_analytic.head_softmax_scores(analytic.head_logit_queries(group, index.signs), *args)
    torch.testing.assert_close(got[listed].exp(), want[listed])
    assert got[~listed].tolist() == [float("-inf")]
    assert float(want[listed].sum()) == pytest.approx(3.0)  # three heads, one unit of mass each


def test_head_softmax_keeps_the_token_one_head_attends_and_the_mean_ranks_low():
    index, keys = _index()
    group = _one_head_wants_the_target(keys)
    candidates = torch.arange(N).view(1, 1, N)
    args = (index.codes, index.weight, index.norms, candidates)
    mean = analytic.rotate(group.mean(2), index.signs)
    mean_rank = int((reference_analytic.rerank_scores(mean, *args) > reference_analytic.rerank_scores(
        mean, *args)[0, 0, TARGET]).sum())
    assert mean_rank > N - 20  # near the bottom for the mean query
    best = reference_analytic.rerank(analytic.head_logit_queries(group, index.signs), *args, 10)
    assert best[0, 0, 0] == TARGET  # first for the head that wants it
    assert TARGET not in reference_analytic.rerank(mean, *args, 10)[0, 0].tolist()


def test_the_selector_keeps_it_too():
    # every token a candidate (fraction 1.0), a budget of 20: head_softmax selects the target, the mean does not
    index, keys = _index()
    query = _one_head_wants_the_target(keys).view(1, 4, DIM)
    rule = dict(candidate_fraction=1.0, min_candidates=1.0)
    mean = CollisionRerank(**rule).select(query, index, 20, "reference")
    each = CollisionRerank(rerank="head_softmax", **rule).select(query, index, 20, "reference")
    assert TARGET in each.unit_ids[0, 0].tolist()
    assert TARGET not in mean.unit_ids[0, 0].tolist()
    assert torch.equal(each.num_units, mean.num_units)


def test_with_one_query_head_it_selects_as_the_group_mean():
    # a softmax keeps its logits' order, and one head's mean is itself
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, N, 16, generator=gen)
    index = Analytic(update_buffer=4).build_index(keys, torch.ones(1, N, dtype=torch.bool), "reference", layer_idx=0)
    query = torch.randn(1, 2, 16, generator=gen)
    rule = dict(candidate_fraction=0.3, min_candidates=1.0)
    mean = CollisionRerank(**rule).select(query, index, 40, "reference")
    each = CollisionRerank(rerank="head_softmax", **rule).select(query, index, 40, "reference")
    assert torch.equal(each.unit_ids, mean.unit_ids) and torch.equal(each.slot_valid, mean.slot_valid)


def test_the_composed_ops_rerank_as_the_fused_one(monkeypatch):
    # without query_votes bound the selector composes collision_count, candidate_topk and rerank
    from kvpolicy.kernels import dispatch

    index, keys = _index()
    query = _one_head_wants_the_target(keys).view(1, 4, DIM)
    selector = CollisionRerank(rerank="head_softmax", candidate_fraction=0.5, min_candidates=1.0)
    fused = selector.select(query, index, 30, "reference")
    ops = dispatch.Ops("reference", torch.device("cpu"))
    monkeypatch.setattr(ops, "query_votes", None)
    composed = selector.select(query, index, 30, ops)
    assert torch.equal(composed.unit_ids.sort(-1).values, fused.unit_ids.sort(-1).values)


def test_a_bad_rerank_names_the_accepted_ones():
    with pytest.raises(ConfigError, match="rerank must be one of group_mean, head_softmax, got 'head_max'"):
        CollisionRerank(rerank="head_max").validate()
    with pytest.raises(ConfigError, match="rerank must be one of group_mean, head_softmax, got 'mean'"):
        preset("pariskv", selector={"name": "collision_rerank", "rerank": "mean"})


def test_the_triton_backend_refuses_it_when_the_policy_is_built():
    with pytest.raises(ConfigError, match="rerank='head_softmax' has no Triton version .*accepted with "
                                          "backend='triton': rerank='group_mean'"):
        preset("pariskv", backend="triton", selector={"name": "collision_rerank", "rerank": "head_softmax"})
    assert preset("pariskv", backend="reference",
                  selector={"name": "collision_rerank", "rerank": "head_softmax"}).selector.rerank == "head_softmax"


def test_the_preset_keeps_the_group_mean_rerank():
    assert preset("pariskv").selector.rerank == "group_mean"
    assert preset("pariskv", model="gemma-3-270m").selector.rerank == "group_mean"
