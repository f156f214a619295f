"""Triton ``collision_count`` / ``candidate_topk`` / ``rerank`` against the reference, fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import analytic
from kvpolicy.kernels import dispatch, reference_analytic

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _encoded(seed: int, batch: int, heads: int, n: int, dim: int, subspaces: int, rho: int):
    gen = _gen(seed)
    signs = analytic.srht_signs(dim, seed)
    keys = analytic.encode_keys(torch.randn(batch, heads, n, dim, generator=gen), signs, subspaces)
    query = analytic.encode_query(torch.randn(batch, heads, dim, generator=gen), signs, subspaces, rho)
    return keys, query


def test_every_op_has_a_triton_version():
    dispatch.check("triton", DEVICE)  # all ops, ParisKV's included
    for op in ("collision_count", "candidate_topk", "rerank"):
        assert dispatch.get(op, "triton", DEVICE) is not getattr(reference_analytic, op)


@pytest.mark.parametrize(
    "rows, n, max_score, k, p_invalid",
    [
        (1, 700, 96, 70, 0.2),  # one partial chunk, many ties
        (3, 2500, 96, 250, 0.1),  # several chunks, the last partial
        (2, 1030, 7, 600, 0.3),  # few votes: ties across chunk boundaries
        (2, 300, 96, 280, 0.3),  # k above the valid keys: a -1 tail
        (1, 90, 0, 120, 0.5),  # every valid key has 0 votes; k > n
        (2, 2048, 96, 2048, 0.0),  # every key, exactly
    ],
)
def test_candidate_topk_matches_reference_exactly(rows, n, max_score, k, p_invalid):
    gen = _gen(rows * n + k)
    votes = torch.randint(0, max_score + 1, (rows, 2, n), generator=gen, dtype=torch.int32)
    votes = votes.masked_fill(torch.rand(rows, 2, n, generator=gen) < p_invalid, -1)
    want = reference_analytic.candidate_topk(votes, k)
    got = dispatch.get("candidate_topk", "triton", DEVICE)(votes.to(DEVICE), k, max_score)
    assert got.dtype == torch.long and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


def test_candidate_topk_reads_a_strided_view():
    gen = _gen(5)
    pool = torch.randint(-1, 20, (2, 3, 1500), generator=gen, dtype=torch.int32)
    votes = pool[:, :, 200:1400:2]  # strided along tokens
    want = reference_analytic.candidate_topk(votes, 90)
    got = dispatch.get("candidate_topk", "triton", DEVICE)(pool.to(DEVICE)[:, :, 200:1400:2], 90, 19)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "kwargs, message",
    [({}, "needs max_score"), ({"max_score": -1}, "needs max_score"), ({"max_score": 5000}, "below 1024")],
)
def test_candidate_topk_names_bad_arguments(kwargs, message):
    votes = torch.zeros(1, 1, 10, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        dispatch.get("candidate_topk", "triton", DEVICE)(votes, 3, **kwargs)
    with pytest.raises(ValueError, match="int32"):
        dispatch.get("candidate_topk", "triton", DEVICE)(votes.long(), 3, 5)


@pytest.mark.parametrize("dim,subspaces,rho", [(128, 16, 63), (64, 8, 6), (16, 16, 2)])
def test_collision_count_matches_reference_exactly(dim, subspaces, rho):
    keys, query = _encoded(dim + rho, 2, 3, 700, dim, subspaces, rho)  # 700: a partial key block
    valid = torch.rand(2, 3, 700, generator=_gen(rho)) > 0.25
    weights = analytic.tier_weights(6) if rho == 63 else tuple(range(rho, 0, -1))
    want = reference_analytic.collision_count(query.centroids, keys.centroids, valid, weights)
    got = dispatch.get("collision_count", "triton", DEVICE)(
        query.centroids.to(DEVICE), keys.centroids.to(DEVICE), valid.to(DEVICE), torch.tensor(weights, device=DEVICE),
    )
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu(), want)
    assert want.max() > 0 and (want == -1).any()  # the comparison saw hits and invalid keys


def test_collision_count_reads_strided_views():
    gen = _gen(11)
    # a pool with room for more tokens than are used, a per-sequence mask broadcast over heads
    pool = torch.randint(0, 256, (2, 2, 900, 5), generator=gen, dtype=torch.uint8)
    keys = pool[:, :, 100:613]
    query = torch.stack([torch.randperm(256, generator=gen)[:4] for _ in range(2 * 2 * 5)]).view(2, 2, 5, 4)
    valid = (torch.rand(2, 1, 513, generator=gen) > 0.5).expand(2, 2, 513)
    weights = (4, 3, 2, 1)
    want = reference_analytic.collision_count(query.to(torch.uint8), keys, valid, weights)
    got = dispatch.get("collision_count", "triton", DEVICE)(
        query.to(torch.uint8).to(DEVICE), pool.to(DEVICE)[:, :, 100:613], valid.to(DEVICE), weights,
    )
    assert torch.equal(got.cpu(), want)


def _candidates(seed: int, batch: int, heads: int, n: int, count: int) -> torch.Tensor:
    gen = _gen(seed)
    cands = torch.stack([torch.randperm(n, generator=gen)[:count] for _ in range(batch * heads)]).view(batch, heads, count)
    drop = torch.rand(batch, heads, count, generator=gen) < 0.2
    return torch.where(drop, -1, cands)


@pytest.mark.parametrize("dim,subspaces", [(128, 16), (64, 8)])
def test_rerank_matches_reference(dim, subspaces):
    keys, query = _encoded(dim, 2, 2, 600, dim, subspaces, 4)
    cands = _candidates(dim, 2, 2, 600, 300)  # 300: a partial candidate block, some -1
    from kvpolicy.kernels.triton import rerank as triton_rerank

    want = reference_analytic.rerank_scores(query.rotated, keys.codes, keys.weight, keys.norms, cands)
    on = [t.to(DEVICE) for t in (query.rotated, keys.codes, keys.weight, keys.norms, cands)]
    got = triton_rerank.rerank_scores(*on).cpu()
    listed = cands >= 0
    assert torch.equal(got == float("-inf"), ~listed)
    torch.testing.assert_close(got[listed], want[listed], rtol=1e-3, atol=1e-6)

    want_top = reference_analytic.rerank(query.rotated, keys.codes, keys.weight, keys.norms, cands, 40)
    got_top = dispatch.get("rerank", "triton", DEVICE)(*on, 40).cpu()
    # the same set; the order may differ only between candidates whose scores tie to 1e-5
    assert torch.equal(got_top.sort(-1).values, want_top.sort(-1).values)


def test_rerank_pads_with_minus_one_and_reads_a_strided_pool():
    keys, query = _encoded(3, 1, 2, 64, 32, 4, 3)
    codes = torch.zeros(1, 2, 100, 16, dtype=torch.uint8)
    codes[:, :, 10:74] = keys.codes  # the used rows of a bigger pool
    cands = torch.tensor([[[5, -1, 7, 63], [-1, -1, -1, -1]]])
    want = reference_analytic.rerank(query.rotated, keys.codes, keys.weight, keys.norms, cands, 6)
    got = dispatch.get("rerank", "triton", DEVICE)(
        query.rotated.to(DEVICE), codes.to(DEVICE)[:, :, 10:74], keys.weight.to(DEVICE), keys.norms.to(DEVICE),
        cands.to(DEVICE), 6,
    ).cpu()
    assert torch.equal(got, want)
    assert got[0, 0, 3:].tolist() == [-1, -1, -1] and got[0, 1].tolist() == [-1] * 6
    assert sorted(got[0, 0, :3].tolist()) == [5, 7, 63]


def test_triton_ops_refuse_misshaped_inputs():
    collision = dispatch.get("collision_count", "triton", DEVICE)
    with pytest.raises(ValueError, match=r"query centroids \(1, 2, 3, 4\) and valid \(1, 2, 5\) do not fit"):
        collision(torch.zeros(1, 2, 3, 4, dtype=torch.long, device=DEVICE),
                  torch.zeros(1, 2, 5, 2, dtype=torch.uint8, device=DEVICE),
                  torch.ones(1, 2, 5, dtype=torch.bool, device=DEVICE), (4, 3, 2, 1))
    rerank = dispatch.get("rerank", "triton", DEVICE)
    with pytest.raises(ValueError, match=r"do not fit codes \(1, 2, 5, 8\)"):
        rerank(torch.zeros(1, 2, 32, device=DEVICE), torch.zeros(1, 2, 5, 8, dtype=torch.uint8, device=DEVICE),
               torch.ones(1, 2, 5, device=DEVICE), torch.ones(1, 2, 5, device=DEVICE),
               torch.zeros(1, 2, 3, dtype=torch.long, device=DEVICE), 2)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("n", [131072, 1048576])
def test_candidate_topk_at_decode_sizes(n):
    # ParisKV's candidate width: 10% of the tokens, votes of 16 subspaces x 6 tiers
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    votes = torch.randint(0, 97, (1, 8, n), generator=gen, device=DEVICE, dtype=torch.int32)
    votes = votes.masked_fill(torch.rand(1, 8, n, generator=gen, device=DEVICE) < 0.01, -1)
    k = n // 10
    want = reference_analytic.candidate_topk(votes, k)
    got = dispatch.get("candidate_topk", "triton", DEVICE)(votes, k, 96)
    assert torch.equal(got, want)


# -- the fused selection pipeline: query_votes, collision_candidates ------------------------


@pytest.mark.parametrize("batch,heads,group,dim,subspaces,tiers", [(1, 2, 4, 128, 16, 6), (2, 2, 3, 64, 16, 4), (1, 2, 1, 16, 16, 1)])
def test_query_votes_matches_reference(batch, heads, group, dim, subspaces, tiers):
    from kvpolicy.kernels.triton import query_votes

    gen = _gen(dim + group)
    signs = analytic.srht_signs(dim, 3)
    weights = torch.tensor(analytic.tier_weights(tiers), dtype=torch.int32)
    query = torch.randn(batch, heads, group, dim, generator=gen).to(torch.bfloat16)  # the model's dtype
    want_rotated, want_table = reference_analytic.query_votes(query, signs, subspaces, weights)
    rotated, table = query_votes.query_votes(query.to(DEVICE), signs.to(DEVICE), subspaces, weights.to(DEVICE))
    # the table is integer votes: identical (a float near-tie across a tier boundary would differ)
    assert table.dtype == torch.int32 and torch.equal(table.cpu(), want_table)
    torch.testing.assert_close(rotated.cpu(), want_rotated, rtol=0, atol=1e-6)  # measured 6e-8
    assert (want_table > 0).sum(-1).eq((1 << tiers) - 1).all()  # every ranked centroid voted


def test_query_votes_refuses_misshaped_inputs():
    from kvpolicy.kernels.triton import query_votes

    with pytest.raises(ValueError, match=r"triton query_votes: query \(1, 1, 2, 96\)"):
        query_votes.query_votes(torch.zeros(1, 1, 2, 96, device=DEVICE), torch.ones(96, device=DEVICE), 12, (2, 1))
    with pytest.raises(ValueError, match=r"\(20,\) tier weights do not fit"):
        query_votes.query_votes(torch.zeros(1, 1, 2, 16, device=DEVICE), torch.ones(16, device=DEVICE), 4, [1] * 20)


@pytest.fixture
def small_chunks(monkeypatch):
    """Several chunks and chunk blocks at interpreter sizes."""
    from kvpolicy.kernels.triton import collision_candidates

    monkeypatch.setattr(collision_candidates, "_CHUNK", 256)
    monkeypatch.setattr(collision_candidates, "_SUB", 64)
    monkeypatch.setattr(collision_candidates, "_CHUNK_BLOCK", 2)
    return collision_candidates.collision_candidates


@pytest.mark.parametrize(
    "n, tiers, indexed, width, floor, fraction, bands",
    [
        (1100, 4, 1000, 600, 40, 0.1, ((300, 0.5), (600, 0.25), (900, 0.2))),  # the rule's last band
        (1100, 4, 500, 600, 40, 0.1, ((300, 0.5), (600, 0.25), (900, 0.2))),  # a lower band, indexed < n
        (700, 1, 700, 700, 90, 0.05, ()),  # votes 0..16: ties everywhere, the floor decides
        (700, 4, 650, 120, 10, 0.5, ()),  # the width cuts the rule's count
        (700, 4, 650, 700, 900, 0.1, ()),  # the floor exceeds the zone: every voted token
        (300, 4, 0, 50, 10, 0.1, ()),  # nothing indexed yet: all -1
    ],
)
def test_collision_candidates_matches_reference_exactly(small_chunks, n, tiers, indexed, width, floor, fraction, bands):
    batch, heads, dim, subspaces = 2, 2, 64, 16
    keys, query = _encoded(n + tiers, batch, heads, n, dim, subspaces, (1 << tiers) - 1)
    table = reference_analytic.vote_table(query.centroids, analytic.tier_weights(tiers))
    pool = torch.zeros(batch, heads, n + 37, subspaces, dtype=torch.uint8)  # a pool with spare room
    pool[:, :, :n] = keys.centroids
    token_valid = torch.rand(batch, n + 37, generator=_gen(n)) > 0.2
    args = (torch.tensor(indexed), width, subspaces * tiers, floor, fraction, bands)
    want = reference_analytic.collision_candidates(table, pool, token_valid, *args)
    on = [t.to(DEVICE) for t in (table, pool, token_valid)]
    got = small_chunks(*on, args[0].to(DEVICE), *args[1:])
    assert got.dtype == torch.long and torch.equal(got.cpu(), want)
    # the reference is the composed ops' set, listed by position
    voted = (token_valid & (torch.arange(n + 37) < indexed))[:, None].expand(batch, heads, n + 37)
    votes = reference_analytic.collision_count(query.centroids, pool, voted, analytic.tier_weights(tiers))
    keep = reference_analytic.candidate_count(voted.sum(-1), floor, fraction, bands).clamp(max=width)
    for b in range(batch):
        for h in range(heads):
            best = reference_analytic.candidate_topk(votes[b : b + 1, h : h + 1], width)[0, 0, : int(keep[b, h])]
            listed = sorted(p for p in best.tolist() if p >= 0)
            assert got[b, h].tolist() == listed + [-1] * (width - len(listed))


def test_collision_candidates_refuses_misshaped_inputs():
    from kvpolicy.kernels.triton import collision_candidates

    keys = torch.zeros(1, 2, 10, 4, dtype=torch.uint8, device=DEVICE)
    table = torch.zeros(1, 2, 4, 256, dtype=torch.int32, device=DEVICE)
    valid = torch.ones(1, 10, dtype=torch.bool, device=DEVICE)
    indexed = torch.tensor(10, device=DEVICE)
    with pytest.raises(ValueError, match=r"table \(1, 2, 4, 256\) torch.int64"):
        collision_candidates.collision_candidates(table.long(), keys, valid, indexed, 5, 16, 1, 0.1)
    with pytest.raises(ValueError, match=r"token_valid \(1, 9\)"):
        collision_candidates.collision_candidates(table, keys, valid[:, :9], indexed, 5, 16, 1, 0.1)
    with pytest.raises(ValueError, match="max_votes must be an int"):
        collision_candidates.collision_candidates(table, keys, valid, indexed, 5, 40_000, 1, 0.1)
    with pytest.raises(ValueError, match="at most 4 length bands"):
        collision_candidates.collision_candidates(table, keys, valid, indexed, 5, 16, 1, 0.1, [(9, 0.5)] * 5)


@pytest.mark.parametrize("indexed, count", [(299, 150), (300, 30), (599, 60), (600, 30)])
def test_collision_candidates_band_bounds_are_exclusive(small_chunks, indexed, count):
    # every token valid, so the zone is `indexed` tokens exactly: a band holds zones below its bound
    keys, query = _encoded(indexed, 1, 2, 700, 32, 8, 7)
    table = reference_analytic.vote_table(query.centroids, analytic.tier_weights(3))
    valid = torch.ones(1, 700, dtype=torch.bool)
    args = (torch.tensor(indexed), 400, 24, 5, 0.05, ((300, 0.5), (600, 0.1)))
    want = reference_analytic.collision_candidates(table, keys.centroids, valid, *args)
    got = small_chunks(table.to(DEVICE), keys.centroids.to(DEVICE), valid.to(DEVICE), args[0].to(DEVICE), *args[1:])
    assert torch.equal(got.cpu(), want)
    assert (want >= 0).sum(-1).tolist() == [[count, count]]
