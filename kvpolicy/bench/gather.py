"""The pool gather's bandwidth against a plain host-to-device copy of as many bytes, same run.

Two ops: ``gather`` (``gather_rows_into``, one tensor) and ``refresh`` (``refresh_rows``, what a
decode step's fetch runs: keys and values in one launch, then the copy back from its scratch;
cold, so every row crosses from the pool, unless ``resident`` of each (sequence, head)'s rows are
already in the buffer, as a re-selection that overlaps the last finds them: then only the rest
cross, and the call's time at ``resident=1`` is what a refresh costs beside its bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import dispatch
from ..pinned import pinned_empty
from .timing import time_ms, time_replay_ms


OPS = ("gather", "refresh")


@dataclass
class GatherBandwidth:
    op: str  # one of OPS
    backend: str
    pool: str  # "pinned cpu" or the device
    batch: int
    heads: int
    rows: int  # rows per (sequence, head)
    run: int  # consecutive pool rows per run (1: random single rows; a unit-ordered pool reads runs)
    row_bytes: int
    gather_gbps: float  # every row's bytes (resident ones too) over the call's time
    copy_gbps: float  # contiguous pinned host -> device copy of the same byte count
    call_ms: float = 0.0
    resident: float = 0.0  # refresh: the share of rows found in the buffer (not read from the pool)

    @property
    def ratio(self) -> float:
        return self.gather_gbps / self.copy_gbps


@torch.inference_mode()
def measure_gather(
    device: torch.device,
    *,
    backend: str = "triton",
    batch: int = 1,
    heads: int = 8,
    context: int = 131072,
    rows: int = 2048,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 30,
    run: int = 1,
    op: str = "gather",
    replay: bool = False,
    resident: float = 0.0,
) -> GatherBandwidth:
    """``op``'s bandwidth from a pool (pinned on a GPU) and a pinned copy's of as many bytes; each
    call timed as a CUDA-graph replay where ``replay`` (as a decode step runs it: timed eagerly, the
    wrapper's Python checks outlast a batch-1 call's kernel and are counted in it)."""
    if run < 1 or rows % run:
        raise ValueError(f"run must be a positive divisor of rows ({rows}), got {run}")
    if op not in OPS:
        raise ValueError(f"gather op {op!r}; accepted: {', '.join(OPS)}")
    if not 0.0 <= resident <= 1.0 or (resident and op != "refresh"):
        raise ValueError(f"resident must be a share in [0, 1], and only refresh reads resident rows; got {resident} "
                         f"for {op}")
    pinned = device.type == "cuda"
    shape = (batch, heads, context, head_dim)
    parts = 2 if op == "refresh" else 1
    pools = [_random_pool(shape, dtype, pinned) for _ in range(parts)]
    starts = torch.randint(0, context - run + 1, (batch, heads, rows // run, 1), device=device)
    slots = (starts + torch.arange(run, device=device)).view(batch, heads, rows)
    take = torch.ones(batch, dtype=torch.bool, device=device)
    outs = [torch.empty(batch, heads, rows, head_dim, dtype=dtype, device=device) for _ in range(parts)]
    nbytes = sum(out.numel() * out.element_size() for out in outs)
    timer = time_replay_ms if replay else time_ms
    if op == "gather":
        gather_into = dispatch.get("gather_rows_into", backend, device)
        gather_ms = timer(lambda: gather_into(pools[0], slots, take, outs[0]), device, repeats)
    else:
        refresh = dispatch.get("refresh_rows", backend, device)
        # the first share of each (sequence, head)'s rows are found in the buffer, at shuffled rows; the rest miss
        source = torch.full((batch, heads, rows), -1, dtype=torch.int32, device=device)
        found = round(rows * resident)
        if found:
            source[:, :, :found] = torch.randperm(rows, device=device)[:found].to(torch.int32)
        scratches = [torch.empty_like(out) for out in outs]
        gather_ms = timer(lambda: refresh(pools, slots, take, source, outs, scratches), device, repeats)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy_ms = timer(lambda: target.copy_(host, non_blocking=True), device, repeats)
    return GatherBandwidth(
        op=op, backend=backend, pool="pinned cpu" if pinned else str(device), batch=batch, heads=heads, rows=rows, run=run,
        row_bytes=head_dim * outs[0].element_size(), gather_gbps=nbytes / gather_ms / 1e6, copy_gbps=nbytes / copy_ms / 1e6,
        call_ms=gather_ms, resident=resident,
    )


def _random_pool(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    pool = pinned_empty(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
    # random contents without drawing 2 GB of random numbers on the host: repeat one block
    block = torch.randn(1 << 16, dtype=dtype)
    flat = pool.view(-1)
    whole = flat.numel() // block.numel() * block.numel()
    flat[:whole].view(-1, block.numel()).copy_(block.expand(whole // block.numel(), -1))
    flat[whole:].normal_()
    return pool


@dataclass
class PinnedAllocation:
    bytes: int
    first_ms: float  # a fresh pinned allocation (page-locking)
    again_ms: float  # the same size after freeing it (torch's caching host allocator)
    copy_ms: float  # a device-to-pinned-host copy of as many bytes


def measure_pinned_allocation(device: torch.device, nbytes: int = 64 << 20) -> PinnedAllocation:
    """What laying a prompt's KV into pinned memory costs: allocation, re-allocation, copy."""
    import time

    def alloc_ms() -> tuple[float, torch.Tensor]:
        started = time.perf_counter()
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return 1e3 * (time.perf_counter() - started), buffer

    first, buffer = alloc_ms()
    del buffer
    again, buffer = alloc_ms()
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy = time_ms(lambda: buffer.copy_(source, non_blocking=True), device, repeats=10)
    return PinnedAllocation(nbytes, first, again, copy)
