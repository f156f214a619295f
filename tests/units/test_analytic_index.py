"""ParisKV: the analytic index (encoding, update buffer, flush timing), collision_rerank's
selections (never over budget, group-consistent, buffered tokens always in), its config errors,
and the stale-centroid baseline (nearest_centroid). Dense equivalence and graph replay of the
preset are in test_dense_equivalence.py and test_graph_ready.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_cross import GPU_CROSS

import kvpolicy
from kvpolicy import ConfigError, Policy, analytic
from kvpolicy.layer import PolicyLayerState
from kvpolicy.selectors import CollisionRerank, TopBudget
from kvpolicy.units import Analytic, AnalyticIndex, KMeans, NearestCentroid
from kvpolicy.units.analytic import subspaces_for


def _index(batch, heads, n, dim, buffer, seed, padding=0, drop=0.0):
    """An index over ``n`` random prompt keys (left padding, random dropped tokens as sinks would be)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, dim, generator=gen)
    valid = torch.rand(batch, n, generator=gen) >= drop
    valid[-1, :padding] = False
    builder = Analytic(update_buffer=buffer)
    return builder.build_index(keys, valid, "reference", layer_idx=0), valid, gen


def _append(index, gen, count, first_slot, padding_rows=()):
    batch, heads, _ = index.weight.shape
    added = []
    for i in range(count):
        key = torch.randn(batch, heads, index.head_dim, generator=gen)
        valid = torch.ones(batch, dtype=torch.bool)
        for row in padding_rows:
            valid[row] = False
        index.append_leaving_token(torch.tensor(first_slot + i), key, valid, torch.zeros(batch, dtype=torch.bool))
        added.append((first_slot + i, key, valid))
    return added


# -- the index -------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,subspaces,dims", [(128, 16, 8), (64, 16, 4), (256, 32, 8), (16, 16, 1)])
def test_default_subspaces_follow_paris_kv(head_dim, subspaces, dims):
    assert subspaces_for(head_dim, None) == subspaces
    assert head_dim // subspaces == dims
    assert subspaces_for(head_dim, 8) == 8


def test_appended_tokens_are_encoded_like_the_prompt_and_rotations_are_fixed_per_layer():
    index, _, gen = _index(2, 3, 20, 64, buffer=4, seed=1)
    added = _append(index, gen, 5, first_slot=30)
    signs = analytic.srht_signs(64, 0)
    assert torch.equal(index.signs, signs)
    for position, (slot, key, _) in enumerate(added, start=20):
        encoded = analytic.encode_keys(key, signs, 16)
        assert int(index.slots[position]) == slot
        assert torch.equal(index.centroids[:, :, position], encoded.centroids)
        assert torch.equal(index.codes[:, :, position], encoded.codes)
        assert torch.equal(index.weight[:, :, position], encoded.weight)
        assert torch.equal(index.norms[:, :, position], encoded.norms)
    # layer 1 rotates with other signs (seed + layer), the same ones every time it is built
    keys = torch.randn(1, 1, 8, 64)
    one = Analytic().build_index(keys, torch.ones(1, 8, dtype=torch.bool), "reference", layer_idx=1)
    again = Analytic().build_index(keys, torch.ones(1, 8, dtype=torch.bool), "reference", layer_idx=1)
    assert torch.equal(one.signs, again.signs) and not torch.equal(one.signs, signs)


