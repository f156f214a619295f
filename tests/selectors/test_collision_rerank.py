"""collision_rerank's length rule (ParisKV's candidate share by zone length), a zone that fits the
budget selected whole, and the fused kernel path choosing what the composed ops choose."""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvpolicy import analytic
from kvpolicy.errors import ConfigError
from kvpolicy.kernels import dispatch, reference_analytic
from kvpolicy.selectors import CollisionRerank
from kvpolicy.units import Analytic


def _index(n, dim=16, heads=2, batch=1, buffer=4, seed=0, drop=0.0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, dim, generator=gen)
    valid = torch.rand(batch, n, generator=gen) >= drop
    return Analytic(update_buffer=buffer).build_index(keys, valid, "reference", layer_idx=0), gen


@pytest.mark.parametrize(
    "zone, share",
    [(100, 0.5), (4_999, 0.5), (5_000, 0.25), (9_999, 0.25), (10_000, 0.2), (29_999, 0.2), (30_000, 0.1), (10**6, 0.1)],
)
def test_the_candidate_share_follows_paris_kv_by_zone_length(zone, share):
    selector = CollisionRerank(hold_count=False)
    assert selector.fraction_for(zone) == share
    assert selector.keep_for(zone, retrieval=10) == max(20, math.ceil(zone * share))
    # a larger candidate_fraction wins in every band; a smaller one only from 30K on
    assert CollisionRerank(candidate_fraction=1.0).keep_for(zone, 10) == zone
    assert CollisionRerank(candidate_fraction=0.05).fraction_for(zone) == (0.05 if zone >= 30_000 else share)


def test_the_device_count_is_the_host_rule():
    zones = torch.tensor([0, 1, 7, 4_999, 5_000, 9_999, 10_000, 29_999, 30_000, 123_457])
    selector = CollisionRerank()
    got = reference_analytic.candidate_count(zones, 3, selector.candidate_fraction, analytic.CANDIDATE_BANDS)
    assert got.tolist() == [max(3, math.ceil(z * selector.fraction_for(z))) for z in zones.tolist()]


@pytest.mark.parametrize(
    "zone, paris_kv, held",
    [(4_999, 2_500, 2_500), (5_000, 1_250, 2_500), (8_109, 2_028, 2_500), (10_000, 2_000, 2_500),
     (12_501, 2_501, 2_501), (30_000, 3_000, 6_000), (60_001, 6_001, 6_001)],
)
def test_the_held_count_never_falls_where_paris_kv_drops_at_a_bound(zone, paris_kv, held):
    assert CollisionRerank(hold_count=False).keep_for(zone, retrieval=10) == paris_kv
    assert CollisionRerank().keep_for(zone, retrieval=10) == held


def test_the_held_count_rises_with_the_zone_and_the_width_holds_it():
    selector = CollisionRerank()
    zones = torch.arange(70_000)
    counts = reference_analytic.candidate_count(zones, *selector.rule_for(50))
    assert bool((counts[1:] >= counts[:-1]).all())
    assert selector.candidates_for(70_000, 50) >= int(counts.max())


@pytest.mark.parametrize("capacity", [300, 4_999, 5_000, 12_000, 40_000])
def test_the_width_holds_the_rule_for_every_zone_up_to_capacity(capacity):
    selector = CollisionRerank()
    zones = torch.arange(capacity + 1)
    counts = reference_analytic.candidate_count(zones, selector.floor_for(50), 0.1, analytic.CANDIDATE_BANDS)
    width = selector.candidates_for(capacity, 50)
    assert width >= min(capacity, int(counts.max()))
    assert width <= min(capacity, int(counts.max()) + 1)  # no wider than it needs


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("zone", [900, 1_300])
@pytest.mark.parametrize("op", ["rerank_select", "rerank"])
def test_the_zone_length_sets_how_many_candidates_are_reranked(zone, op, hold, monkeypatch):
    index, gen = _index(zone)
    ops = dispatch.Ops("reference", torch.device("cpu")) if op == "rerank_select" else composed_ops()
    seen = []
    reranked = getattr(ops, op)

    def spy(rotated, codes, weight, norms, candidates, *rest):
        seen.append((candidates >= 0).sum(-1))
        return reranked(rotated, codes, weight, norms, candidates, *rest)

    monkeypatch.setattr(ops, op, spy)
    selector = CollisionRerank(min_candidates=1.0, hold_count=hold)
    monkeypatch.setattr(analytic, "CANDIDATE_BANDS", ((1_000, 0.5), (2_000, 0.25)))  # the same rule, scaled down
    selector.select(torch.randn(1, 2, 16, generator=gen), index, 20, ops)
    share = 0.5 if zone < 1_000 else 0.25
    held = math.ceil(999 * 0.5) if hold and zone >= 1_000 else 0  # 1,300 tokens keep what 999 keep
    assert seen[0].tolist() == [[max(held, math.ceil(zone * share))] * 2]


