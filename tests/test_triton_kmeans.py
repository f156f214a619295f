"""Triton ``kmeans`` against the reference (on CPU through Triton's interpreter; conftest
turns it on when there is no CUDA)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels import dispatch, reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def triton_kmeans():
    return dispatch.get("kmeans", "triton", DEVICE)


def left_padded(batch: int, n: int, pads: list[int]) -> torch.Tensor:
    valid = torch.ones(batch, n, dtype=torch.bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
    return valid


def clustered_keys(gen, valid, heads, dim, clusters, spread=0.05):
    """Tokens scattered tightly around well separated random centres. Each row's valid
    tokens come in ``clusters`` runs, one per centre, each starting at one of the evenly
    spaced initial tokens, so no two centroids compete for a cluster (no near-ties)."""
    batch, n = valid.shape
    centres = 4.0 * torch.randn(batch, heads, clusters, dim, generator=gen)
    rank = (valid.long().cumsum(-1) - 1).clamp(min=0)
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    starts = (torch.linspace(0, 1, clusters) * (count - 1)).round().long()  # as the initialisation
    truth = (torch.searchsorted(starts, rank, right=True) - 1)[:, None, :].expand(batch, heads, n)
    keys = centres.gather(2, truth[..., None].expand(batch, heads, n, dim))
    return keys + spread * torch.randn(batch, heads, n, dim, generator=gen)


def sq_dist(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (x.double() - c.double()).pow(2).sum(-1)


def assert_matches_reference(keys, valid, clusters, iters, *, exact=False, tol=1e-4):
    """Valid tokens' labels agree (all of them if ``exact``, else >= 99% and any other is a
    near-tie), and centroids agree where every label does."""
    keys, valid = keys.to(DEVICE), valid.to(DEVICE)
    labels, centroids = triton_kmeans()(keys, valid, clusters, iters)
    ref_labels, ref_centroids = reference.kmeans(keys, valid, clusters, iters)
    batch, heads, n, dim = keys.shape
    assert labels.shape == (batch, heads, n) and labels.dtype == torch.long
    assert centroids.shape == (batch, heads, clusters, dim) and centroids.dtype == torch.float32
    mask = valid[:, None, :].expand(batch, heads, n)
    differ = (labels != ref_labels) & mask
    if exact:
        assert not differ.any(), f"{int(differ.sum())} labels differ"
    else:
        assert differ.sum() <= 0.01 * mask.sum(), f"{int(differ.sum())} of {int(mask.sum())} labels differ"
    if differ.any():
        # the last labels were assigned against the centroids of the iteration before
        _, before = reference.kmeans(keys, valid, clusters, iters - 1)
        b, h, i = differ.nonzero(as_tuple=True)
        x = keys[b, h, i].double()
        mine, theirs = sq_dist(x, before[b, h, labels[b, h, i]]), sq_dist(x, before[b, h, ref_labels[b, h, i]])
        scale = x.pow(2).sum(-1) + before[b, h].double().pow(2).sum(-1).mean(-1)
        assert ((mine - theirs).abs() <= tol * scale).all(), (mine - theirs).abs().max()
    else:
        torch.testing.assert_close(centroids, ref_centroids, atol=1e-3, rtol=1e-4)
    return labels, centroids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128])
def test_separated_clusters_labels_match_exactly(dtype, dim):
    gen = torch.Generator().manual_seed(dim + len(str(dtype)))
    valid = left_padded(2, 96, [0, 13])
    keys = clustered_keys(gen, valid, 2, dim, clusters=12).to(dtype)
    assert_matches_reference(keys, valid, 12, iters=4, exact=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_keys_agree_up_to_near_ties(seed, dtype):
    gen = torch.Generator().manual_seed(100 + seed)
    dim = (64, 128, 40)[seed]  # 40: a head size that is no power of two
    keys = torch.randn(2, 3, 150, dim, generator=gen).to(dtype)
    valid = left_padded(2, 150, [0, 21 + seed])
    assert_matches_reference(keys, valid, 20, iters=3)


def test_first_assignment_is_nearest_initial_centroid():
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 130, 64, generator=gen)
    valid = left_padded(1, 130, [5])
    labels, _ = assert_matches_reference(keys, valid, 33, iters=1)
    # every label is the nearest initial centroid, up to the kernel's precision
    _, init = reference.kmeans(keys, valid, 33, iters=0)
    d = sq_dist(keys[..., None, :], init[:, :, None]).to(DEVICE)  # (B, H, n, C)
    chosen = d.gather(-1, labels[..., None]).squeeze(-1)
    assert ((chosen - d.min(-1).values) <= 1e-4 * d.mean()).all()


def test_iters_zero_returns_the_initial_centroids():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2, 50, 64, generator=gen).to(torch.bfloat16)
    valid = left_padded(2, 50, [0, 9])
    labels, centroids = triton_kmeans()(keys.to(DEVICE), valid.to(DEVICE), 7, 0)
    ref_labels, ref_centroids = reference.kmeans(keys, valid, 7, 0)
    assert torch.equal(labels.cpu(), ref_labels) and torch.equal(centroids.cpu(), ref_centroids)


def test_invalid_tokens_neither_move_centroids_nor_change_valid_labels():
    gen = torch.Generator().manual_seed(4)
    valid = left_padded(2, 80, [0, 17])
    keys = clustered_keys(gen, valid, 2, 64, clusters=6)
    garbage = keys.clone()
    garbage[1, :, :17] = 1000.0 * torch.randn(2, 17, 64, generator=gen)
    labels, centroids = assert_matches_reference(garbage, valid, 6, iters=5, exact=True)
    clean_labels, clean_centroids = triton_kmeans()(keys.to(DEVICE), valid.to(DEVICE), 6, 5)
    mask = valid[:, None, :].expand(2, 2, 80).to(DEVICE)
    assert torch.equal(labels[mask], clean_labels[mask])
    torch.testing.assert_close(centroids, clean_centroids, atol=1e-5, rtol=1e-5)
    assert centroids.abs().max() < 50  # no centroid was pulled towards the garbage


def test_more_clusters_than_valid_tokens_keeps_duplicates_and_empty_clusters():
    # 10 valid tokens, 24 clusters: initial centroids repeat; the first of equal centroids
    # takes the tokens and the emptied copies keep their old value
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 2, 40, 64, generator=gen).to(torch.float16)
    valid = left_padded(2, 40, [30, 0])
    assert_matches_reference(keys, valid, 24, iters=3, exact=True)
    assert_matches_reference(keys, valid, 48, iters=2, exact=True)  # more clusters than tokens


def test_all_padding_row_and_tiny_head_dim():
    gen = torch.Generator().manual_seed(6)
    keys = torch.randn(2, 1, 30, 2, generator=gen)
    valid = left_padded(2, 30, [30, 3])
    assert_matches_reference(keys, valid, 3, iters=2)


def test_strided_keys():
    # keys viewed out of a (B, n, H, D) buffer, as a cache may hold them
    gen = torch.Generator().manual_seed(8)
    valid = left_padded(1, 70, [4])
    buffer = clustered_keys(gen, valid, 2, 64, clusters=5).transpose(1, 2).contiguous()
    keys = buffer.transpose(1, 2)
    assert not keys.is_contiguous()
    assert_matches_reference(keys, valid, 5, iters=3, exact=True)


def test_reachable_through_dispatch():
    from kvpolicy.kernels.triton import kmeans as module

    assert dispatch.get("kmeans", "triton", DEVICE) is module.kmeans
    assert dispatch.why_unavailable("triton", "kmeans", DEVICE) is None


@needs_cuda
@pytest.mark.parametrize("clustered", [False, True])
def test_cuda_realistic_size(clustered):
    gen = torch.Generator().manual_seed(11)
    n = 32768
    valid = left_padded(1, n, [1000])
    if clustered:
        keys = clustered_keys(gen, valid, 8, 128, clusters=2048, spread=0.02)
    else:
        keys = torch.randn(1, 8, n, 128, generator=gen)
    assert_matches_reference(keys.to(torch.bfloat16), valid, 2048, iters=3, exact=clustered)


@needs_cuda
def test_cuda_offsets_past_int32():
    # B*H*n*D > 2**31 elements: offsets must be 64-bit
    n = 2**31 // 128 + 4096
    keys = torch.randn(1, 1, n, 128, device=DEVICE, dtype=torch.bfloat16)
    valid = torch.ones(1, n, dtype=torch.bool, device=DEVICE)
    labels, centroids = triton_kmeans()(keys, valid, 16, 1)
    _, init = reference.kmeans(keys, valid, 16, 0)
    tail = keys[0, 0, -4096:].float()
    nearest = torch.cdist(tail, init[0, 0]).argmin(-1)
    assert (labels[0, 0, -4096:] == nearest).float().mean() > 0.99
    assert torch.isfinite(centroids).all()