@pytest.mark.parametrize("buffer", [1, 3, 8])
def test_update_buffer_flushes_when_a_token_arrives_to_a_full_buffer(buffer):
    n = 12
    index, _, gen = _index(1, 2, n, 32, buffer=buffer, seed=buffer)
    assert int(index.indexed) == int(index.next_position) == n  # the prompt is indexed at once
    for arrived in range(1, 4 * buffer + 2):
        _append(index, gen, 1, first_slot=100 + arrived)
        # the arriving token flushes a full buffer, then waits in the next one
        assert int(index.buffered()) == (arrived - 1) % buffer + 1
        assert int(index.indexed) == n + buffer * ((arrived - 1) // buffer)
        assert int(index.next_position) == n + arrived
        voted = index.retrieval_mask()[0]
        assert voted[: int(index.indexed)].all() and not voted[int(index.indexed):].any()


def test_capacity_grows_on_the_host_and_reserve_prevents_growth():
    index, _, gen = _index(1, 1, 4, 16, buffer=2, seed=0)
    capacity = index.capacity
    _append(index, gen, capacity - 4 + 1, first_slot=4)  # one past the room
    assert index.capacity > capacity and index.length == capacity + 1
    index.reserve(300)
    tensors = [index.weight, index.codes, index.slots]
    _append(index, gen, 300, first_slot=10_000)
    assert all(a is b for a, b in zip(tensors, [index.weight, index.codes, index.slots]))


def test_weight_and_norms_share_one_buffer_through_growth():
    # interleaved, so the rerank's scattered reads of a candidate's weight and norm hit one sector
    index, _, gen = _index(1, 2, 4, 16, buffer=2, seed=1)

    def shared():
        return (index.weight.stride(-1) == 2 and index.norms.data_ptr() == index.weight.data_ptr() + 4
                and index.weight.untyped_storage().data_ptr() == index.norms.untyped_storage().data_ptr())

    assert shared()
    before = (index.weight.clone(), index.norms.clone())
    capacity = index.capacity
    _append(index, gen, capacity - 4 + 1, first_slot=4)  # grows
    assert index.capacity > capacity and shared()
    assert torch.equal(index.weight[..., :4], before[0][..., :4]) and torch.equal(index.norms[..., :4], before[1][..., :4])
    assert (index.norms[..., :capacity + 1] > 0).all() and (index.weight[..., capacity + 1:] == 0).all()


# -- selections ------------------------------------------------------------------------------


@st.composite
def cases(draw):
    return dict(
        batch=draw(st.integers(1, 2)), heads=draw(st.integers(1, 3)), group=draw(st.integers(1, 3)),
        dim=draw(st.sampled_from([16, 32, 64])), n=draw(st.integers(0, 120)), decode=draw(st.integers(0, 40)),
        buffer=draw(st.integers(1, 12)), capacity=draw(st.integers(13, 90)), seed=draw(st.integers(0, 2**16)),
        padding=draw(st.integers(0, 5)), fraction=draw(st.sampled_from([0.05, 0.1, 1.0])),
        floor=draw(st.sampled_from([1.0, 2.0])),
    )


@settings(max_examples=60, deadline=None)
@given(cases())
def test_selection_never_over_budget_group_consistent_buffer_first(case):
    batch, heads, group, dim = case["batch"], case["heads"], case["group"], case["dim"]
    index, valid, gen = _index(batch, heads, case["n"], dim, case["buffer"], case["seed"], case["padding"], drop=0.1)
    # the last sequence's first decode tokens are padding too (left padding leaves the window first)
    added = []
    for i in range(case["decode"]):
        rows = (batch - 1,) if i < case["padding"] and batch > 1 else ()
        added += _append(index, gen, 1, first_slot=case["n"] + i, padding_rows=rows)
    existing = [{s for s in range(case["n"]) if valid[b, s]} | {s for s, _, v in added if v[b]} for b in range(batch)]
    selector = CollisionRerank(candidate_fraction=case["fraction"], min_candidates=case["floor"])
    capacity = case["capacity"]
    query = torch.randn(batch, heads * group, dim, generator=gen)
    selection = selector.select(query, index, capacity, "reference")

    assert selection.slots.shape == (batch, heads, capacity)
    filled = selection.slot_valid.sum(-1)
    assert (filled <= capacity).all() and torch.equal(filled, selection.num_units)
    buffered = int(index.buffered())
    indexed = int(index.indexed)
    for b in range(batch):
        voted = int(index.retrieval_mask()[b].sum())
        in_buffer = [int(index.slots[p]) for p in range(indexed, indexed + buffered) if index.token_valid[b, p]]
        for h in range(heads):
            picked = selection.slots[b, h][selection.slot_valid[b, h]].tolist()
            assert len(picked) == len(set(picked))
            assert set(picked) <= existing[b]  # never padding, never a token not indexed
            assert set(in_buffer) <= set(picked)  # the update buffer is always attended
            # filled up to the budget while tokens remain (buffer first, then retrieved)
            assert len(picked) == len(in_buffer) + min(capacity - buffered, voted)

    # one selection per KV head: the query heads' order inside a group does not matter
    perm = torch.arange(heads * group).view(heads, group).flip(-1).reshape(-1)
    again = selector.select(query[:, perm], index, capacity, "reference")
    assert torch.equal(again.slot_valid, selection.slot_valid)
    assert torch.equal(again.slots[selection.slot_valid], selection.slots[selection.slot_valid])


def test_a_key_along_the_query_is_always_selected():
    index, valid, gen = _index(1, 2, 400, 64, buffer=8, seed=3)
    query = torch.randn(1, 4, 64, generator=gen)
    target = query.view(1, 2, 2, 64).mean(2) * 5.0  # the group's mean query, scaled
    keys = torch.randn(1, 2, 400, 64, generator=gen)
    keys[:, :, 237] = target
    index = Analytic(update_buffer=8).build_index(keys, torch.ones(1, 400, dtype=torch.bool), "reference", 0)
    selection = CollisionRerank(candidate_fraction=0.05, min_candidates=1.0).select(query, index, 20, "reference")
    for h in range(2):
        assert 237 in selection.slots[0, h][selection.slot_valid[0, h]].tolist()


def test_candidates_do_not_depend_on_reserved_room():
    """Eager steps grow the index, a captured one runs at reserved capacity: same choice."""
    small, _, gen = _index(1, 2, 3000, 32, buffer=4, seed=9)
    big, _, _ = _index(1, 2, 3000, 32, buffer=4, seed=9)
    big.reserve(20_000)
    query = torch.randn(1, 2, 32, generator=gen)
    selector = CollisionRerank()  # 10% of 3000 > 2 x budget: the fraction decides
    assert selector.candidates_for(big.capacity, 100) > selector.candidates_for(small.capacity, 100)
    a = selector.select(query, small, 100, "reference")
    b = selector.select(query, big, 100, "reference")
    assert torch.equal(a.slots, b.slots) and torch.equal(a.slot_valid, b.slot_valid)


def test_layer_attends_the_update_buffer_in_full():
    policy = kvpolicy.preset("pariskv", budget=100, sink=4, local=16,
                             prefill_units={"name": "analytic", "update_buffer": 10},
                             decode_units={"name": "analytic", "update_buffer": 10})
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    state.prefill(torch.randn(1, 2, 200, 16, generator=gen), torch.randn(1, 2, 200, 16, generator=gen),
                  torch.ones(1, 200, dtype=torch.bool), 4)
    for step in range(35):
        q, k, v = torch.randn(3, 1, 4, 16, generator=gen)
        state.decode(q, k[:, :2], v[:, :2], 0.25)
        index = state.units
        buffered = index.slots[int(index.indexed): int(index.next_position)].tolist()
        assert len(buffered) == step % 10 + 1
        slots, valid = state.store.attended_slots()
        for h in range(2):
            attended = slots[0, h][valid[0, h]].tolist()
            assert set(buffered) <= set(attended)
            assert len(attended) <= 100


# the prompt: 1,500 tokens on the GPU; under the interpreter 400 (its prefill encodes every prompt key in
# Python: three quarters of the time at 1,500). Either way the retrieval zone (1,432 or 332 tokens) is in
# the length rule's first band, its candidates (716 or 166) above the floor (120) and the budget, so the
# rerank cuts them; the votes and the rerank run over several chunks a row; six decode steps each
# re-select with a growing update buffer
@pytest.mark.parametrize("prompt", [pytest.param(1500, marks=GPU_CROSS), 400])
def test_triton_backend_attends_what_the_reference_backend_attends(prompt):
    # the whole selection (collision votes, counting-sort candidates, rerank) through Triton
    # (the interpreter on CPU) against the reference ops, step by step; on a CUDA machine both
    # backends run on the GPU (Triton without the interpreter cannot take CPU tensors)
    import os

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 2, 2, prompt, 32, generator=gen).to(device)
    steps = torch.randn(6, 3, 2, 4, 32, generator=gen).to(device)
    attended = {}
    for backend in ("reference", "triton"):
        policy = kvpolicy.preset("pariskv", budget=128, backend=backend)
        state = PolicyLayerState(policy, 0, device)
        state.prefill(keys, values, torch.ones(2, prompt, dtype=torch.bool, device=device), 4)
        seen = []
        for q, k, v in steps:
            state.decode(q, k[:, :2], v[:, :2], 32**-0.5)
            slots, valid = state.store.attended_slots()
            seen.append([sorted(slots[b, h][valid[b, h]].tolist()) for b in range(2) for h in range(2)])
        attended[backend] = seen
    assert attended["triton"] == attended["reference"]