@pytest.mark.parametrize("extra", [0, 1])
def test_a_zone_that_fits_the_budget_is_selected_whole(extra):
    capacity = 40
    index, gen = _index(capacity - 3 + extra, buffer=4)  # 3 buffered tokens below
    for slot in range(3):
        index.append_leaving_token(torch.tensor(1_000 + slot), torch.randn(1, 2, 16, generator=gen),
                                   torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool))
    # the fewest candidates the options allow: still every token while the zone fits
    selection = CollisionRerank(candidate_fraction=0.01, min_candidates=1.0).select(
        torch.randn(1, 4, 16, generator=gen), index, capacity, "reference"
    )
    zone = set(range(capacity - 3 + extra)) | {1_000, 1_001, 1_002}
    for h in range(2):
        picked = set(selection.slots[0, h][selection.slot_valid[0, h]].tolist())
        assert len(picked) == capacity
        assert picked == zone if not extra else picked < zone


def composed_ops() -> dispatch.Ops:
    """The reference ops without the fused ones: the selector composes collision_count,
    candidate_topk, rerank and the selection in PyTorch."""
    ops = dispatch.Ops("reference", torch.device("cpu"))
    for name in ("query_votes", "collision_candidates", "rerank_select"):
        delattr(ops, name)
    return ops


# the Triton ops on this test's CPU index: the interpreter only (on a GPU machine
# test_pariskv's backend test and test_triton_analytic's cover them on the device)
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@needs_interpreter
def test_the_fused_ops_select_what_the_composed_ops_select(monkeypatch):
    from kvpolicy.kernels.triton import collision_candidates, query_votes, rerank_select

    monkeypatch.setattr(collision_candidates, "_CHUNK", 256)
    monkeypatch.setattr(collision_candidates, "_SUB", 64)
    monkeypatch.setattr(rerank_select, "_CHUNK", 128)
    monkeypatch.setattr(rerank_select, "_SCORE_SUB", 32)
    monkeypatch.setattr(rerank_select, "_SPLIT_SUB", 64)
    monkeypatch.setattr(rerank_select, "_BLOCK", 32)
    index, gen = _index(700, dim=32, heads=2, batch=2, buffer=5, drop=0.1)
    for slot in range(8):  # a flush and a partly filled buffer
        index.append_leaving_token(torch.tensor(700 + slot), torch.randn(2, 2, 32, generator=gen),
                                   torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool))
    query = torch.randn(2, 6, 32, generator=gen)
    selector = CollisionRerank(min_candidates=1.0, candidate_fraction=0.3)
    want = selector.select(query, index, 60, composed_ops())
    fused_reference = selector.select(query, index, 60, "reference")
    fused = dispatch.Ops("reference", torch.device("cpu"))  # a table of its own, changed below
    for module in (query_votes, collision_candidates, rerank_select):
        name = module.__name__.rsplit(".", 1)[-1]
        monkeypatch.setattr(fused, name, getattr(module, name))
    got = selector.select(query, index, 60, fused)
    assert int(want.slot_valid.sum()) == 2 * 2 * 60
    for selection in (fused_reference, got):
        assert torch.equal(selection.slot_valid, want.slot_valid)
        assert torch.equal(selection.num_units, want.num_units)
        # the same tokens, the buffer's first; the fused path lists the retrieved ones by
        # position, the composed one best first
        assert torch.equal(selection.slots.sort(-1).values, want.slots.sort(-1).values)
        assert torch.equal(selection.unit_ids[..., :3], want.unit_ids[..., :3])  # 3 buffered tokens
        retrieved = selection.unit_ids[..., 3:]
        assert torch.equal(retrieved, retrieved.sort(-1).values)


@needs_interpreter
@pytest.mark.parametrize("method, votes, rerank", [("auto", "group_mean", "group_mean"), ("radix", "group_mean", "group_mean"),
                                                  ("auto", "head_max", "group_mean"), ("auto", "group_mean", "head_softmax")])
