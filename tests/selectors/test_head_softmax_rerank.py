"""collision_rerank's rerank="head_softmax": each query head's 4-bit logit, softmaxed over the
candidates and summed over the group, against the group mean's rerank (ParisKV's), by hand and on the Triton ops."""

from __future__ import annotations

import os

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


def test_the_triton_backend_takes_it():
    for backend in ("triton", "reference"):
        policy = preset("pariskv", backend=backend, selector={"name": "collision_rerank", "rerank": "head_softmax"})
        assert policy.selector.rerank == "head_softmax"


# the Triton ops on this test's CPU index: the interpreter only (on a GPU machine
# test_analytic_ops's decode-size test covers the ops on the device)
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("group, fused", [(4, True), (3, True), (1, True), (4, False)])
def test_it_selects_on_triton_what_it_selects_on_the_reference(monkeypatch, group, fused):
    # GQA ``group``, 2 KV heads, a flush and a partly filled buffer; the fused rerank_select or
    # (without query_votes bound) the composed ops' rerank
    from kvpolicy.kernels import dispatch
    from kvpolicy.kernels.triton import collision_candidates, head_softmax

    monkeypatch.setattr(collision_candidates, "_CHUNK", 256)
    monkeypatch.setattr(collision_candidates, "_SUB", 64)
    monkeypatch.setattr(head_softmax, "_LOGITS_SUB", 32)
    gen = torch.Generator().manual_seed(group)
    keys = torch.randn(1, 2, 700, 32, generator=gen)
    index = Analytic(update_buffer=5).build_index(keys, torch.rand(1, 700, generator=gen) > 0.1, "reference",
                                                  layer_idx=0)
    for slot in range(8):
        index.append_leaving_token(torch.tensor(700 + slot), torch.randn(1, 2, 32, generator=gen),
                                   torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool))
    query = torch.randn(1, 2 * group, 32, generator=gen)
    selector = CollisionRerank(rerank="head_softmax", candidate_fraction=0.3, min_candidates=1.0)
    ops = dispatch.bind("triton", torch.device("cpu"))
    if not fused:
        ops = dispatch.Ops("triton", torch.device("cpu"))  # a table of its own, changed below
        monkeypatch.setattr(ops, "query_votes", None)
    want = selector.select(query, index, 60, "reference")
    got = selector.select(query, index, 60, ops)
    assert int(want.slot_valid.sum()) == 2 * 60
    assert torch.equal(got.slot_valid, want.slot_valid) and torch.equal(got.num_units, want.num_units)
    assert torch.equal(got.slots.sort(-1).values, want.slots.sort(-1).values)
    assert torch.equal(got.unit_ids[..., :3], want.unit_ids[..., :3])  # 3 buffered tokens first
    if group > 1:  # the group's mean query selects other tokens here: the heads' softmaxes decided
        mean = CollisionRerank(candidate_fraction=0.3, min_candidates=1.0).select(query, index, 60, "reference")
        assert not torch.equal(mean.slots.sort(-1).values, want.slots.sort(-1).values)


def test_the_preset_reranks_by_the_group_mean_until_head_softmax_is_fast():
    # presets.PARISKV_RERANK, whatever the model's votes (head_softmax cost 3 ms a step on an H100 in session 29);
    # an explicit selector takes the option's default, and the preset takes head_softmax when asked
    assert preset("pariskv").selector.rerank == "group_mean"
    gemma = preset("pariskv", model="gemma-3-270m").selector
    assert (gemma.rerank, gemma.votes) == ("group_mean", "head_max")
    assert CollisionRerank().rerank == "group_mean"  # ParisKV's
    chosen = preset("pariskv", backend="triton", selector={"name": "collision_rerank", "rerank": "head_softmax"})
    assert chosen.selector.rerank == "head_softmax"