# -- configuration ---------------------------------------------------------------------------


def test_preset_defaults():
    policy = kvpolicy.preset("pariskv")
    assert (policy.budget, policy.sink, policy.local) == (512, 4, 64)
    assert policy.trigger.registered_name == "every_step"
    assert policy.prefill_units == policy.decode_units == Analytic(update_buffer=64)
    assert policy.selector == CollisionRerank(candidate_fraction=0.1, min_candidates=2.0, tiers=None,
                                              rerank="group_mean")
    # a small budget shrinks the buffer to a quarter of the retrieval room
    assert kvpolicy.preset("pariskv", budget=96).prefill_units.update_buffer == 7
    assert Policy.from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize(
    "options,message",
    [
        ({"selector": "top_budget"}, "selector 'top_budget' reads the index type UnitTable, but prefill_units "
                                     "'analytic' build AnalyticIndex; selectors for it: collision_rerank"),
        ({"prefill_units": "kmeans"}, "selector 'collision_rerank' reads the index type AnalyticIndex.*selectors for "
                                      "it: bound, "
                                      "oracle, top_budget"),
        ({"decode_units": "pages"}, "decode_units must be the same builder with the same options"),
        ({"decode_units": {"name": "analytic", "update_buffer": 9}}, "decode_units must be the same builder"),
        ({"prefill_units": {"name": "analytic", "update_buffer": 500}, "decode_units": {"name": "analytic", "update_buffer": 500}},
         r"update_buffer 500 must be smaller than the retrieval budget \(budget - sink - local = 512 - 4 - 64 = 444\).*"
         r"accepted: 1..443"),
        ({"prefill_units": {"name": "analytic", "update_buffer": 0}, "decode_units": {"name": "analytic", "update_buffer": 0}},
         "update_buffer must be an integer >= 1"),
        ({"prefill_units": {"name": "analytic", "subspaces": 0}, "decode_units": {"name": "analytic", "subspaces": 0}},
         "subspaces must be None"),
        ({"selector": {"name": "collision_rerank", "candidate_fraction": 0}}, r"candidate_fraction must be a number in \(0, 1\]"),
        ({"selector": {"name": "collision_rerank", "candidate_fraction": 1.5}}, "candidate_fraction"),
        ({"selector": {"name": "collision_rerank", "min_candidates": 0.5}}, "min_candidates .* must be a number >= 1"),
        ({"selector": {"name": "collision_rerank", "tiers": 9}}, "tiers must be None .* or an integer in 1..8"),
        ({"selector": {"name": "collision_rerank", "rho": 9}}, "has no option.*rho.*its options: candidate_fraction, hold_count, "
                                                               "min_candidates, rerank, tiers"),
    ],
)
def test_config_errors_name_accepted_values(options, message):
    with pytest.raises(ConfigError, match=message):
        kvpolicy.preset("pariskv", **options)