def test_the_fused_selection_launches_only_its_kernels(monkeypatch, method, votes, rerank):
    # query_votes 1, collision_candidates 2, rerank_select 5 (the radix method, which auto takes),
    # with either votes; nothing else computes on the device, not even a memset
    # (allocations and views launch nothing), so a captured step replays exactly these
    from torch.utils._python_dispatch import TorchDispatchMode

    import triton.runtime.interpreter as interpreter

    from kvpolicy.kernels.triton import rerank_select

    monkeypatch.setattr(rerank_select, "METHOD", method)
    free = {"aten.empty.memory_format", "aten.view.default", "aten.view.dtype", "aten.expand.default",
            "aten.slice.Tensor", "aten.select.int", "aten.unsqueeze.default", "aten._unsafe_view.default",
            "aten.as_strided.default", "aten.alias.default", "aten.detach.default", "aten.empty_strided.default",
            "aten.reshape.default"}
    launches, inside = [], [False]

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and str(func) not in free:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        inside[0] = True  # the interpreter's own tensor work is the kernel's
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    index, gen = _index(600, dim=32, heads=2, batch=1, buffer=5)
    for slot in range(3):
        index.append_leaving_token(torch.tensor(600 + slot), torch.randn(1, 2, 32, generator=gen),
                                   torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool))
    ops = dispatch.bind("triton", torch.device("cpu"))
    query = torch.randn(1, 4, 32, generator=gen)
    selector = CollisionRerank(votes=votes, rerank=rerank)
    selector.select(query, index, 40, ops)  # cached tables and scratch made
    launches.clear()
    with Record() as record:
        selection = selector.select(query, index, 40, ops)
    # the query (1), the votes and candidates (2: collision_candidates' default "pass" pipeline at
    # a call too small for 2048-position chunks, its threshold folded into the compaction, its row
    # histogram self-clearing scratch), then rerank_select: the score pass with the top digit,
    # three digit passes, then the place pass (the radix method), whose last program of a row zeroes
    # the row histograms for the next call (self-clearing scratch: no memset)
    selected = ["_radix_score_kernel", "_radix_level_kernel", "_radix_level_kernel", "_radix_level_kernel",
                "_radix_place_kernel"]
    if rerank == "head_softmax":
        # head_softmax.py's two passes in place of the score pass (the logits' last program of a row
        # makes its normalisers); the heads' logit queries come from query_votes' launch
        selected[:1] = ["_logits_kernel", "_mass_kernel"]
    assert launches == ["_query_votes_sort_kernel", "_votes_kernel", "_compact_fused_kernel", *selected]
    assert record.ops == []
    assert int(selection.num_units.sum()) == 2 * 40


@needs_interpreter
def test_head_max_selects_on_triton_what_it_selects_on_the_reference(monkeypatch):
    # GQA 4, several chunks of the votes pass, a flush and a partly filled buffer
    from kvpolicy.kernels.triton import collision_candidates

    monkeypatch.setattr(collision_candidates, "_CHUNK", 256)
    monkeypatch.setattr(collision_candidates, "_SUB", 64)
    index, gen = _index(700, dim=32, heads=2, batch=1, buffer=5, drop=0.1, seed=2)
    for slot in range(8):
        index.append_leaving_token(torch.tensor(700 + slot), torch.randn(1, 2, 32, generator=gen),
                                   torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool))
    query = torch.randn(1, 8, 32, generator=gen)
    rule = dict(min_candidates=1.0, candidate_fraction=0.1)
    selector = CollisionRerank(votes="head_max", **rule)
    want = selector.select(query, index, 60, "reference")
    got = selector.select(query, index, 60, dispatch.bind("triton", torch.device("cpu")))
    assert int(want.slot_valid.sum()) == 2 * 60
    assert torch.equal(got.slot_valid, want.slot_valid) and torch.equal(got.num_units, want.num_units)
    assert torch.equal(got.slots.sort(-1).values, want.slots.sort(-1).values)
    assert torch.equal(got.unit_ids[..., :3], want.unit_ids[..., :3])  # 3 buffered tokens first
    # the group's mean query selects other tokens here: the votes compared are the heads' own
    mean = CollisionRerank(**rule).select(query, index, 60, "reference")
    assert not torch.equal(mean.slots.sort(-1).values, want.slots.sort(-1).values)


