"""ParisKV's encoding (``kvpolicy.analytic``) and its reference ops, on seeded random inputs.

Thresholds are the measured figures with margin (measured values in the comments).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy import analytic
from kvpolicy.errors import ConfigError
from kvpolicy.kernels import dispatch, reference_analytic

D = 128


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- rotation --------------------------------------------------------------------------------


def test_srht_signs_are_fixed_per_seed():
    a, b = analytic.srht_signs(D, 3), analytic.srht_signs(D, 3)
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert set(a.tolist()) == {-1.0, 1.0}
    assert not torch.equal(a, analytic.srht_signs(D, 4))


@pytest.mark.parametrize("dim", [2, 16, 128])
def test_rotation_is_orthogonal(dim):
    signs = analytic.srht_signs(dim, 0)
    # rotating the scaled basis gives the rotation matrix itself (rotate normalises first)
    matrix = analytic.rotate(torch.eye(dim) * 3.0, signs)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(dim), atol=1e-5, rtol=0)
    x, y = torch.randn(2, 50, dim, generator=_gen(dim))
    rx = analytic.rotate(x, signs) * x.norm(dim=-1, keepdim=True)
    ry = analytic.rotate(y, signs) * y.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(rx.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close((rx * ry).sum(-1), (x * y).sum(-1), atol=1e-4, rtol=1e-5)


def test_rotation_keeps_zero_vectors_zero_and_accepts_half_precision():
    signs = analytic.srht_signs(D, 0)
    assert torch.equal(analytic.rotate(torch.zeros(2, D), signs), torch.zeros(2, D))
    x = torch.randn(4, D, generator=_gen(1))
    half = analytic.rotate(x.to(torch.bfloat16), signs)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, analytic.rotate(x, signs), atol=2e-2, rtol=0)


# -- code levels and layouts -----------------------------------------------------------------


def test_magnitude_levels_match_the_gaussian_lloyd_max_levels():
    levels = analytic.magnitude_levels(D)
    assert levels.shape == (8,) and levels.dtype == torch.float32
    assert (levels.diff() > 0).all() and levels[0] > 0 and levels[-1] < 1
    # a coordinate of a random unit vector in R^128 is nearly N(0, 1/128): the 16-level
    # Lloyd-Max quantizer of N(0, 1) has these positive levels (Max, 1960)
    gaussian = torch.tensor([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326]) / math.sqrt(D)
    torch.testing.assert_close(levels, gaussian, rtol=0.03, atol=0)  # measured: within 1.7%
    assert analytic.magnitude_levels(D) is levels  # cached


def test_codes_pack_sign_and_magnitude_per_nibble():
    levels = analytic.magnitude_levels(4)
    # coordinate 0: +level 0, coordinate 1: -level 7, coordinate 2: -level 2, coordinate 3: +level 5
    rotated = torch.stack([levels[0], -levels[7], -levels[2], levels[5]])
    codes = analytic.quantize(rotated)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0 | (8 | 7) << 4, (8 | 2) | 5 << 4]
    torch.testing.assert_close(analytic.dequantize(codes), rotated)


@pytest.mark.parametrize("dim", [32, 128])
def test_nibble_values_are_what_dequantize_gives_each_code(dim):
    # byte b holds code b & 15 in its low nibble, b >> 4 in its high one
    codes = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, dim // 2)
    values = analytic.dequantize(codes)[:, :2]
    table = analytic.nibble_values(dim)
    assert torch.equal(table[codes[:, 0].long() & 15], values[:, 0])
    assert torch.equal(table[codes[:, 0].long() >> 4], values[:, 1])
    assert torch.equal(table[8:], -analytic.magnitude_levels(dim))


def test_centroid_ids_are_sign_bits_per_subspace():
    rotated = torch.tensor([0.5, -0.1, 0.0, -0.3, -0.2, 0.1, 0.4, 0.2])  # 2 subspaces of 4 dims
    assert analytic.centroid_ids(rotated, 2).tolist() == [0b0101, 0b1110]
    patterns = analytic.sign_patterns(4)
    assert torch.equal(patterns[0b0101] * 2, torch.tensor([1.0, -1.0, 1.0, -1.0]))


def _keys(seed: int, batch: int = 4, heads: int = 8, n: int = 1024) -> torch.Tensor:
    """Gaussian keys, half of the heads with a few large outlier channels (as LLM keys have)."""
    keys = torch.randn(batch, heads, n, D, generator=_gen(seed))
    keys[:, : heads // 2, :, :4] += 8.0
    return keys


def test_encode_round_trip_keeps_the_rotated_key():
    keys = _keys(0)
    signs = analytic.srht_signs(D, 0)
    encoded = analytic.encode_keys(keys.to(torch.bfloat16), signs)
    assert encoded.centroids.shape == (4, 8, 1024, 16) and encoded.centroids.dtype == torch.uint8
    assert encoded.codes.shape == (4, 8, 1024, 64) and encoded.codes.dtype == torch.uint8
    assert encoded.weight.dtype == encoded.norms.dtype == torch.float32
    rotated = analytic.rotate(keys.to(torch.bfloat16), signs)
    decoded = analytic.dequantize(encoded.codes)
    cosine = torch.nn.functional.cosine_similarity(rotated, decoded, dim=-1)
    assert cosine.min() > 0.97  # measured 0.979 (worst of 32768 keys)
    assert cosine.mean() > 0.99  # measured 0.9954
    torch.testing.assert_close(encoded.norms, keys.to(torch.bfloat16).float().norm(dim=-1))
    assert torch.equal(encoded.centroids, analytic.centroid_ids(rotated, 16))


def test_the_calibrated_estimate_is_exact_for_the_key_itself_and_unbiased():
    keys = _keys(1, batch=1)
    signs = analytic.srht_signs(D, 1)
    encoded = analytic.encode_keys(keys, signs)
    decoded = analytic.dequantize(encoded.codes)

    def estimate(query):  # (1, H, D) -> (1, H, N): |q| * norm * weight * <q_rot, k_hat>
        q_rot = analytic.rotate(query, signs)
        dot = torch.einsum("bhnd,bhd->bhn", decoded, q_rot)
        return query.norm(dim=-1, keepdim=True) * encoded.norms * encoded.weight * dot

    self_estimate = encoded.norms * encoded.weight * (analytic.rotate(keys, signs) * decoded).sum(-1) * encoded.norms
    torch.testing.assert_close(self_estimate, encoded.norms.square(), rtol=1e-4, atol=0)

    query = torch.randn(1, 8, D, generator=_gen(2))
    query[:, :4, :4] += 8.0
    true = torch.einsum("bhnd,bhd->bhn", keys, query)
    error = (estimate(query) - true) / (encoded.norms * query.norm(dim=-1, keepdim=True))
    assert error.mean().abs() < 1e-3  # measured 2e-4: unbiased
    assert error.std() < 0.012  # measured 0.0075 (in units of |q||k|)
    correlation = torch.corrcoef(torch.stack([estimate(query).flatten(), true.flatten()]))[0, 1]
    assert correlation > 0.995  # measured 0.9999 (0.997 on the heads without outliers)


def test_a_zero_key_encodes_to_a_zero_estimate():
    encoded = analytic.encode_keys(torch.zeros(3, D), analytic.srht_signs(D, 0))
    assert torch.equal(encoded.weight, torch.zeros(3)) and torch.equal(encoded.norms, torch.zeros(3))


def test_encode_query_ranks_centroids_by_score_and_reports_tiers():
    signs = analytic.srht_signs(D, 5)
    query = torch.randn(2, 3, D, generator=_gen(5))
    encoded = analytic.encode_query(query, signs)  # 16 subspaces, rho 63
    assert encoded.centroids.shape == (2, 3, 16, 63) and encoded.rotated.shape == (2, 3, D)
    parts = encoded.rotated.view(2, 3, 16, 8)
    scores = (parts.unsqueeze(-2) * analytic.sign_patterns(8)[encoded.centroids]).sum(-1)
    assert (scores.diff(dim=-1) <= 0).all()
    assert (encoded.centroids.unique(dim=-1).shape[-1]) == 63  # distinct centroids
    # the best centroid is the query's own sign pattern, i.e. what the key encoder assigns it
    assert torch.equal(encoded.centroids[..., 0], analytic.encode_keys(query, signs).centroids.long())
    assert encoded.tiers.tolist() == [0] + [1] * 2 + [2] * 4 + [3] * 8 + [4] * 16 + [5] * 32
    assert analytic.tier_weights(3) == (3, 2, 2, 1, 1, 1, 1)


# -- reference ops ---------------------------------------------------------------------------


def test_dispatch_serves_the_analytic_reference_ops():
    cpu = torch.device("cpu")
    for op in ("collision_count", "candidate_topk", "rerank"):
        assert dispatch.get(op, "reference", cpu) is getattr(reference_analytic, op)


def test_collision_count_matches_a_plain_loop():
    gen = _gen(6)
    batch, heads, n, subspaces, rho = 2, 2, 40, 4, 5
    keys = torch.randint(0, 16, (batch, heads, n, subspaces), generator=gen, dtype=torch.uint8)
    query = torch.stack([torch.randperm(16, generator=gen)[:rho] for _ in range(batch * heads * subspaces)])
    query = query.view(batch, heads, subspaces, rho)
    valid = torch.rand(batch, heads, n, generator=gen) > 0.2
    weights = (9, 4, 3, 2, 1)
    votes = reference_analytic.collision_count(query.to(torch.uint8), keys, valid, weights)
    assert votes.dtype == torch.int32
    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                want = sum(weights[r] for s in range(subspaces) for r in range(rho) if keys[b, h, i, s] == query[b, h, s, r])
                assert votes[b, h, i] == (want if valid[b, h, i] else -1)


def test_candidate_topk_breaks_ties_by_index_and_pads_with_minus_one():
    scores = torch.tensor([[[3, 5, -1, 5, 0, 3, -1]]], dtype=torch.int32)
    assert reference_analytic.candidate_topk(scores, 4).tolist() == [[[1, 3, 0, 5]]]
    assert reference_analytic.candidate_topk(scores, 7).tolist() == [[[1, 3, 0, 5, 4, -1, -1]]]
    assert reference_analytic.candidate_topk(scores, 9).tolist() == [[[1, 3, 0, 5, 4, -1, -1, -1, -1]]]


def test_rerank_ranks_candidates_by_the_dequantised_estimate():
    gen = _gen(7)
    keys = torch.randn(2, 3, 50, 16, generator=gen)
    signs = analytic.srht_signs(16, 7)
    encoded = analytic.encode_keys(keys, signs, subspaces=2)
    query = analytic.encode_query(torch.randn(2, 3, 16, generator=gen), signs, subspaces=2, rho=4)
    candidates = torch.stack([torch.randperm(50, generator=gen)[:12] for _ in range(6)]).view(2, 3, 12)
    candidates[0, 0, 3:] = -1  # only 3 listed here
    got = reference_analytic.rerank(query.rotated, encoded.codes, encoded.weight, encoded.norms, candidates, 5)
    decoded = analytic.dequantize(encoded.codes)
    for b in range(2):
        for h in range(3):
            listed = [c for c in candidates[b, h].tolist() if c >= 0]
            score = {c: (encoded.norms[b, h, c] * encoded.weight[b, h, c] * (decoded[b, h, c] @ query.rotated[b, h])).item()
                     for c in listed}
            want = sorted(listed, key=lambda c: -score[c])[:5]
            assert got[b, h].tolist() == want + [-1] * (5 - len(want))


def _clustered(seed: int, heads: int = 8, n: int = 4096, clusters: int = 64):
    """Keys around 64 random directions (norms 0.8-1.2); each head's query near one of them."""
    gen = _gen(seed)
    centers = torch.nn.functional.normalize(torch.randn(heads, clusters, D, generator=gen), dim=-1)
    label = torch.randint(0, clusters, (heads, n), generator=gen)
    keys = centers.gather(1, label[..., None].expand(heads, n, D)) + torch.randn(heads, n, D, generator=gen) / D**0.5
    keys = torch.nn.functional.normalize(keys, dim=-1) * (0.8 + 0.4 * torch.rand(heads, n, 1, generator=gen))
    pick = torch.randint(0, clusters, (heads,), generator=gen)
    query = centers[torch.arange(heads), pick] + torch.randn(heads, D, generator=gen) / D**0.5
    return keys[None], 3 * query[None]