def test_table_builders_cannot_take_an_analytic_decode():
    with pytest.raises(ConfigError, match="decode_units 'analytic' build their own AnalyticIndex.*decode_units one of: "
                                          "nearest_centroid, pages, segments"):
        Policy(trigger="every_step", prefill_units="kmeans", decode_units="analytic", selector="top_budget", budget=512)


def _prefill(policy, head_dim):
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    keys = torch.randn(1, 1, 300, head_dim)
    state.prefill(keys, keys, torch.ones(1, 300, dtype=torch.bool), 1)
    return state


def test_head_dim_errors_come_at_prefill_with_the_accepted_values():
    with pytest.raises(ConfigError, match="head_dim must be a power of two"):
        _prefill(kvpolicy.preset("pariskv"), 96)
    units = {"name": "analytic", "subspaces": 3}
    with pytest.raises(ConfigError, match="accepted: 8, 16, 32, 64; got 3"):
        _prefill(kvpolicy.preset("pariskv", prefill_units=units, decode_units=units), 64)
    state = _prefill(kvpolicy.preset("pariskv", selector={"name": "collision_rerank", "tiers": 6}), 64)
    with pytest.raises(ConfigError, match=r"4-dim subspaces have only 16; accepted: 1..4"):
        state.decode(torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64), 0.125)


