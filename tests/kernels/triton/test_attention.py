"""The Triton ``sparse_decode_attention`` against the PyTorch reference, on fresh random inputs.

On CPU the kernels run through Triton's interpreter (conftest turns it on), so sizes stay
tiny there; the CUDA-only cases at the end use realistic decode shapes.
"""

import pytest
import torch
import triton

from kvpolicy.kernels import dispatch, reference
from kvpolicy.kernels.triton import attention

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the small cases run on the GPU where there is one, else on CPU through the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _random_part(gen, batch, heads, n, dim, dtype, per_sequence, device=DEVICE):
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(device, dtype)
    values = torch.randn(batch, heads, n, dim, generator=gen).to(device, dtype)
    shape = (batch, n) if per_sequence else (batch, heads, n)
    valid = (torch.rand(shape, generator=gen) > 0.3).to(device)
    return keys, values, valid


def _expected(query, parts, scale):
    # the reference upcasts anyway; skipping its final rounding keeps bf16/fp16 checks about
    # the kernel, not about two roundings of the output
    upcast = [(k.float(), v.float(), m) for k, v, m in parts]
    return reference.sparse_decode_attention(query.float(), upcast, scale)


def _assert_close(out, expected, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    else:
        error = (out.float() - expected).abs().max() / expected.abs().max()
        assert error < 1e-2, f"relative error {error:.2e}"


CASES = [(dtype, dim, group) for dtype in ("float32", "bfloat16", "float16") for dim in (64, 128) for group in (1, 4, 8)]
CASES += [("float32", 256, 4), ("bfloat16", 256, 8), ("float16", 256, 1)]


@pytest.mark.parametrize("seed,dtype,dim,group", [(seed, *case) for seed, case in enumerate(CASES)])
def test_matches_reference_over_sink_retrieved_and_local_parts(seed, dtype, dim, group):
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    batch, kv_heads = 2, 2
    sink = _random_part(gen, batch, kv_heads, 4, dim, dtype, per_sequence=False)
    sink[2][..., 0] = True  # every row sees at least one token
    retrieved = _random_part(gen, batch, kv_heads, 70, dim, dtype, per_sequence=True)
    empty = _random_part(gen, batch, kv_heads, 0, dim, dtype, per_sequence=False)
    local = _random_part(gen, batch, kv_heads, 16, dim, dtype, per_sequence=False)
    parts = [sink, retrieved, empty, local]
    query = torch.randn(batch, kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
    scale = dim**-0.5

    out = attention.sparse_decode_attention(query, parts, scale)
    _assert_close(out, _expected(query, parts, scale), dtype)


def test_many_parts_and_a_query_of_another_dtype():
    gen = torch.Generator().manual_seed(50)
    batch, kv_heads, group, dim = 2, 2, 2, 64
    sizes = (3, 0, 40, 17, 0, 66, 5)
    parts = [_random_part(gen, batch, kv_heads, n, dim, torch.bfloat16, per_sequence=i % 2 == 0) for i, n in enumerate(sizes)]
    parts[0][2][..., 0] = True
    # a float32 query over bfloat16 parts: scores in float32, output in float32
    query = torch.randn(batch, kv_heads * group, dim, generator=gen).to(DEVICE)

    out = attention.sparse_decode_attention(query, parts, 0.125, split_tokens=64)
    error = (out - _expected(query, parts, 0.125)).abs().max()
    assert out.dtype == torch.float32 and error < 1e-2


@pytest.mark.parametrize("split_tokens", [64, 128, None])
def test_long_part_split_many_ways_agrees(split_tokens):
    gen = torch.Generator().manual_seed(100 + (split_tokens or 0))
    batch, kv_heads, group, dim, n = 1, 2, 4, 64, 300
    keys, values, valid = _random_part(gen, batch, kv_heads, n, dim, torch.float32, per_sequence=False)
    valid[..., 64:192] = False  # whole splits with no valid token must not poison the merge
    query = torch.randn(batch, kv_heads * group, dim, generator=gen).to(DEVICE)
    parts = [(keys, values, valid)]

    out = attention.sparse_decode_attention(query, parts, 0.125, split_tokens=split_tokens)
    _assert_close(out, _expected(query, parts, 0.125), torch.float32)


def test_split_choice_fills_the_gpu_down_to_one_tile_a_split():
    block = attention._block_n(128)
    # B=4, H=8: 32 rows of programs
    long_tiles = attention._tiles_per_split(32768, 32, block, 132, None)
    assert 32 * triton.cdiv(32768 // block, long_tiles) >= 2 * 132
    assert triton.cdiv(32768 // block, long_tiles) <= attention.MAX_SPLITS
    assert attention._tiles_per_split(64, 32, block, 132, None) == 1  # one split, one tile
    # a 2,048-token budget at B=1, H=8: a tile a split, 32 splits a row (256 programs, not 64)
    budget_tiles = attention._tiles_per_split(2048, 8, block, 132, None)
    assert budget_tiles == attention.MIN_TILES_PER_SPLIT == 1
    assert triton.cdiv(2048 // block, budget_tiles) == 32
    # forced split size, as the long-part test uses: 300 tokens in 64-token splits
    assert triton.cdiv(triton.cdiv(300, 64), attention._tiles_per_split(300, 2, 64, 132, 64)) == 5


def test_row_without_any_valid_token_gives_zeros():
    gen = torch.Generator().manual_seed(7)
    batch, kv_heads, group, dim = 2, 2, 2, 64
    parts = [_random_part(gen, batch, kv_heads, n, dim, torch.float32, per_sequence=True) for n in (4, 80, 8)]
    for _, _, valid in parts:
        valid[0] = False  # sequence 0 has nothing to attend to
        valid[1, 0] = True
    query = torch.randn(batch, kv_heads * group, dim, generator=gen).to(DEVICE)

    out = attention.sparse_decode_attention(query, parts, 0.125, split_tokens=64)
    assert not torch.isnan(out).any()
    assert (out[0] == 0).all()
    # the reference gives NaN for sequence 0, so compare only sequence 1
    expected = _expected(query[1:], [(k[1:], v[1:], m[1:]) for k, v, m in parts], 0.125)
    _assert_close(out[1:], expected, torch.float32)


def test_no_tokens_at_all_gives_zeros():
    keys = torch.zeros(1, 2, 0, 64, device=DEVICE)
    query = torch.ones(1, 4, 64, device=DEVICE)
    out = attention.sparse_decode_attention(query, [(keys, keys, torch.zeros(1, 0, dtype=torch.bool, device=DEVICE))], 1.0)
    assert out.shape == (1, 4, 64) and (out == 0).all()


def test_invalid_slots_are_never_read():
    gen = torch.Generator().manual_seed(8)
    keys, values, valid = _random_part(gen, 1, 2, 40, 64, torch.float16, per_sequence=False)
    valid[..., 0] = True
    query = torch.randn(1, 4, 64, generator=gen).to(DEVICE, torch.float16)
    expected = _expected(query, [(keys, values, valid)], 0.125)
    # uninitialised cache slots may hold anything
    keys = keys.masked_fill(~valid[..., None], float("nan"))
    values = values.masked_fill(~valid[..., None], float("inf"))

    out = attention.sparse_decode_attention(query, [(keys, values, valid)], 0.125)
    _assert_close(out, expected, torch.float16)


def test_strided_views_match_contiguous_inputs():
    gen = torch.Generator().manual_seed(9)
    batch, kv_heads, group, dim, n = 2, 2, 4, 64, 50
    # token-major storage viewed as (B, H, n, D); query a slice of a wider projection
    keys = torch.randn(batch, n, kv_heads, dim, generator=gen).to(DEVICE).transpose(1, 2)
    values = torch.randn(batch, n + 3, kv_heads, dim, generator=gen).to(DEVICE)[:, 3:].transpose(1, 2)
    valid = (torch.rand(batch, n, kv_heads, generator=gen) > 0.3).to(DEVICE).transpose(1, 2)
    query = torch.randn(batch, kv_heads * group, 2 * dim, generator=gen).to(DEVICE)[..., :dim]
    parts = [(keys, values, valid)]
    assert not keys.is_contiguous() and not query.is_contiguous()

    out = attention.sparse_decode_attention(query, parts, 0.125)
    _assert_close(out, _expected(query, parts, 0.125), torch.float32)


def test_reached_through_dispatch():
    fn = dispatch.get("sparse_decode_attention", "triton", DEVICE)
    assert fn is attention.sparse_decode_attention


def test_unsupported_head_dim_is_a_clear_error():
    keys = torch.zeros(1, 1, 4, 48)
    with pytest.raises(ValueError, match="head_dim in .*64.*128.*256"):
        attention.sparse_decode_attention(torch.zeros(1, 2, 48), [(keys, keys, torch.ones(1, 4, dtype=torch.bool))], 1.0)


# --- realistic decode shapes, on a GPU only ---------------------------------------------


def _realistic(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, q_heads, kv_heads, dim, dtype = 4, 32, 8, 128, torch.bfloat16
    parts = [_random_part(gen, batch, kv_heads, n, dim, dtype, per_sequence=i != 1, device="cuda") for i, n in enumerate(sizes)]
    parts[0][2][..., 0] = True
    query = torch.randn(batch, q_heads, dim, generator=gen).to("cuda", dtype)
    return query, parts, dim**-0.5


@cuda_only
def test_cuda_sink_retrieved_local():
    query, parts, scale = _realistic((4, 2048, 64), seed=20)
    out = attention.sparse_decode_attention(query, parts, scale)
    _assert_close(out, _expected(query, parts, scale), torch.bfloat16)


@cuda_only
def test_cuda_full_attention_over_one_long_part():
    query, parts, scale = _realistic((32768,), seed=21)
    out = attention.sparse_decode_attention(query, parts, scale)
    _assert_close(out, _expected(query, parts, scale), torch.bfloat16)


@cuda_only
def test_cuda_graph_capture_and_replay():
    query, parts, scale = _realistic((4, 2048, 64), seed=22)
    attention.sparse_decode_attention(query, parts, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.sparse_decode_attention(query, parts, scale)
    # new values in the same buffers, then replay
    fresh_query, fresh_parts, _ = _realistic((4, 2048, 64), seed=23)
    query.copy_(fresh_query)
    for (k, v, m), (fk, fv, fm) in zip(parts, fresh_parts):
        k.copy_(fk), v.copy_(fv), m.copy_(fm)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, _expected(query, parts, scale), torch.bfloat16)


# -- rows read from a GPU pool by slot (``PoolRows``): a pool-attending store's retrieved rows ----


def _pool_rows_case(gen, dtype, dim, zone, device=DEVICE):
    """One attended part (sink 3 | retrieved 40 | local 9) whose retrieved rows name pool slots, a
    pool of 120 slots laid out by ``zone`` (its first ``zone`` slots permuted per head), and the
    same part with those pool rows copied in."""
    from kvpolicy.tiers import PoolRows

    batch, heads, capacity, start, rows = 2, 2, 120, 3, 40
    keys, values, valid = _random_part(gen, batch, heads, start + rows + 9, dim, dtype, per_sequence=False)
    valid[..., 0] = True
    pool_keys = torch.randn(batch, heads, capacity, dim, generator=gen).to(device, dtype)
    pool_values = torch.randn(batch, heads, capacity, dim, generator=gen).to(device, dtype)
    slots = torch.randint(0, capacity, (batch, heads, rows), generator=gen).to(device)
    # unattended rows may name any slot at all (never read)
    slots = torch.where(valid[:, :, start:start + rows], slots, torch.full_like(slots, 10**9))
    zone_rows = torch.stack([torch.stack([torch.randperm(zone, generator=gen) for _ in range(heads)])
                             for _ in range(batch)]).to(device, torch.int32) if zone else None
    from_pool = PoolRows(pool_keys, pool_values, slots, start, zone_rows, zone)
    # the part's own rows there are garbage: only the pool's may count
    keys[:, :, start:start + rows] = float("nan")
    copied = reference.with_pool_rows(keys, values, from_pool)
    return (keys, values, valid, from_pool), (*copied, valid)


@pytest.mark.parametrize("by_pointer", [True, False], ids=["pointer-a-row", "two-loads"])
@pytest.mark.parametrize("zone", [0, 80])
@pytest.mark.parametrize("dtype,dim,group", [("bfloat16", 128, 4), ("float32", 64, 2), ("float16", 64, 8)])
def test_rows_read_from_the_pool_by_slot_match_the_rows_copied_in(zone, dtype, dim, group, by_pointer, monkeypatch):
    # fresh random inputs each run; both ways of loading the pool rows (POOL_ROWS_BY_POINTER)
    monkeypatch.setattr(attention, "POOL_ROWS_BY_POINTER", by_pointer)
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    pooled, copied = _pool_rows_case(gen, dtype, dim, zone)
    query = torch.randn(2, 2 * group, dim, generator=gen).to(DEVICE, dtype)
    scale = dim**-0.5
    out = attention.sparse_decode_attention(query, [pooled], scale)
    # the same loads and arithmetic as the part with the rows copied in: bit for bit
    assert torch.equal(out, attention.sparse_decode_attention(query, [copied], scale))
    _assert_close(out, _expected(query, [copied], scale), dtype)
    # the reference reads the pool rows too
    torch.testing.assert_close(reference.sparse_decode_attention(query, [pooled], scale),
                               reference.sparse_decode_attention(query, [copied], scale), atol=0, rtol=0)


def test_pool_rows_that_do_not_fit_their_part_are_refused():
    from kvpolicy.tiers import PoolRows

    gen = torch.Generator().manual_seed(5)
    (keys, values, valid, from_pool), _ = _pool_rows_case(gen, torch.float32, 64, 0)
    query = torch.randn(2, 4, 64, device=DEVICE)
    beyond = PoolRows(from_pool.keys, from_pool.values, from_pool.slots, keys.shape[2] - 2)
    with pytest.raises(ValueError, match=r"pool rows: rows \[50, 90\) must lie inside the part's 52 rows"):
        attention.sparse_decode_attention(query, [(keys, values, valid, beyond)], 0.1)
    other_dtype = PoolRows(from_pool.keys.half(), from_pool.values.half(), from_pool.slots, 3)
    with pytest.raises(ValueError, match="pool rows: the pool must be torch.float32"):
        attention.sparse_decode_attention(query, [(keys, values, valid, other_dtype)], 0.1)
