"""Single-row gather from a pinned pool: which schedule, and which host pages, reach >=40 GB/s.

ParisKV's fetch reads one 256-byte row per selected token from a pinned pool (B, H, context, D).
Session 8 measured gather.py's kernel at 24.1 GB/s at 1M x 4 (selection order) against 52.6 GB/s
for a plain pinned copy, while it reaches 45-50 GB/s at 128K. This script times, on one pool:

- ``gather.py``: the shipped ``gather_rows_into`` (triton);
- ``single rXwY``: ``kernels/triton/gather_single.py`` at X rows a program and Y warps;
  ``spread``: programs (sequence, head)-fastest; ``sort``: slots sorted inside the op
  (fed random-order slots); ``walk Nx``: a persistent grid of N programs per SM walking the
  (sequence, head) regions in turn (fewer pages in flight at once);

for pools of the same shape: ``mmap`` (``kvpolicy.pinned.pinned_empty``: the pools ParisKV's
pinned tier uses; since session 19 in transparent huge pages, ``pinned.HUGE_PAGES``), ``mmap4k``
(the same with ``HUGE_PAGES`` off: a shared mapping, 4 KB pages), ``thp`` (a private anonymous
mapping ``madvise(MADV_HUGEPAGE)``'d and touched before ``cudaHostRegister``; smaps says whether
it took), and ``hostalloc`` (``torch.empty(pin_memory=True)``: cudaHostAlloc,
whose driver-side chunks may map differently on the GPU). Every variant's rows are checked equal
to the reference's once.

    python3 benchmarks/pinned_gather.py --contexts 131072,1048576 --batch 4 --json out.json

CPU (``TRITON_INTERPRET=1``) runs a toy size for the code path only; the figures are GPU figures.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpolicy.bench.timing import time_ms  # noqa: E402
from kvpolicy.kernels import dispatch, reference  # noqa: E402

HUGE = 2 << 20

# (label, rows a program, warps, spread, sort); then WALKS: (label, rows, warps, programs per SM)
VARIANTS = (
    ("single r1w1", 1, 1, False, False),
    ("single r2w1", 2, 1, False, False),
    ("single r4w1", 4, 1, False, False),
    ("single r8w2", 8, 2, False, False),
    ("single r16w4", 16, 4, False, False),
    ("single r32w4", 32, 4, False, False),
    ("single r64w4", 64, 4, False, False),
    ("single r64w8", 64, 8, False, False),
    ("single r4w1 spread", 4, 1, True, False),
    ("single r16w4 spread", 16, 4, True, False),
    ("single r64w4 spread", 64, 4, True, False),
)
WALKS = (
    ("walk r16w4 2x", 16, 4, 2),
    ("walk r16w4 4x", 16, 4, 4),
    ("walk r16w4 8x", 16, 4, 8),
    ("walk r4w1 8x", 4, 1, 8),
    ("walk r4w1 16x", 4, 1, 16),
    ("walk r64w4 2x", 64, 4, 2),
)


def _anon_huge_kb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _meminfo(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux x86-64's value


def _smaps_huge_kb(pointer: int) -> int | None:
    """AnonHugePages (THP) of the mapping holding ``pointer``, from /proc/self/smaps; None if unreadable."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:
                    try:
                        low, high = (int(x, 16) for x in head[0].split("-"))
                    except ValueError:
                        continue
                    inside = low <= pointer < high
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class HugePool:
    """A 2 MB-aligned anonymous mapping in huge pages, then registered: ``thp`` (advised to
    transparent huge pages and touched before pinning, so the first fault of each 2 MB takes a huge
    page where the kernel has one) or ``hugetlb`` (MAP_HUGETLB: only with pages reserved in
    vm.nr_hugepages; raises OSError otherwise)."""

    def __init__(self, nbytes: int, register: bool, kind: str = "thp") -> None:
        size = -(-nbytes // HUGE) * HUGE
        if kind == "hugetlb":
            self.buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
            base = np.frombuffer(self.buffer, dtype=np.uint8)
            offset = 0
        else:
            # private: a shared anonymous mapping (mmap's default) is shmem, which THP's madvise mode
            # leaves in 4 KB pages (sessions 9 and 19's first runs got 0 MB of huge pages so)
            self.buffer = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self.buffer.madvise(mmap.MADV_HUGEPAGE)
            base = np.frombuffer(self.buffer, dtype=np.uint8)
            offset = (-base.ctypes.data) % HUGE
        self.array = base[offset:offset + nbytes]
        self.array[::4096] = 0  # first touch, page by page, before pinning
        self.pointer = self.array.ctypes.data
        self.huge_kb = _smaps_huge_kb(self.pointer) if kind == "thp" else size // 1024
        self.registered = False
        if register:
            status = int(torch.cuda.cudart().cudaHostRegister(self.pointer, nbytes, 0))
            if status != 0:
                raise RuntimeError(f"cudaHostRegister of the huge-page pool failed: error {status}")
            self.registered = True

    def tensor(self, shape, dtype) -> torch.Tensor:
        return torch.from_numpy(self.array).view(dtype).view(shape)

    def release(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.pointer)
            self.registered = False


def _fill(pool: torch.Tensor, device: torch.device) -> None:
    """Contents: one random block repeated, written from the device (drawing GBs on the host is slow)."""
    block = torch.randn(1 << 20, dtype=pool.dtype, device=device)
    flat = pool.view(-1)
    for start in range(0, flat.numel(), block.numel()):
        part = flat[start:start + block.numel()]
        part.copy_(block[: part.numel()], non_blocking=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slots(batch, heads, context, count, buffered, device):
    gen = torch.Generator(device=device).manual_seed(7)
    random = torch.rand(batch, heads, context, generator=gen, device=device).topk(count, -1).indices
    ordered = random.sort(-1).values
    # rerank_select's order: the update buffer's newest slots first, then the retrieved ones by slot
    buffered = min(buffered, count)
    selection = torch.cat([ordered[..., count - buffered:], ordered[..., :count - buffered]], -1)
    return random, selection


def measure(args, device, pool_kind: str, context: int) -> list[dict]:
    from kvpolicy.kernels.triton.gather_single import gather_single_rows_into
    from kvpolicy.pinned import pinned_empty

    batch, heads, dim = args.batch, args.kv_heads, args.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (batch, heads, context, dim)
    nbytes = batch * heads * context * dim * torch.empty((), dtype=dtype).element_size()
    cuda = device.type == "cuda"
    huge_before = _anon_huge_kb()
    started = time.perf_counter()
    holder = None
    if pool_kind in ("thp", "hugetlb"):
        try:
            holder = HugePool(nbytes, register=cuda, kind=pool_kind)
        except OSError as error:
            print(f"  {pool_kind:>9s} {context >> 10:>5d}K x{batch}: no pool ({error}; hugetlb needs pages reserved "
                  f"in vm.nr_hugepages: {_meminfo('HugePages_Free')} free)", flush=True)
            return []
        pool = holder.tensor(shape, dtype)
    elif pool_kind == "hostalloc":
        pool = torch.empty(shape, dtype=dtype, pin_memory=cuda)
    elif pool_kind == "mmap4k":
        from kvpolicy import pinned

        saved, pinned.HUGE_PAGES = pinned.HUGE_PAGES, False
        try:
            pool = pinned_empty(shape, dtype) if cuda else torch.empty(shape, dtype=dtype)
        finally:
            pinned.HUGE_PAGES = saved
    else:
        pool = pinned_empty(shape, dtype) if cuda else torch.empty(shape, dtype=dtype)
    setup_s = time.perf_counter() - started
    if holder is not None:
        pool_huge_kb = holder.huge_kb
    else:  # pinned_empty's pools: smaps of their mapping, faulted in by cudaHostRegister (a hostalloc pool: -)
        pool_huge_kb = _smaps_huge_kb(pool.data_ptr()) if cuda and pool_kind != "hostalloc" else None
    _fill(pool, device)
    huge_after = _anon_huge_kb()
    count = args.budget - 4 - 64
    random, selection = _slots(batch, heads, context, count, args.update_buffer - 1, device)
    take = torch.ones(batch, dtype=torch.bool, device=device)
    out = torch.empty(batch, heads, count, dim, dtype=dtype, device=device)
    moved = out.numel() * out.element_size()
    expected = {
        "selection": reference.gather_rows(pool, selection.to(pool.device), device),
        "random": reference.gather_rows(pool, random.to(pool.device), device),
    }
    source = torch.empty(moved, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(moved, dtype=torch.uint8, device=device)
    copy_ms = time_ms(lambda: target.copy_(source, non_blocking=True), device, args.repeats)
    shipped = dispatch.get("gather_rows_into", args.backend, device)
    runs = [("gather.py", "selection", lambda s: shipped(pool, s, take, out)),
            ("gather.py", "random", lambda s: shipped(pool, s, take, out))]
    for label, rows, warps, spread, _ in VARIANTS:
        runs.append((label, "selection", lambda s, r=rows, w=warps, sp=spread:
                     gather_single_rows_into(pool, s, take, out, rows=r, warps=w, spread=sp)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 2
    for label, rows, warps, per_sm in WALKS:
        runs.append((label, "selection", lambda s, r=rows, w=warps, p=per_sm * sms:
                     gather_single_rows_into(pool, s, take, out, rows=r, warps=w, programs=p)))
    for span in sorted(s for s in args.spans if s < context):
        # the same number of rows drawn from the first `span` positions of this pool
        _, narrow = _slots(batch, heads, span, count, args.update_buffer - 1, device)
        expected[f"span {span}"] = reference.gather_rows(pool, narrow.to(pool.device), device)
        runs.append((f"gather.py span {span >> 10}K", f"span {span}", lambda s, n=narrow: shipped(pool, n, take, out)))
        runs.append((f"single r32w4 span {span >> 10}K", f"span {span}",
                     lambda s, n=narrow: gather_single_rows_into(pool, n, take, out, rows=32, warps=4)))
    runs.append(("single r16w4 sort", "random", lambda s: gather_single_rows_into(pool, s, take, out, rows=16, warps=4, sort=True)))
    runs.append(("single r64w4 sort", "random", lambda s: gather_single_rows_into(pool, s, take, out, rows=64, warps=4, sort=True)))
    results = []
    for label, order, fn in runs:
        slots = selection if order == "selection" else random  # span runs bring their own slots
        out.zero_()
        fn(slots)
        equal = bool(torch.equal(out, expected[order]))
        ms = time_ms(lambda: fn(slots), device, args.repeats)
        results.append({
            "pool": pool_kind, "context": context, "batch": batch, "kv_heads": heads, "rows": count,
            "variant": label, "order": order, "ms": ms, "gbps": moved / ms / 1e6, "copy_gbps": moved / copy_ms / 1e6,
            "equal": equal, "bytes": moved, "pool_setup_s": setup_s,
            "anon_huge_mb": (huge_after - huge_before) / 1024 if huge_before >= 0 else None,
            # the pool's own huge pages (smaps for thp and pinned_empty's, the mapping for hugetlb); None for hostalloc
            "pool_huge_mb": pool_huge_kb / 1024 if pool_huge_kb is not None else None,
            "pool_mb": nbytes / 2**20,
        })
        print(f"  {pool_kind:>9s} {context >> 10:>5d}K x{batch} {label:22s} {order:>9s}: {ms:7.3f} ms "
              f"{moved / ms / 1e6:6.1f} GB/s (copy {moved / copy_ms / 1e6:5.1f}) equal={equal}", flush=True)
    del pool, expected
    if holder is not None:
        holder.release()
    if cuda:  # pinned_empty keeps a freed pool's mapping for reuse: the next pool kind must not get it
        import gc

        from kvpolicy import pinned

        gc.collect()
        pinned.release_unused()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="131072,1048576")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--update-buffer", type=int, default=64)
    parser.add_argument("--pools", default="mmap,mmap4k,thp,hugetlb,hostalloc",
                        help="comma list of mmap (pinned_empty), mmap4k (pinned_empty in 4 KB pages), thp (madvised, touched huge pages), hugetlb "
                             "(MAP_HUGETLB; needs vm.nr_hugepages) and hostalloc (cudaHostAlloc)")
    parser.add_argument("--spans", default="", help="comma list of spans (positions): gather.py and r32w4 again with "
                        "the rows drawn from the first SPAN positions of the pool")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    bad = [p for p in pools if p not in ("mmap", "mmap4k", "thp", "hugetlb", "hostalloc")]
    if bad:
        parser.error(f"unknown pool kind(s) {bad}; expected mmap, mmap4k, thp, hugetlb and/or hostalloc")
    try:
        args.spans = [int(x) for x in args.spans.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--spans takes comma-separated integers, got {args.spans!r}")
    if any(x < args.budget for x in args.spans):
        parser.error("--spans must each be at least --budget (the rows are distinct positions)")
    if args.budget - 4 - 64 < 1:
        parser.error("--budget must exceed 68 (sink 4 + recent 64)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (toy: the code path only)"
    print(f"single-row gather from a pinned pool ({name}, torch {torch.__version__}); THP mode: {_thp_mode()}")
    results = []
    for context in contexts:
        for pool_kind in pools:
            results.extend(measure(args, device, pool_kind, context))
            if args.json:  # after each pool: a run cut short by a timeout keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"device": name, "thp": _thp_mode(), "results": results}, f, indent=1)
    print_summary(results)
    return 0 if all(r["equal"] for r in results) else 1


def print_summary(results: list[dict]) -> None:
    """Per (context, pool): gather.py in the selection's order against the fastest variant."""
    print("summary (selection order; target >= 40 GB/s at 1M x 4):")
    cells = sorted({(r["context"], r["pool"]) for r in results}, key=lambda c: (-c[0], c[1]))
    for context, pool in cells:
        rows = [r for r in results if r["context"] == context and r["pool"] == pool and r["order"] == "selection"]
        shipped = next((r for r in rows if r["variant"] == "gather.py"), None)
        best = max(rows, key=lambda r: r["gbps"])
        base = f"gather.py {shipped['gbps']:.1f} GB/s" if shipped else "gather.py not run"
        huge = rows[0]["pool_huge_mb"]
        print(f"  {context >> 10:>5d}K {pool:>9s}: {base}; best {best['variant']} {best['gbps']:.1f} GB/s; "
              f"copy {best['copy_gbps']:.1f}; the pool's huge pages {'-' if huge is None else f'{huge:.0f} MB'}")
        for r in results:
            if r["context"] == context and r["pool"] == pool and r["order"].startswith("span"):
                print(f"      {r['variant']:<24s} {r['gbps']:.1f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