# -- the stale-centroid baseline -------------------------------------------------------------


def test_nearest_centroid_scores_a_generated_token_by_its_prompt_cluster():
    gen = torch.Generator().manual_seed(4)
    centres = torch.randn(4, 16, generator=gen) * 10
    labels = torch.arange(64) % 4
    keys = (centres[labels] + 0.1 * torch.randn(64, 16, generator=gen)).view(1, 1, 64, 16)
    table = KMeans(tokens_per_cluster=16).build_index(keys, torch.ones(1, 64, dtype=torch.bool), "reference", 0)
    prompt_means = table.mean_keys()[0, 0, : table.num_prompt_units - 1]
    leaving = (centres[2] + torch.randn(16, generator=gen)).view(1, 1, 16)
    builder = NearestCentroid()
    table.append_leaving_token(torch.tensor(64), leaving, torch.ones(1, dtype=torch.bool),
                               torch.zeros(1, dtype=torch.bool), builder, "reference")
    new = table.num_prompt_units  # the token's own unit
    nearest = (prompt_means - centres[2]).norm(dim=-1).argmin()
    torch.testing.assert_close(table.key_sum[0, 0, new], prompt_means[nearest])
    assert int(table.size[0, 0, new]) == 1
    # top_budget then ranks it exactly with its cluster
    scores = TopBudget().score(torch.randn(1, 1, 1, 16, generator=gen), table)
    assert scores[0, 0, new] == pytest.approx(float(scores[0, 0, nearest]), rel=1e-5)


def test_bench_layer_runs_pariskv_with_its_own_index():
    from kvpolicy.bench.layer import LayerShape, RandomGroups, layer_policy, time_layer

    policy = layer_policy("pariskv", 128, "cpu", "reference", random_units=True)
    assert policy.prefill_units.registered_name == "analytic"  # random groups stand in for K-means only
    assert isinstance(layer_policy("clusterkv", 128, "cpu", "reference", random_units=True).prefill_units, RandomGroups)
    shape = LayerShape(batch=1, context=600, q_heads=4, kv_heads=2, head_dim=64, dtype=torch.float32)
    times = time_layer(policy, shape, torch.device("cpu"), repeats=1, with_full=False)
    assert times.preset == "pariskv" and times.selection_ms > 0 and times.transfer_bytes > 0
    assert times.units >= 600 - 4 - 64  # every retrievable token is a unit of the analytic index


def test_bench_layer_ranks_the_capacity_a_decode_reserves():
    from kvpolicy.bench.layer import LayerShape, layer_policy, time_layer

    shape = LayerShape(batch=1, context=640, q_heads=4, kv_heads=2, head_dim=64, dtype=torch.float32)
    policy = layer_policy("louiskv", 128, "cpu", "reference", random_units=True)
    bare = time_layer(policy, shape, torch.device("cpu"), repeats=1, with_full=False, decode_steps=0)
    policy = layer_policy("louiskv", 128, "cpu", "reference", random_units=True)
    room = time_layer(policy, shape, torch.device("cpu"), repeats=1, with_full=False, decode_steps=100)
    assert room.units >= bare.units + 100  # one possible unit per generated token