def test_head_max_votes_are_each_keys_best_heads():
    # one subspace table per query head: a key's votes are the largest of its heads' sums
    gen = torch.Generator().manual_seed(3)
    batch, heads, group, n, subspaces = 1, 2, 3, 50, 4
    table = torch.randint(0, 20, (batch, heads, group, subspaces, 256), generator=gen, dtype=torch.int32)
    ids = torch.randint(0, 256, (batch, heads, n, subspaces), generator=gen, dtype=torch.uint8)
    valid = torch.ones(batch, n, dtype=torch.bool)
    got = reference_analytic.collision_candidates(table, ids, valid, torch.tensor(n), n, 80, n, 1.0)
    assert torch.equal(got, torch.arange(n).expand(batch, heads, n))  # every key kept, by position
    per_head = torch.stack([reference_analytic.table_votes(table[:, :, g], ids) for g in range(group)])
    best = per_head.max(0).values
    # keep 10 of 50: exactly the 10 best of the heads' maxima (ties to the lower position)
    got = reference_analytic.collision_candidates(table, ids, valid, torch.tensor(n), 10, 80, 10, 0.01)
    want = reference_analytic.candidate_topk(best, 10).sort(-1).values
    assert torch.equal(got, want)
    mean_votes = reference_analytic.collision_candidates(table[:, :, 0], ids, valid, torch.tensor(n), 10, 80, 10, 0.01)
    assert torch.equal(mean_votes, reference_analytic.candidate_topk(per_head[0], 10).sort(-1).values)


def test_head_max_with_one_query_head_selects_as_the_group_mean():
    index, gen = _index(300, dim=16, heads=2, batch=1, buffer=4)
    query = torch.randn(1, 2, 16, generator=gen)  # one query head a KV head: its mean is itself
    rule = dict(candidate_fraction=0.2, min_candidates=1.0)
    mean = CollisionRerank(**rule).select(query, index, 40, "reference")
    each = CollisionRerank(votes="head_max", **rule).select(query, index, 40, "reference")
    assert torch.equal(each.slots, mean.slots) and torch.equal(each.slot_valid, mean.slot_valid)


def test_head_max_keeps_a_token_that_one_head_of_the_group_wants():
    # one of four query heads points at a key, the others away from it: the group's mean query
    # votes it out of the candidates, head_max keeps it (the rerank then scores the mean query)
    index, _ = _index(400, dim=64, heads=1, batch=1, buffer=4, seed=5)
    keys = torch.randn(1, 1, 400, 64, generator=torch.Generator().manual_seed(5))
    target = keys[0, 0, 123]
    group = torch.stack([8 * target, -3 * target, -3 * target, -3 * target])[None, None]  # (1, 1, 4, 64)
    tiers = CollisionRerank().tiers_for(64 // index.subspaces)
    weights = analytic.tier_weights(tiers)
    found = {}
    for per_head in (False, True):
        _, table = reference_analytic.query_votes(group, index.signs, index.subspaces, weights, per_head=per_head)
        candidates = reference_analytic.collision_candidates(
            table, index.centroids, index.token_valid, index.indexed, 20, index.subspaces * tiers, 20, 0.05)
        found[per_head] = 123 in candidates[0, 0].tolist()
    assert found == {False: False, True: True}


def test_head_max_refuses_ops_without_per_head_tables(monkeypatch):
    index, gen = _index(100, dim=16, heads=2, batch=1, buffer=4)
    ops = dispatch.Ops("reference", torch.device("cpu"))  # a table of its own, changed below

    def group_mean_only(query_group, signs, subspaces, tier_weights):
        return reference_analytic.query_votes(query_group, signs, subspaces, tier_weights)

    monkeypatch.setattr(ops, "query_votes", group_mean_only)
    with pytest.raises(ConfigError, match="votes='head_max' needs query_votes with per-head tables, which the "
                                          "reference and triton backends have; this policy's \\('reference'\\) binds"):
        CollisionRerank(votes="head_max").select(torch.randn(1, 4, 16, generator=gen), index, 20, ops)
    with pytest.raises(ConfigError, match="votes must be one of group_mean, head_max, got 'max'"):
        CollisionRerank(votes="max").validate()
    with pytest.raises(ConfigError, match="hold_count must be True or False, got 1"):
        CollisionRerank(hold_count=1).validate()


def test_pariskv_votes_per_head_for_gemma_only():
    # the preset's per-model default (presets.BUILTIN_PARISKV_VOTES); an explicit selector wins
    from kvpolicy import preset

    assert preset("pariskv", model="gemma-3-270m").selector.votes == "head_max"
    assert preset("pariskv", model="gemma3").selector.votes == "head_max"  # the CLI's name for it
    assert preset("pariskv", model="smollm2").selector.votes == "group_mean"
    assert preset("pariskv").selector.votes == "group_mean"
    assert preset("pariskv", model="gemma-3-270m", selector="collision_rerank").selector.votes == "group_mean"
