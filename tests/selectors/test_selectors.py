"""Selector scores against their defining formulas."""

from __future__ import annotations

import copy

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


# --- every selector's scores against an explicit per-unit computation, on a decoded layer --------

import math  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy import analytic  # noqa: E402
from kvpolicy.kernels import dispatch  # noqa: E402

from test_layer import B, D, H, HQ, _decoded  # noqa: E402


def _units_keys(run, b: int, h: int, u: int) -> torch.Tensor | None:
    """The keys the test wrote for unit ``u``'s slots (``(size, D)``), None for an empty unit."""
    table = run.state.units
    size, start = int(table.size[b, h, u]), int(table.start[b, h, u])
    if size == 0 or not bool(table.selectable[b, h, u]):
        return None
    return torch.stack([run.keys[s][b, h] for s in table.order[b, h, start: start + size].tolist()]).float()


def _explicit(run, query: torch.Tensor, formula) -> torch.Tensor:
    """``(B, H, U)``: ``formula(q_group (G, D), unit keys (n, D))`` per unit, -inf where not selectable."""
    table = run.state.units
    group = query.float().view(B, H, HQ // H, D)
    out = torch.full(table.size.shape, float("-inf"))
    for b in range(B):
        for h in range(H):
            for u in range(table.capacity):
                keys = _units_keys(run, b, h, u)
                if keys is not None:
                    out[b, h, u] = formula(group[b, h], keys)
    return out


def _top_budget(q, keys):  # mean over the group's query heads of q . mean key (the table keeps it in float16)
    return torch.stack([qg @ keys.mean(0).half().float() for qg in q]).mean()


def _quest_bound(q, keys):  # max over the group of sum_d max(q_d min_d, q_d max_d)
    low, high = keys.amin(0), keys.amax(0)
    return torch.stack([torch.maximum(qg * low, qg * high).sum() for qg in q]).max()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name, formula", [("clusterkv", _top_budget), ("louiskv", _top_budget),
                                           ("arkvale", _top_budget), ("quest", _quest_bound)])