def _recall(found: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """Fraction of ``true (B, H, k)`` in ``found (B, H, m)``, per head."""
    return (true[..., :, None] == found[..., None, :]).any(-1).float().mean(-1)


def test_ten_percent_of_tokens_by_collision_votes_hold_the_true_top_64():
    keys, query = _clustered(0)  # top-64 cosine about 0.35, median 0.0
    n = keys.shape[2]
    signs = analytic.srht_signs(D, 0)
    encoded = analytic.encode_keys(keys, signs)
    q = analytic.encode_query(query, signs)
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    votes = reference_analytic.collision_count(q.centroids, encoded.centroids, valid, analytic.tier_weights())
    candidates = reference_analytic.candidate_topk(votes, n // 10)
    true = torch.topk(torch.einsum("bhnd,bhd->bhn", keys, query), 64, dim=-1).indices
    recall = _recall(candidates, true)
    assert recall.mean() >= 0.95 and recall.min() >= 0.90  # measured 0.990 mean, 0.969 worst head
    top = reference_analytic.rerank(q.rotated, encoded.codes, encoded.weight, encoded.norms, candidates, 64)
    final = _recall(top, true)
    assert final.mean() >= 0.95 and final.min() >= 0.90  # measured 0.984 mean, 0.953 worst head


# -- bad input -------------------------------------------------------------------------------


def test_bad_settings_raise_config_errors_naming_the_accepted_values():
    with pytest.raises(ConfigError, match=r"head_dim must be a power of two >= 2 \(e.g. 64, 128, 256\), got 96"):
        analytic.srht_signs(96, 0)
    with pytest.raises(ConfigError, match="power of two"):
        analytic.encode_keys(torch.randn(3, 96), torch.ones(96))
    with pytest.raises(ConfigError, match=r"accepted: 16, 32, 64, 128; got 12"):
        analytic.AnalyticCodebook(128, subspaces=12)
    with pytest.raises(ConfigError, match=r"accepted: 16, 32, 64, 128; got 8"):
        analytic.encode_keys(torch.randn(3, 128), analytic.srht_signs(128), subspaces=8)  # 16 dims each
    with pytest.raises(ConfigError, match=r"rho must be an integer in 1\.\.256 .*got 300"):
        analytic.encode_query(torch.randn(128), analytic.srht_signs(128), rho=300)
    with pytest.raises(ConfigError, match=r"rho must be an integer in 1\.\.16 .*got 63"):
        analytic.AnalyticCodebook(64).encode_query(torch.randn(64), analytic.srht_signs(64))  # 4-dim subspaces
    with pytest.raises(ConfigError, match=r"tiers must be an integer in 1\.\.8"):
        analytic.tier_weights(9)
    with pytest.raises(ValueError, match=r"one int per query rank \(5\), got shape \(3,\)"):
        reference_analytic.collision_count(
            torch.zeros(1, 1, 2, 5, dtype=torch.long), torch.zeros(1, 1, 4, 2, dtype=torch.uint8),
            torch.ones(1, 1, 4, dtype=torch.bool), (3, 2, 1),
        )
