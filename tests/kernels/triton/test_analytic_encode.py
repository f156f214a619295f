"""Triton ``analytic_encode`` (a prompt's keys into ParisKV's fresh index) against the reference, fresh
random inputs; then a whole ``AnalyticIndex.from_prompt`` through each backend.

The tolerance is ``analytic_append``'s (tests/kernels/triton/test_analytic_ops.py): the kernel's
rotation sums in another order (~1e-7), so a centroid bit or a code may differ only where the rotated
coordinate is within 1e-5 of 0 or of a magnitude threshold; weight and norm to float rounding.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy import analytic
from kvpolicy.kernels import dispatch, reference_analytic
from kvpolicy.units.analytic_index import AnalyticIndex

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack((codes & 15, codes >> 4), -1).flatten(-2)


def _bits(ids: torch.Tensor, dims: int) -> torch.Tensor:
    return ((ids[..., None].long() >> torch.arange(dims)) & 1).flatten(-2)


def _assert_encoded_like_reference(got, want, keys, signs, subspaces) -> tuple[int, int]:
    """``got``, ``want``: (centroids, codes, weight, norms) of the keys' positions, on the CPU.
    Returns the centroid bits and code nibbles that differ (all near a threshold)."""
    dim = keys.shape[-1]
    rotated = analytic.rotate(keys, signs)
    thresholds = analytic._thresholds(dim, torch.device("cpu"))
    near = (rotated.abs() < 1e-5) | ((rotated.abs()[..., None] - thresholds).abs() < 1e-5).any(-1)
    codes_differ = _nibbles(got[1]) != _nibbles(want[1])
    assert not (codes_differ & ~near).any()
    dims = dim // subspaces
    bits_differ = _bits(got[0], dims) != _bits(want[0], dims)
    assert not (bits_differ & ~near).any()
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=0)
    # weight = 1 / <rotated, dequantized code>: a token with a flipped code has the weight of its
    # own code (0.6% apart on the H200 at 8K), every other token the reference's
    flipped = codes_differ.any(-1)
    torch.testing.assert_close(got[2][~flipped], want[2][~flipped], rtol=1e-5, atol=0)
    alignment = (rotated * analytic.dequantize(got[1])).sum(-1)
    own = torch.where(alignment > 0, 1 / alignment.clamp(min=1e-30), 0.0)
    torch.testing.assert_close(got[2][flipped], own[flipped], rtol=1e-5, atol=0)
    return int(bits_differ.sum()), int(codes_differ.sum())


def _index_tensors(gen, batch, heads, capacity, dim, subspaces):
    # random contents: positions past the prompt must keep them
    return [
        torch.randint(0, 1 << (dim // subspaces), (batch, heads, capacity, subspaces), generator=gen,
                      dtype=torch.uint8),
        torch.randint(0, 256, (batch, heads, capacity, dim // 2), generator=gen, dtype=torch.uint8),
        torch.rand(batch, heads, capacity, generator=gen),
        torch.rand(batch, heads, capacity, generator=gen),
    ]


@pytest.mark.parametrize(
    "batch, heads, n, dim, subspaces",
    [
        (2, 3, 37, 128, 16),  # ParisKV's: the rotation's factors 8 x 16; a partial last block of tokens
        (1, 2, 50, 64, 8),  # factors 8 x 8
        (2, 2, 21, 128, 32),  # not the default subspaces: 4-dim ones
        (1, 3, 5, 64, 16),  # fewer tokens than a program's block
        (2, 1, 19, 16, 2),  # a subspace (8 dims) wider than the rotation's low factor (4 x 4)
        (1, 2, 9, 2, 1),  # the smallest head_dim: factors 1 x 2
    ],
)
def test_analytic_encode_matches_reference(batch, heads, n, dim, subspaces):
    gen = torch.Generator().manual_seed(n * dim + subspaces)
    capacity = n + 11
    signs = analytic.srht_signs(dim, n)
    # a strided view, as a zone sliced from the prompt's keys, in the model's dtype
    whole = torch.randn(batch, heads, n + 4, dim, generator=gen).to(torch.bfloat16)
    keys = whole[:, :, 3:3 + n]
    keys[0, 0, 1] = 0  # a padding row of zeros: weight 0, norm 0
    want = _index_tensors(gen, batch, heads, capacity, dim, subspaces)
    got = [t.clone().to(DEVICE) for t in want]
    reference_analytic.analytic_encode(keys, signs, subspaces, *want)
    dispatch.get("analytic_encode", "triton", DEVICE)(
        whole.to(DEVICE)[:, :, 3:3 + n], signs.to(DEVICE), subspaces, *got)
    got = [t.cpu() for t in got]
    for g, w in zip(got, want):  # past the prompt: untouched
        assert torch.equal(g[:, :, n:], w[:, :, n:])
    _assert_encoded_like_reference([t[:, :, :n] for t in got], [t[:, :, :n] for t in want], keys, signs, subspaces)
    assert got[2][0, 0, 1] == 0 and got[3][0, 0, 1] == 0
    assert (want[2][:, :, :n] > 0).sum() == batch * heads * n - 1  # every other key was weighted


def test_prompt_and_decode_encode_a_key_alike():
    # one helper encodes both: a key the decode step appends gets the prompt's bits exactly
    from kvpolicy.kernels.triton import analytic_append, analytic_encode

    gen = torch.Generator().manual_seed(7)
    batch, heads, n, dim, subspaces = 2, 2, 6, 64, 8
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(DEVICE)
    signs = analytic.srht_signs(dim, 2, DEVICE)
    prompt = [t.to(DEVICE) for t in _index_tensors(gen, batch, heads, n, dim, subspaces)]
    analytic_encode.analytic_encode(keys, signs, subspaces, *prompt)
    decode = [t.to(DEVICE) for t in _index_tensors(gen, batch, heads, n, dim, subspaces)]
    token_valid = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    slots = torch.zeros(n, dtype=torch.long, device=DEVICE)
    next_position, indexed = torch.tensor(0, device=DEVICE), torch.tensor(0, device=DEVICE)
    for i in range(n):
        analytic_append.analytic_append(*decode, token_valid, slots, next_position, indexed, signs, subspaces, n,
                                        keys[:, :, i], torch.ones(batch, dtype=torch.bool, device=DEVICE),
                                        torch.tensor(i, device=DEVICE))
    for p, d in zip(prompt, decode):
        assert torch.equal(p.view(torch.uint8), d.view(torch.uint8))  # bit for bit, floats too


def test_analytic_encode_refuses_misshaped_inputs():
    encode = dispatch.get("analytic_encode", "triton", DEVICE)
    gen = torch.Generator().manual_seed(1)
    signs = analytic.srht_signs(32, 0, DEVICE)
    keys = torch.randn(1, 2, 10, 32, generator=gen).to(DEVICE)
    tensors = [t.to(DEVICE) for t in _index_tensors(gen, 1, 2, 9, 32, 4)]  # capacity 9 < 10 tokens
    with pytest.raises(ValueError, match=r"codes \(1, 2, 9, 16\).*do not fit \(B, H, capacity >= n\)"):
        encode(keys, signs, 4, *tensors)
    tensors = [t.to(DEVICE) for t in _index_tensors(gen, 1, 2, 12, 32, 4)]
    with pytest.raises(ValueError, match=r"centroids \(1, 2, 12, 4\).*with 8 subspaces"):
        encode(keys, signs, 8, *tensors)
    with pytest.raises(ValueError, match=r"keys \(2, 10, 32\) must be \(B, H, n, D\)"):
        encode(keys[0], signs, 4, *tensors)
    with pytest.raises(ValueError, match=r"weight torch.float64 .* float32"):
        encode(keys, signs, 4, *tensors[:2], tensors[2].double(), tensors[3])


def _prompt(seed, batch, heads, n, dim):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(torch.bfloat16)
    retrievable = torch.ones(batch, n, dtype=torch.bool)
    retrievable[1, :7] = False  # left padding of the second sequence
    keys[1, :, :7] = 0  # padding's keys
    retrievable[:, :2] = False  # sink tokens
    return keys, retrievable


@pytest.mark.parametrize("dim, subspaces", [(128, 16), (64, 8), (64, 16)])
def test_a_prompt_index_is_the_same_through_either_backend(dim, subspaces):
    batch, heads, n = 2, 2, 30
    keys, retrievable = _prompt(dim + subspaces, batch, heads, n, dim)
    signs = analytic.srht_signs(dim, 3)
    ref = AnalyticIndex.from_prompt(keys, retrievable, signs, subspaces, 8)
    fast = AnalyticIndex.from_prompt(keys.to(DEVICE), retrievable.to(DEVICE), signs.to(DEVICE), subspaces, 8, "triton")
    # the reference path still encodes as encode_keys does
    encoded = analytic.encode_keys(keys, signs, subspaces)
    for field, want in zip(("centroids", "codes", "weight", "norms"), encoded):
        assert torch.equal(getattr(ref, field)[:, :, :n], want), field
    fields = ("centroids", "codes", "weight", "norms")
    got = [getattr(fast, f).cpu() for f in fields]
    expected = [getattr(ref, f) for f in fields]
    assert fast.capacity == ref.capacity > n
    for g, w in zip(got, expected):  # the spare room: zeros
        assert torch.equal(g[:, :, n:], w[:, :, n:]) and not w[:, :, n:].any()
    _assert_encoded_like_reference([t[:, :, :n] for t in got], [t[:, :, :n] for t in expected], keys, signs,
                                   subspaces)
    assert torch.equal(fast.token_valid.cpu(), ref.token_valid) and torch.equal(fast.slots.cpu(), ref.slots)
    assert fast.slots[:n].tolist() == list(range(n)) and not fast.slots[n:].any()
    assert [int(fast.next_position), int(fast.indexed)] == [int(ref.next_position), int(ref.indexed)] == [n, n]
    assert (fast.length, fast.num_prompt_units) == (ref.length, ref.num_prompt_units) == (n, n)
    # weight and norms stay interleaved in one buffer (the rerank reads them from one sector)
    assert fast.weight.stride(-1) == 2 and fast.norms.data_ptr() == fast.weight.data_ptr() + 4


def test_the_builder_encodes_the_prompt_through_the_layer_ops(monkeypatch):
    from kvpolicy.units import Analytic

    keys, retrievable = _prompt(4, 2, 2, 12, 32)
    ops = dispatch.bind("triton", DEVICE)
    calls = []
    encode = ops.analytic_encode
    monkeypatch.setattr(ops, "analytic_encode", lambda *args: calls.append(args[0].shape) or encode(*args))
    index = Analytic(subspaces=4, update_buffer=8).build_index(keys.to(DEVICE), retrievable.to(DEVICE), ops, 3)
    assert calls == [keys.shape]
    ref = AnalyticIndex.from_prompt(keys, retrievable, analytic.srht_signs(32, 3), 4, 8)  # layer 3's signs
    fields = ("centroids", "codes", "weight", "norms")
    _assert_encoded_like_reference([getattr(index, f).cpu()[:, :, :12] for f in fields],
                                   [getattr(ref, f)[:, :, :12] for f in fields], keys, ref.signs, 4)


def test_an_empty_zone_builds_an_empty_index_through_triton():
    keys = torch.zeros(1, 2, 0, 32, device=DEVICE)
    index = AnalyticIndex.from_prompt(keys, torch.ones(1, 0, dtype=torch.bool, device=DEVICE),
                                      analytic.srht_signs(32, 0, DEVICE), 4, 8, "triton")
    assert index.capacity == 256 and int(index.next_position) == 0
    assert not index.codes.any() and not index.weight.any() and not index.token_valid.any()


@pytest.mark.skipif(not CUDA, reason="a prefill-sized prompt is a GPU test")
def test_triton_analytic_encode_at_prefill_size_matches_the_cpu_reference():
    # an 8K prompt of 8 KV heads at head_dim 128 (ParisKV's), in the model's dtype
    batch, heads, n, dim, subspaces = 1, 8, 8192, 128, 16
    gen = torch.Generator().manual_seed(8192)
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(torch.bfloat16)
    signs = analytic.srht_signs(dim, 0)
    capacity = n + 2048
    want = [torch.zeros(batch, heads, capacity, subspaces, dtype=torch.uint8),
            torch.zeros(batch, heads, capacity, dim // 2, dtype=torch.uint8),
            torch.zeros(batch, heads, capacity), torch.zeros(batch, heads, capacity)]
    got = [t.to(DEVICE) for t in want]
    reference_analytic.analytic_encode(keys, signs, subspaces, *want)
    dispatch.get("analytic_encode", "triton", DEVICE)(keys.to(DEVICE), signs.to(DEVICE), subspaces, *got)
    got = [t.cpu() for t in got]
    for g in got:
        assert not g[:, :, n:].any()
    bits, codes = _assert_encoded_like_reference([t[:, :, :n] for t in got], [t[:, :, :n] for t in want], keys,
                                                 signs, subspaces)
    # near-threshold disagreements are rare: well under 1e-4 of the 8M centroid bits and codes
    assert bits + codes < batch * heads * n * dim // 10_000
