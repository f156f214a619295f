"""KV over GPU and host: where each layer's pool goes under placement "split".

A layer's pool (the keys and values of every slot, ``TieredStore.pool``)
goes on the attention device while the cache's pools there stay within a byte limit, and in
pinned host memory after that. The unit is a whole layer's pool: the step reads one pool per
layer, so a layer's gathers are all device reads or all PCIe reads, and the kernels need no
second pool. The first layers to prefill take the device.

The limit is the policy's ``gpu_pool_bytes``, counted over the layers of one cache, or, when it
is ``None``, what the device has free as each layer's prompt arrives (outside PyTorch's cache of
freed blocks, which the next layers' prefill activations take again), less ``auto_headroom``
(the attended buffers and retrieval index of the layers still to come, the decode's workspace,
the first layer's MLP, which runs after its pool is placed). Under a limit the device's real
free memory is still checked: a pool that would leave less than ``LIMIT_GUARD_BYTES`` goes to
the host, so a limit set too close to the brim spills rather than running out of memory. A pool grows after prefill (it doubles when the tokens fill it, or grows to
a reserve before a graph capture): a layer on the device whose grown pool would pass the limit
moves to the host first, in the step's plan (host side, before any kernel), so the limit holds
at every moment, the copy of a growth included.

On a machine without CUDA the "device" is the CPU and so is the host: the split is still made
and recorded (``PoolPlacer.layers``), so its rules are testable there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import KVPolicyError

# the least auto headroom, and its share of the device's memory when that is more
AUTO_HEADROOM_MIN = 4 << 30
AUTO_HEADROOM_SHARE = 0.10
# under a limit, a pool still never takes the device's last bytes: what the prefill allocates next
# (the layer's attended buffers, its index) would run out of memory there instead
LIMIT_GUARD_BYTES = 1 << 30


def host_available_bytes() -> int:
    """Host memory a process may still take: MemAvailable, or the cgroup's limit less its use
    where that is less (a container)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(available, 0)


def device_available_bytes(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` can take: free memory plus what PyTorch's caching
    allocator holds unused (a CUDA device); the host's available memory for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return host_available_bytes()


def device_free_bytes(device: torch.device) -> int:
    """Bytes ``device`` has free outside PyTorch's caching allocator (the host's available memory
    for the CPU). What the free-memory sizing counts: blocks the allocator keeps cached were the
    prefill's activations, and the next layers' prefill takes them again."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_headroom(device: torch.device) -> int:
    """What the free-memory sizing leaves unused on ``device``: 10% of its memory, at least 4 GiB."""
    return max(AUTO_HEADROOM_MIN, int(AUTO_HEADROOM_SHARE * device_total_bytes(device)))


def pool_bytes(batch: int, heads: int, capacity: int, dim: int, element_size: int) -> int:
    """Bytes of one layer's pool: keys and values of ``capacity`` slots."""
    return 2 * batch * heads * capacity * dim * element_size


def check_limit(limit: int | None, device: torch.device,
                available: Callable[[torch.device], int] = device_available_bytes) -> None:
    """Refuse, when the policy is applied, a ``gpu_pool_bytes`` the device cannot hold now."""
    if limit is None:
        return
    free = available(device)
    if limit > free:
        from .policy import bytes_text

        raise KVPolicyError(
            f"gpu_pool_bytes={limit} ({bytes_text(limit)}) exceeds the {free} bytes ({bytes_text(free)}) available on "
            f"{device}; accepted: an integer from 0 to {free}, or None to size it from free memory"
        )


@dataclass
class PoolPlacer:
    """The split of one cache's pools: ``place`` each layer's pool at prefill, ``grow`` before a
    pool grows. ``limit``: bytes of pool allowed on ``device``; ``None``: sized from what
    ``available(device)`` reports, less ``headroom``."""

    device: torch.device
    limit: int | None
    # default: device_free_bytes when sized from free memory, device_available_bytes under a limit
    # (there only a guard: a pool must never run the device out of memory)
    available: Callable[[torch.device], int] | None = None
    headroom: int | None = None  # default: LIMIT_GUARD_BYTES under a limit, auto_headroom(device) without one
    used: int = 0  # pool bytes on the device now, over the cache's layers
    # layer index -> True (pool on the device) / False (pinned host)
    layers: dict[int, bool] = field(default_factory=dict)
    moved_layers: list[int] = field(default_factory=list)  # device pools that moved to the host to grow

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.available is None:
            self.available = device_free_bytes if self.limit is None else device_available_bytes
        if self.headroom is None:
            self.headroom = LIMIT_GUARD_BYTES if self.limit is not None else auto_headroom(self.device)

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of pool may go on the device now."""
        if self.limit is not None and self.used + nbytes > self.limit:
            return False
        if self.device.type == "cpu" and self.limit is not None:
            return True  # the "device" is the host: the limit is the whole rule
        return self.available(self.device) - nbytes >= self.headroom

    def place(self, layer_idx: int, nbytes: int) -> torch.device:
        """Where layer ``layer_idx``'s new pool of ``nbytes`` goes (and count it)."""
        on_device = self.fits(nbytes)
        self.layers[layer_idx] = on_device
        if on_device:
            self.used += nbytes
            return self.device
        return self.host

    def settle(self, layer_idx: int, planned: int, actual: int) -> None:
        """Correct the count once the pool exists (``actual`` bytes where ``planned`` were counted)."""
        if self.layers.get(layer_idx):
            self.used += actual - planned

    def grow(self, layer_idx: int, old: int, new: int) -> bool:
        """Before a device pool of ``old`` bytes grows to ``new``: True (and counted) if it may grow
        on the device, the old pool still there while it is copied; False: it must move to the
        host first (``moved``)."""
        if not self.layers.get(layer_idx):
            return False
        if self.fits(new):
            self.used += new - old
            return True
        return False

    def moved(self, layer_idx: int, nbytes: int) -> None:
        """A device pool of ``nbytes`` moved to the host."""
        if self.layers.get(layer_idx):
            self.layers[layer_idx] = False
            self.moved_layers.append(layer_idx)
            self.used -= nbytes

    def device_layers(self) -> list[int]:
        return sorted(i for i, on in self.layers.items() if on)

    def host_layers(self) -> list[int]:
        return sorted(i for i, on in self.layers.items() if not on)
