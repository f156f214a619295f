"""Triton ``unit_stats`` against the reference: a prompt's unit key sums, minima and maxima.

Random groupings (K-means-like labels of uneven sizes, empty units, a dead unit of invalid
tokens, a unit longer than a block of loaded tokens) on fresh random keys; the statistics must
match the reference bit for bit (the sums add each unit's tokens in the same order). Then a whole
``UnitTable.from_prompt`` through each backend.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels import dispatch, reference
from kvpolicy.units.table import UnitTable

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32).cpu()


def _grouping(batch, heads, n, units, gen):
    # skewed labels: some units big (longer than one 16-token block), some empty
    weights = torch.rand(units, generator=gen) ** 4
    weights[: units // 5] = 0
    labels = torch.multinomial(weights, batch * heads * n, replacement=True, generator=gen).view(batch, heads, n)
    order = torch.sort(labels, dim=-1, stable=True).indices
    size = torch.zeros(batch, heads, units, dtype=torch.long).scatter_add_(2, labels, torch.ones_like(labels))
    start = torch.cumsum(size, dim=-1) - size
    return labels, order, start, size


@pytest.mark.parametrize("batch,heads,n,units,dim,dtype", [
    (1, 1, 50, 7, 16, torch.float32),
    (2, 3, 200, 23, 64, torch.bfloat16),
    (1, 2, 300, 5, 48, torch.float16),  # a non-power-of-two head dim; units of ~60 tokens
])
def test_triton_unit_stats_match_the_reference_bit_for_bit(batch, heads, n, units, dim, dtype):
    gen = torch.Generator().manual_seed(n + units)
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    labels, order, start, size = _grouping(batch, heads, n, units, gen)
    assert int(size.max()) > 16 and int((size == 0).sum()) > 0  # the cases the kernel must get right
    expected = reference.unit_stats(keys, labels, order, start, size)
    got = dispatch.get("unit_stats", "triton", DEVICE)(*(t.to(DEVICE) for t in (keys, labels, order, start, size)))
    for name, want, have in zip(("sum", "min", "max"), expected, got):
        assert have.dtype == torch.float32 and have.shape == want.shape, name
        assert torch.equal(_bits(have), _bits(want)), name


def test_a_prompt_table_is_the_same_through_either_backend():
    gen = torch.Generator().manual_seed(5)
    batch, heads, n, dim, units = 2, 2, 120, 32, 9
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, units, (batch, heads, n), generator=gen)
    valid = torch.ones(batch, n, dtype=torch.bool)
    valid[1, :37] = False  # padding and sink go to the dead unit
    slots = torch.arange(n)
    ref = UnitTable.from_prompt(keys, slots, valid, labels, units)
    fast = UnitTable.from_prompt(keys.to(DEVICE), slots.to(DEVICE), valid.to(DEVICE), labels.to(DEVICE), units,
                                 "triton")
    for field in ("key_sum", "key_min", "key_max"):
        assert torch.equal(_bits(getattr(fast, field)), _bits(getattr(ref, field))), field
    assert torch.equal(fast.key_mean.cpu(), ref.key_mean)
    assert torch.equal(fast.size.cpu(), ref.size) and torch.equal(fast.selectable.cpu(), ref.selectable)


@pytest.mark.skipif(not CUDA, reason="a prefill-sized grouping is a GPU test")
def test_triton_unit_stats_at_prefill_size_match_the_cpu_reference():
    # 8K tokens of 8 KV heads in ~16-token clusters, as louiskv's K-means groups a prompt
    gen = torch.Generator().manual_seed(8192)
    keys = torch.randn(1, 8, 8192, 128, generator=gen).to(torch.bfloat16)
    labels, order, start, size = _grouping(1, 8, 8192, 513, gen)
    expected = reference.unit_stats(keys, labels, order, start, size)
    got = dispatch.get("unit_stats", "triton", DEVICE)(*(t.to(DEVICE) for t in (keys, labels, order, start, size)))
    for name, want, have in zip(("sum", "min", "max"), expected, got):
        assert torch.equal(_bits(have), _bits(want)), name


def test_triton_unit_stats_refuse_an_order_that_does_not_fit_the_keys():
    keys = torch.zeros(1, 2, 10, 8, device=DEVICE)
    labels = torch.zeros(1, 2, 10, dtype=torch.long, device=DEVICE)
    start = torch.zeros(1, 2, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"triton unit_stats: order \(1, 2, 9\), start \(1, 2, 3\)"):
        dispatch.get("unit_stats", "triton", DEVICE)(keys, labels, labels[..., :9], start, start)
