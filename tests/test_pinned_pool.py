"""The KV pool's host memory: pinned in place at its exact size, readable by GPU kernels."""

import gc

import pytest
import torch

from kvpolicy.kernels import dispatch
from kvpolicy.store import pinned_empty

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning host memory needs CUDA")


def test_pinned_empty_is_pinned_exact_and_gatherable():
    shape = (2, 3, 1000, 64)
    pool = pinned_empty(shape, torch.bfloat16)
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_pinned()
    assert pool.untyped_storage().nbytes() == 2 * 3 * 1000 * 64 * 2  # no rounding up
    pool.copy_(torch.randn(shape, dtype=torch.bfloat16))
    slots = torch.randint(0, 1000, (2, 3, 128), device="cuda")
    gather = dispatch.get("gather_rows", "triton", torch.device("cuda"))
    reference = dispatch.get("gather_rows", "reference", torch.device("cpu"))
    got = gather(pool, slots, torch.device("cuda"))
    expected = reference(pool, slots.cpu(), torch.device("cpu"))
    assert torch.equal(got.cpu(), expected)
    del pool, got
    gc.collect()  # unregisters; a second allocation must pin again without error
    assert pinned_empty(shape, torch.float16).is_pinned()
