"""Triton ``write_row`` against the reference: one token into the pool at a device counter."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels import dispatch, reference

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 48])
def test_write_row_matches_reference(dtype, dim):
    device = torch.device("cuda" if CUDA else "cpu")
    gen = torch.Generator().manual_seed(dim)
    pool = torch.randn(2, 3, 40, dim, generator=gen).to(dtype)
    want = pool.clone()
    write = dispatch.get("write_row", "triton", device)
    for slot in (0, 17, 39):
        row = torch.randn(2, 3, dim, generator=gen).to(dtype)
        counter = torch.tensor(slot)
        reference.write_row(want, counter, row)
        got = pool.to(device)
        write(got, counter.to(device), row.to(device))
        pool = got.cpu()
        assert torch.equal(pool, want)


def test_write_row_refuses_a_misshaped_row():
    device = torch.device("cuda" if CUDA else "cpu")
    write = dispatch.get("write_row", "triton", device)
    pool = torch.zeros(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match=r"row \(1, 3, 16\) does not fit pool \(1, 2, 8, 16\)"):
        write(pool, torch.tensor(0, device=device), torch.zeros(1, 3, 16, device=device))


@pytest.mark.skipif(not CUDA, reason="pinned host pool written from the GPU needs CUDA")
def test_write_row_into_pinned_host_pool():
    pool = torch.zeros(2, 8, 1024, 128, dtype=torch.bfloat16).pin_memory()
    row = torch.randn(2, 8, 128, device="cuda").to(torch.bfloat16)
    dispatch.get("write_row", "triton", torch.device("cuda"))(pool, torch.tensor(513, device="cuda"), row)
    torch.cuda.synchronize()
    assert torch.equal(pool[:, :, 513], row.cpu())
    assert pool[:, :, 512].abs().sum() == 0 and pool[:, :, 514].abs().sum() == 0
