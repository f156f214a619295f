"""Freed pinned pools stay registered for the next prompt (registration is the slow part)."""

import gc

import pytest
import torch

from kvpolicy import pinned
from kvpolicy.errors import KVPolicyError


@pytest.fixture
def fake_cuda(monkeypatch):
    """Count registrations instead of calling CUDA (the recycling logic is host-side)."""
    calls = {"register": [], "unregister": []}
    monkeypatch.setattr(pinned, "_register", lambda pointer, size: calls["register"].append((pointer, size)) or 0)
    monkeypatch.setattr(pinned, "_unregister", lambda pointer: calls["unregister"].append(pointer))
    monkeypatch.setattr(pinned, "_free", [])
    monkeypatch.setenv("KVPOLICY_PINNED_KEEP_GB", "1")
    return calls


def test_a_freed_pool_is_reused_without_registering_again(fake_cuda):
    pool = pinned.pinned_empty((2, 4, 1000, 64), torch.bfloat16)
    pool.fill_(3)
    pointer = pool.data_ptr()
    assert pointer % 4096 == 0
    del pool
    gc.collect()
    assert pinned.kept_bytes() == 2 * 4 * 1000 * 64 * 2
    again = pinned.pinned_empty((2, 4, 1000, 64), torch.float16)  # same bytes, other dtype
    assert again.data_ptr() == pointer and again.dtype == torch.float16
    assert len(fake_cuda["register"]) == 1 and fake_cuda["unregister"] == []
    assert pinned.kept_bytes() == 0


def test_a_much_smaller_pool_gets_its_own_mapping(fake_cuda):
    big = pinned.pinned_empty((1, 1, 100_000, 64), torch.bfloat16)
    del big
    gc.collect()
    small = pinned.pinned_empty((1, 1, 1000, 64), torch.bfloat16)
    assert small.untyped_storage().nbytes() == 1000 * 64 * 2  # not handed the 12.8 MB mapping
    assert len(fake_cuda["register"]) == 2
    pinned.release_unused()
    assert len(fake_cuda["unregister"]) == 1 and pinned.kept_bytes() == 0


def test_the_free_list_stays_under_its_limit(fake_cuda, monkeypatch):
    monkeypatch.setenv("KVPOLICY_PINNED_KEEP_GB", str(3 * 1_000_000 / (1 << 30)))  # room for 3 of 1 MB
    pools = [pinned.pinned_empty((1_000_000,), torch.uint8) for _ in range(5)]
    del pools
    gc.collect()
    assert pinned.kept_bytes() == 3 * 1_000_000
    assert len(fake_cuda["unregister"]) == 2


def test_bad_keep_setting_is_named(fake_cuda, monkeypatch):
    monkeypatch.setenv("KVPOLICY_PINNED_KEEP_GB", "lots")
    with pytest.raises(KVPolicyError, match="KVPOLICY_PINNED_KEEP_GB"):
        pinned.keep_bytes()


def test_a_failed_registration_is_an_error(monkeypatch):
    monkeypatch.setattr(pinned, "_register", lambda pointer, size: 2)
    monkeypatch.setattr(pinned, "_free", [])
    with pytest.raises(KVPolicyError, match="could not pin"):
        pinned.pinned_empty((10,), torch.float32)


def test_a_large_pool_is_a_private_huge_page_aligned_mapping(fake_cuda, monkeypatch):
    # THP's madvise mode gives huge pages to private anonymous mappings only (a shared one is shmem)
    advised = []
    monkeypatch.setattr(pinned, "_advise_huge_pages", advised.append)
    nbytes = pinned.HUGE_POOL_BYTES + 1000
    pool = pinned.pinned_empty((nbytes,), torch.uint8)
    pool[-1] = 7  # the whole request is addressable
    (pointer, size), = fake_cuda["register"]
    assert pointer == pool.data_ptr() and pointer % (2 << 20) == 0
    assert size == -(-nbytes // (2 << 20)) * (2 << 20)  # whole huge pages registered
    assert len(advised) == 1 and len(advised[0]) == size + (2 << 20)  # advised before registering
    del pool
    gc.collect()
    assert pinned.kept_bytes() == size
    again = pinned.pinned_empty((nbytes - 5000,), torch.uint8)
    assert again.data_ptr() == pointer and len(fake_cuda["register"]) == 1


def test_huge_pages_off_or_a_small_pool_keeps_4k_pages(fake_cuda, monkeypatch):
    small = pinned.pinned_empty((1000,), torch.uint8)
    assert fake_cuda["register"][0][1] == 1000  # its exact size, not a 2 MB page
    monkeypatch.setattr(pinned, "HUGE_PAGES", False)
    large = pinned.pinned_empty((pinned.HUGE_POOL_BYTES + 1000,), torch.uint8)
    assert fake_cuda["register"][1][1] == pinned.HUGE_POOL_BYTES + 1000
    del small, large
