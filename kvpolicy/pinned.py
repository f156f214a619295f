"""Page-locked host memory for KV pools: exact sizes, page-aligned, recycled while registered.

``torch.empty(pin_memory=True)`` rounds every request up to a power of two (its caching host
allocator does, to reuse blocks): a 1.07 GB layer pool takes 2 GB, and the pools of 36 layers
at 4 x 128K asked for 154 GB of a 128 GB host. So a pool is an anonymous mapping of its exact
size, pinned in place with ``cudaHostRegister`` and read by GPU kernels through its pointer.
Each pool has its own mapping, page-aligned: registration pins whole pages, and with heap
memory two pools could share a page that unregistering one then unpinned under the other
(seen on the H200: a replayed decode read stale rows after an earlier pool was freed).

Registering is slow (the pages are locked one by one): on the H200 it was most of the 175 ms
that louiskv's prefill added to a 2K prompt's time to first token, 72 pools of 36 layers. So a
freed pool's mapping stays registered in a free list, and the next prompt's pools of the same
size or a little smaller take it back without registering again. The free list keeps at most
``keep_bytes()`` (a quarter of the host's memory unless ``KVPOLICY_PINNED_KEEP_GB`` says
otherwise); ``release_unused()`` unregisters and frees all of it.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref

import numpy as np
import torch

from .errors import KVPolicyError

# a kept mapping is reused for a request of at least this share of its size (not much waste)
REUSE_MIN_SHARE = 0.5


# Pools in 2 MB transparent huge pages where the host allows them (THP mode "madvise" or "always"): a
# private anonymous mapping, 2 MB-aligned, advised before cudaHostRegister faults it in. Python's
# mmap(-1, n) is a shared mapping, i.e. shmem, which THP's madvise mode leaves in 4 KB pages. Huge pages
# speed up single-row reads (BENCHMARKS.md, session 19, H200: 1Mx4 20.4 -> 23.7 GB/s, rows from a 128K
# span 35.0 -> 38.6-44.5). Pools under HUGE_POOL_BYTES (a small model's) keep 4 KB pages, not a
# whole 2 MB each. False: the shared 4 KB-page mapping of sessions 9-18 for every pool.
HUGE_PAGES = True
HUGE_POOL_BYTES = 32 << 20
_HUGE_PAGE = 2 << 20


class _Mapping:
    """One registered anonymous mapping: ``size`` bytes at ``pointer`` (``offset`` into ``buffer``)."""

    def __init__(self, nbytes: int):
        wanted = max(nbytes, 1)
        if HUGE_PAGES and wanted >= HUGE_POOL_BYTES:
            self.size = -(-wanted // _HUGE_PAGE) * _HUGE_PAGE
            self.buffer = mmap.mmap(-1, self.size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            _advise_huge_pages(self.buffer)
            self.offset = -np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data % _HUGE_PAGE
        else:
            self.buffer = mmap.mmap(-1, wanted)
            self.size = len(self.buffer)
            self.offset = 0
        self.pointer = np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data + self.offset
        status = _register(self.pointer, self.size)
        if status != 0:
            self.buffer.close()
            raise KVPolicyError(f"could not pin {nbytes} bytes of host memory for the KV pool "
                                f"(cudaHostRegister: error {status})")

    def release(self) -> None:
        _unregister(self.pointer)
        self.buffer.close()


_free: list[_Mapping] = []


def _advise_huge_pages(buffer: mmap.mmap) -> None:
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the pool keeps the host's default pages
        buffer.madvise(mmap.MADV_HUGEPAGE)


def _register(pointer: int, size: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(pointer, size, 0))


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def keep_bytes() -> int:
    """The most bytes of freed pools kept registered for reuse."""
    configured = os.environ.get("KVPOLICY_PINNED_KEEP_GB")
    if configured is not None:
        try:
            return int(float(configured) * (1 << 30))
        except ValueError:
            raise KVPolicyError(f"KVPOLICY_PINNED_KEEP_GB must be a number of GiB, got {configured!r}") from None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def kept_bytes() -> int:
    """Bytes of freed pools held registered right now."""
    return sum(m.size for m in _free)


def release_unused() -> None:
    """Unregister and free every kept mapping."""
    while _free:
        _free.pop().release()


def _take(nbytes: int) -> _Mapping:
    fitting = [m for m in _free if nbytes <= m.size and nbytes >= REUSE_MIN_SHARE * m.size]
    if fitting:
        best = min(fitting, key=lambda m: m.size)
        _free.remove(best)
        return best
    return _Mapping(nbytes)


def _give_back(mapping: _Mapping) -> None:
    _free.append(mapping)
    limit = keep_bytes()
    while _free and kept_bytes() > limit:  # the oldest kept mappings go first
        _free.pop(0).release()


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised pinned host tensor of exactly ``shape`` (contents are whatever a reused
    mapping held); its mapping returns to the free list when the last view of it is freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = _take(nbytes)
    backing = np.frombuffer(mapping.buffer, dtype=np.uint8, count=mapping.size, offset=mapping.offset)
    # the tensor keeps ``backing`` alive; when it goes, the mapping is kept or released
    weakref.finalize(backing, _give_back, mapping)
    return torch.from_numpy(backing)[:nbytes].view(dtype).view(shape)