def test_unit_scores_are_the_selectors_formula_per_unit(name, formula, backend):
    run = _decoded(name, 30)
    table, selector = run.state.units, run.state.policy.selector
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(9))
    want = _explicit(run, query, formula)
    if backend == "triton" and torch.cuda.is_available():
        # a CUDA machine runs Triton on the GPU (its interpreter is off there): the same table, moved
        table, query = _moved(table, torch.device("cuda")), query.cuda()
    group = query.float().view(B, H, HQ // H, D)
    got = dispatch.get("unit_scores", backend, query.device)(
        group, table.key_mean, table.key_min, table.key_max, table.selectable,
        selector._unit_score_method(), None,
    ).cpu()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    # and the selection takes the units in that order, best first
    selection = selector.select(query, table, run.state.store.retrieval_capacity, backend)
    for b in range(B):
        for h in range(H):
            chosen = selection.unit_ids[b, h, : int(selection.num_units[b, h])].cpu()
            assert chosen.numel() > 1
            ranked = torch.sort(want[b, h], descending=True, stable=True).indices[: chosen.numel()]
            assert torch.equal(chosen, ranked), (b, h)


def _moved(table, device: torch.device):
    """A copy of unit ``table`` with every tensor on ``device``."""
    moved = copy.copy(table)
    for name, value in vars(table).items():
        if isinstance(value, torch.Tensor):
            setattr(moved, name, value.to(device))
    return moved


def test_oracle_scores_are_the_attention_mass_per_unit():
    run = _decoded("oracle", 20)
    table = run.state.units
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(9))
    logits = _explicit(run, query, lambda q, keys: torch.zeros(()))  # which units count
    group = query.float().view(B, H, HQ // H, D)
    want = torch.zeros(B, H, table.capacity)
    for b in range(B):
        for h in range(H):
            units = torch.isfinite(logits[b, h]).nonzero()[:, 0].tolist()
            keys = torch.stack([_units_keys(run, b, h, u)[0] for u in units])  # single tokens
            for g in range(HQ // H):
                want[b, h, units] += torch.softmax(keys @ group[b, h, g] / math.sqrt(D), dim=0)
    got = run.state.policy.selector.score(group, table).masked_fill(~table.selectable, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_collision_rerank_selects_by_explicit_votes_then_estimates():
    units = {"name": "analytic", "update_buffer": 8}
    run = _decoded("pariskv", 30, prefill_units=units, decode_units=units)
    index, store, selector = run.state.units, run.state.store, run.state.policy.selector
    capacity = store.retrieval_capacity
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(9))
    selection = selector.select(query, index, capacity, "reference")

    dims = D // index.subspaces
    tiers = selector.tiers_for(dims)
    weights = analytic.tier_weights(tiers)
    mean_q = query.float().view(B, H, HQ // H, D).mean(2)
    n_indexed, n_written = int(index.indexed), int(index.next_position)
    for b in range(B):
        voted = [p for p in range(n_indexed) if bool(index.token_valid[b, p])]
        keep = min(selector.keep_for(len(voted), capacity), selector.candidates_for(index.capacity, capacity))
        for h in range(H):
            q = analytic.encode_query(mean_q[b, h], index.signs, index.subspaces, (1 << tiers) - 1)
            ranks = q.centroids.tolist()  # (S, rho): the query's centroid ids per subspace, best first
            # the keys the test wrote, encoded afresh (not the index's stored codes)
            keys = torch.stack([run.keys[int(index.slots[p])][b, h] for p in voted])
            enc = analytic.encode_keys(keys, index.signs, index.subspaces)
            estimates = (enc.norms * enc.weight * (analytic.dequantize(enc.codes) @ q.rotated)).tolist()
            scored = []
            for p, centroids, estimate in zip(voted, enc.centroids.tolist(), estimates):
                votes = sum(weights[ranks[s].index(c)] if c in ranks[s] else 0 for s, c in enumerate(centroids))
                scored.append((votes, -p, estimate))
            candidates = sorted(scored, reverse=True)[:keep]  # most votes first, ties to the lower position
            buffered = list(range(n_indexed, n_written))[:capacity]
            best = sorted(candidates, key=lambda c: c[2], reverse=True)[: capacity - len(buffered)]
            want = {int(index.slots[p]) for p in buffered} | {int(index.slots[-c[1]]) for c in best}
            got = set(selection.slots[b, h][selection.slot_valid[b, h]].tolist())
            assert got == want, (b, h, sorted(got ^ want))


def test_collision_rerank_votes_with_the_tier_weights():
    # head_dim 64: 16 subspaces of 4 dims, so 4 tiers whose ranks get 4, 3, 3, 2, ... votes (at
    # head_dim 16 every rank gets one vote and the tiers cannot be told apart)
    from kvpolicy.layer import PolicyLayerState

    dim, heads, q_heads, prompt = 64, 2, 4, 300
    gen = torch.Generator().manual_seed(3)
    state = PolicyLayerState(kvpolicy.preset("pariskv", budget=96, sink=4, local=16), 0, torch.device("cpu"))
    state.prefill(torch.randn(1, heads, prompt, dim, generator=gen), torch.randn(1, heads, prompt, dim, generator=gen),
                  torch.ones(1, prompt, dtype=torch.bool), q_heads)
    seen = []
    ops = dispatch.Ops("reference", torch.device("cpu"))  # a table of its own, so the cached one stays as it is
    for name in ("query_votes", "collision_count"):  # whichever path the selector takes, record its votes
        op = getattr(ops, name)
        setattr(ops, name, lambda *args, op=op: seen.append(args[-1].tolist()) or op(*args))

    selector = state.policy.selector
    query = torch.randn(1, q_heads, dim, generator=gen)
    selector.select(query, state.units, state.store.retrieval_capacity, ops)
    tiers = selector.tiers_for(dim // state.units.subspaces)
    assert tiers == 4 and seen == [list(analytic.tier_weights(tiers))]
