"""The KV pool's host memory: pinned in place at its exact size, readable by GPU kernels."""

import gc

import pytest
import torch

from kvpolicy.kernels import dispatch
from kvpolicy.pinned import pinned_empty, release_unused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning host memory needs CUDA")


def test_pinned_empty_is_pinned_exact_and_gatherable():
    release_unused()  # a fresh mapping, not a kept one
    shape = (2, 3, 1000, 64)
    pool = pinned_empty(shape, torch.bfloat16)
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_pinned()
    assert pool.untyped_storage().nbytes() == 2 * 3 * 1000 * 64 * 2  # no rounding up
    assert pool.data_ptr() % 4096 == 0  # whole pages: no other allocation shares them
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


def test_freeing_one_pool_leaves_the_others_readable():
    gather = dispatch.get("gather_rows", "triton", torch.device("cuda"))
    pools = [pinned_empty((1, 2, 300, 16), torch.bfloat16) for _ in range(6)]
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, dtype=torch.bfloat16))
    slots = torch.randint(0, 300, (1, 2, 64), device="cuda")
    del pools[::2]  # free every other pool: each is unregistered on the way out
    gc.collect()
    for pool in pools:
        got = gather(pool, slots, torch.device("cuda"))
        assert torch.equal(got.cpu(), pool.gather(2, slots.cpu().unsqueeze(-1).expand(-1, -1, -1, 16)))
