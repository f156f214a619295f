"""The PyTorch reference kernels against plain dense computations, on fresh random inputs."""

import pytest
import torch

from kvpolicy.kernels import dispatch, reference
from kvpolicy.errors import BackendUnavailableError, ConfigError


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_decode_attention_matches_sdpa_over_the_union(group, dtype):
    torch.manual_seed(0)
    batch, kv_heads, dim = 2, 2, 16
    sizes = [4, 37, 9]
    parts, keys, values, masks = [], [], [], []
    for n in sizes:
        k = torch.randn(batch, kv_heads, n, dim, dtype=dtype)
        v = torch.randn(batch, kv_heads, n, dim, dtype=dtype)
        valid = torch.rand(batch, kv_heads, n) > 0.3
        valid[..., 0] = True
        parts.append((k, v, valid))
        keys.append(k), values.append(v), masks.append(valid)
    query = torch.randn(batch, kv_heads * group, dim, dtype=dtype)
    out = reference.sparse_decode_attention(query, parts, dim**-0.5)

    k = torch.cat(keys, 2).float().repeat_interleave(group, 1)
    v = torch.cat(values, 2).float().repeat_interleave(group, 1)
    mask = torch.cat(masks, 2).repeat_interleave(group, 1)[:, :, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(query.float()[:, :, None], k, v, attn_mask=mask)[:, :, 0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert out.dtype == dtype


def test_sparse_decode_attention_accepts_per_sequence_masks():
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    q = torch.randn(1, 4, 8)
    per_seq = torch.tensor([[True, False, True, True, False]])
    a = reference.sparse_decode_attention(q, [(k, v, per_seq)], 0.3)
    b = reference.sparse_decode_attention(q, [(k, v, per_seq[:, None, :].expand(1, 2, 5))], 0.3)
    torch.testing.assert_close(a, b)


def test_kmeans_recovers_separated_clusters_and_ignores_invalid_tokens():
    torch.manual_seed(2)
    centers = torch.tensor([[10.0, 0.0], [0.0, 10.0], [-10.0, -10.0]])
    truth = torch.arange(60) % 3
    keys = (centers[truth] + 0.1 * torch.randn(60, 2)).view(1, 1, 60, 2)
    valid = torch.ones(1, 60, dtype=torch.bool)
    valid[0, :3] = False
    keys[0, 0, :3] = 1000.0  # garbage in invalid tokens must not move centroids
    labels, centroids = reference.kmeans(keys, valid, 3, iters=10)
    found = sorted(centroids[0, 0].round().tolist())
    assert found == sorted(centers.tolist())
    # tokens of one true cluster share a label
    for c in range(3):
        members = labels[0, 0, 3:][truth[3:] == c]
        assert (members == members[0]).all()


def test_gather_rows_returns_the_requested_rows():
    torch.manual_seed(3)
    pool = torch.randn(2, 3, 50, 8)
    slots = torch.randint(0, 50, (2, 3, 11))
    out = reference.gather_rows(pool, slots, torch.device("cpu"))
    for b in range(2):
        for h in range(3):
            assert torch.equal(out[b, h], pool[b, h, slots[b, h]])


def test_dispatch_reference_always_available_and_errors_are_clear(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton on a plain CPU cannot run
    cpu = torch.device("cpu")
    assert dispatch.get("kmeans", "reference", cpu) is reference.kmeans
    assert dispatch.get("kmeans", "auto", cpu) is not None
    with pytest.raises(BackendUnavailableError, match="triton"):
        dispatch.check("triton", cpu)
    with pytest.raises(ConfigError, match="accepted: auto, reference, triton"):
        dispatch.check("cuda-magic", cpu)


def test_no_ops_binds_the_reference():
    # the structures' ops=None (UnitTable.from_prompt, lay_out_zone, AnalyticIndex) mean the reference
    ops = dispatch.as_ops(None, torch.device("cpu"))
    assert ops.backend == "reference" and ops.unit_stats is reference.unit_stats
    assert dispatch.as_ops(ops, torch.device("cpu")) is ops
