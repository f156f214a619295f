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


def assert_matches_reference(keys, valid, clusters, iters, *, exact=False, tol=1e-4, **options):
    """Valid tokens' labels agree (all of them if ``exact``, else >= 99% and any other is a
    near-tie), and centroids agree where every label does. ``options``: ``init``, ``precision``."""
    keys, valid = keys.to(DEVICE), valid.to(DEVICE)
    labels, centroids = triton_kmeans()(keys, valid, clusters, iters, **options)
    ref_labels, ref_centroids = reference.kmeans(keys, valid, clusters, iters, **options)
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
        _, before = reference.kmeans(keys, valid, clusters, iters - 1, **options)
        b, h, i = differ.nonzero(as_tuple=True)
        x = keys[b, h, i].double()
        if options.get("precision") == "bf16":  # distances to the rounded centroid, from the rounded key
            before, x = before.to(torch.bfloat16).float(), x.to(torch.bfloat16).double()
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


# ---- init="pages" and precision="bf16" (the cheaper prompt clustering, issue 12 item 5) ----


def page_means(keys, valid, clusters):
    """The pages' mean keys computed one page at a time, from the definition: the valid tokens
    of rank r in [j * count / C, (j + 1) * count / C) (integer division as r * C // count)."""
    batch, heads, n, dim = keys.shape
    out = torch.empty(batch, heads, clusters, dim, dtype=torch.float64)
    pages = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        positions = valid[b].nonzero().flatten().tolist()
        count = len(positions)
        members = [[] for _ in range(clusters)]
        for rank, position in enumerate(positions):
            members[rank * clusters // count].append(position)
            pages[b, position] = rank * clusters // count
        for j, rows in enumerate(members):
            if rows:
                out[b, :, j] = keys[b, :, rows].double().mean(1)
            else:  # an empty page keeps the spaced initial token
                out[b, :, j] = reference.kmeans(keys[b:b + 1], valid[b:b + 1], clusters, 0)[1][0, :, j].double()
    return pages, out


@pytest.mark.parametrize("pads,clusters", [([0, 13], 7), ([3, 0], 16), ([60, 50], 16)])
def test_pages_init_is_runs_of_consecutive_valid_tokens(pads, clusters):
    # ([60, 50], 16): 4 and 14 valid tokens for 16 clusters, so some pages are empty
    gen = torch.Generator().manual_seed(20 + clusters + pads[0])
    valid = left_padded(2, 64, pads)
    keys = torch.randn(2, 3, 64, 32, generator=gen)
    pages, means = page_means(keys, valid, clusters)
    labels = reference.kmeans_page_labels(valid, clusters)
    assert torch.equal(labels[valid], pages[valid])
    for b in range(2):
        run = labels[b][valid[b]]
        assert (run.diff() >= 0).all() and (run.diff() <= 1 + clusters // max(1, int(valid[b].sum()))).all()
        sizes = torch.bincount(run, minlength=clusters)
        count = int(valid[b].sum())
        assert sizes.max() <= -(-count // clusters)
        if count >= clusters:
            assert sizes.min() >= count // clusters
    ref_labels, ref_centroids = reference.kmeans(keys, valid, clusters, 0, init="pages")
    assert torch.equal(ref_labels[valid[:, None].expand(2, 3, 64)], pages[:, None].expand(2, 3, 64)[valid[:, None].expand(2, 3, 64)])
    torch.testing.assert_close(ref_centroids.double(), means, atol=1e-5, rtol=1e-5)
    labels_t, centroids_t = triton_kmeans()(keys.to(DEVICE), valid.to(DEVICE), clusters, 0, init="pages")
    mask = valid[:, None].expand(2, 3, 64).to(DEVICE)
    assert torch.equal(labels_t[mask], ref_labels.to(DEVICE)[mask])
    torch.testing.assert_close(centroids_t.double(), means.to(DEVICE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("iters", [1, 2])
def test_pages_init_matches_reference(dtype, iters):
    gen = torch.Generator().manual_seed(30 + iters + len(str(dtype)))
    keys = torch.randn(2, 2, 140, 64, generator=gen).to(dtype)
    valid = left_padded(2, 140, [0, 19])
    assert_matches_reference(keys, valid, 9, iters, init="pages")


def test_pages_init_on_separated_runs_labels_match_exactly():
    # a run per centre, aligned with the evenly spaced tokens: the page means sit near the centres
    gen = torch.Generator().manual_seed(31)
    valid = left_padded(2, 96, [0, 13])
    keys = clustered_keys(gen, valid, 2, 64, clusters=12)
    assert_matches_reference(keys, valid, 12, 3, init="pages", exact=True)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("init", ["spaced", "pages"])
def test_bf16_precision_matches_reference(seed, dtype, init):
    gen = torch.Generator().manual_seed(40 + seed)
    dim = (64, 40)[seed]
    keys = torch.randn(2, 2, 120, dim, generator=gen).to(dtype)
    valid = left_padded(2, 120, [0, 11 + seed])
    assert_matches_reference(keys, valid, 15, 2, init=init, precision="bf16")


def test_bf16_precision_assigns_the_nearest_rounded_centroid():
    # the reference's own contract: a label is the nearest bf16-rounded centroid of the iteration before
    gen = torch.Generator().manual_seed(41)
    keys = torch.randn(1, 2, 100, 64, generator=gen)
    valid = left_padded(1, 100, [6])
    for backend in (reference.kmeans, triton_kmeans()):
        labels, _ = backend(keys.to(DEVICE), valid.to(DEVICE), 11, 2, init="pages", precision="bf16")
        _, before = reference.kmeans(keys, valid, 11, 1, init="pages", precision="bf16")
        x = keys.to(torch.bfloat16).double()
        d = sq_dist(x[..., None, :], before.to(torch.bfloat16).double()[:, :, None])  # (B, H, n, C)
        chosen = d.gather(-1, labels.cpu()[..., None]).squeeze(-1)
        ok = (chosen - d.min(-1).values) <= 1e-4 * d.mean()
        assert ok[valid[:, None].expand(1, 2, 100)].all()


def test_bad_init_or_precision_is_refused():
    keys, valid = torch.randn(1, 1, 8, 16), torch.ones(1, 8, dtype=torch.bool)
    for backend in (reference.kmeans, triton_kmeans()):
        with pytest.raises(ValueError, match="init must be one of spaced, pages"):
            backend(keys.to(DEVICE), valid.to(DEVICE), 2, 1, init="random")
        with pytest.raises(ValueError, match="precision must be one of split, bf16"):
            backend(keys.to(DEVICE), valid.to(DEVICE), 2, 1, precision="fp8")


def test_builder_options_reach_the_op_and_are_validated():
    from kvpolicy.errors import ConfigError
    from kvpolicy.units.kmeans import KMeans

    gen = torch.Generator().manual_seed(50)
    keys = torch.randn(2, 2, 64, 32, generator=gen)
    valid = left_padded(2, 64, [0, 5])
    ops = dispatch.bind("reference", torch.device("cpu"))
    labels, units = KMeans(tokens_per_cluster=8, iters=0, init="pages").build_labels(keys, valid, ops)
    assert units == 8
    pages = reference.kmeans_page_labels(valid, 8)[:, None].expand(2, 2, 64)
    mask = valid[:, None].expand(2, 2, 64)
    assert torch.equal(labels[mask], pages[mask])
    labels, _ = KMeans(tokens_per_cluster=8, iters=2, init="pages", precision="bf16").build_labels(keys, valid, ops)
    want, _ = reference.kmeans(keys, valid, 8, 2, init="pages", precision="bf16")
    assert torch.equal(labels, want)
    labels, _ = KMeans(tokens_per_cluster=8).build_labels(keys, valid, ops)  # defaults: spaced, 8 iters, split
    assert torch.equal(labels, reference.kmeans(keys, valid, 8, 8)[0])
    for bad, match in (({"init": "random"}, "init must be one of spaced, pages"),
                       ({"precision": "fp8"}, "precision must be one of split, bf16"),
                       ({"iters": 0}, "iters must be an integer >= 1 with init='spaced'"),
                       ({"iters": -1, "init": "pages"}, "iters must be an integer >= 0")):
        with pytest.raises(ConfigError, match=match):
            KMeans(**bad).validate()


def test_precision_decides_labels_and_each_backend_honours_it():
    # many close centroids: rounding them to bf16 moves a dozen of 2048 first labels; each backend
    # must give the labels of the precision asked for, exactly (one iteration: no cascade)
    gen = torch.Generator().manual_seed(60)
    keys = torch.randn(1, 2, 1024, 16, generator=gen)
    valid = torch.ones(1, 1024, dtype=torch.bool)
    split, _ = reference.kmeans(keys, valid, 256, 1)
    rounded, _ = reference.kmeans(keys, valid, 256, 1, precision="bf16")
    assert int((split != rounded).sum()) >= 5  # the precisions differ here (the test can tell them apart)
    labels, _ = triton_kmeans()(keys.to(DEVICE), valid.to(DEVICE), 256, 1, precision="bf16")
    assert torch.equal(labels.cpu(), rounded)
    labels, _ = triton_kmeans()(keys.to(DEVICE), valid.to(DEVICE), 256, 1)
    assert torch.equal(labels.cpu(), split)


@pytest.fixture(params=[True, False], ids=["fused", "apart"])
def fused_update(request, monkeypatch):
    """The assignment adds its keys into the cluster sums itself (``FUSE_UPDATE``, the default), or
    ``_accumulate`` does after it."""
    from kvpolicy.kernels.triton import kmeans as module

    monkeypatch.setattr(module, "FUSE_UPDATE", request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_update_separated_clusters_match_exactly(fused_update, dtype):
    gen = torch.Generator().manual_seed(31)
    valid = left_padded(2, 96, [0, 13])
    keys = clustered_keys(gen, valid, 2, 64, clusters=12).to(dtype)
    assert_matches_reference(keys, valid, 12, iters=4, exact=True)


@pytest.mark.parametrize("init,precision", [("spaced", "split"), ("pages", "split"), ("spaced", "bf16")])
def test_fused_update_random_keys_agree_up_to_near_ties(fused_update, init, precision):
    gen = torch.Generator().manual_seed(32)
    keys = torch.randn(2, 3, 150, 40, generator=gen).to(torch.bfloat16)
    valid = left_padded(2, 150, [0, 22])
    assert_matches_reference(keys, valid, 20, iters=3, init=init, precision=precision)


def test_fused_update_invalid_tokens_move_no_centroid(fused_update):
    gen = torch.Generator().manual_seed(33)
    keys = torch.randn(1, 2, 64, 64, generator=gen)
    valid = left_padded(1, 64, [20])
    _, centroids = triton_kmeans()(keys.to(DEVICE), valid.to(DEVICE), 6, 2)
    poisoned = keys.clone()
    poisoned[:, :, :20] = 1e4  # the padding's keys: never added
    _, again = triton_kmeans()(poisoned.to(DEVICE), valid.to(DEVICE), 6, 2)
    torch.testing.assert_close(again, centroids)


@needs_cuda
def test_fused_update_cuda_realistic_size(fused_update):
    gen = torch.Generator().manual_seed(34)
    valid = left_padded(1, 32768, [1000])
    keys = clustered_keys(gen, valid, 8, 128, clusters=2048, spread=0.02)
    assert_matches_reference(keys.to(torch.bfloat16), valid, 2048, iters=3, exact=True)
