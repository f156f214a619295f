"""One layer's re-selection (``TieredStore.fetch``) from a pinned host pool: the comparing lookup
against the slot map, side by side in one run.

    python benchmarks/pinned_reselect.py --out pinned_reselect.json
    python benchmarks/pinned_reselect.py --device cpu --context 4096 --out /tmp/x.json   # code path only

A store like a Qwen3-8B layer's (8 KV heads of 128, bf16) holds a prompt of ``--context`` tokens in
a pinned pool; its retrieved buffer has ``budget - sink - local`` rows. A chain of selections is
drawn per (sequence, KV head): each is made of units of ``--unit`` consecutive slots (as a
unit-ordered pool lays a unit out), keeps ``overlap`` of the previous selection's units and
draws the rest afresh (``--comeback``: that share of them from the selection before the
previous one, which a unit cache may still hold), in a new order. Each path (``lookup="compare"``: ``resident_rows`` +
``refresh_rows`` + ``cache_insert``, the path before the slot map; ``lookup="map"``:
``fetch_mapped``) starts from the same empty state, fetches the first selection untimed, then
each next one timed with CUDA events: as a CUDA-graph replay (the selection copied into the
captured input before each replay, outside the timing; how a decode step runs it) and eagerly
(launch gaps included). Both paths must read the same rows from the pool and leave the same
buffer; the script checks that. ``h2d floor``: one contiguous pinned-to-device copy of the
mean missed bytes, the PCIe time no gather can beat.

On a CPU the pool is ordinary memory, the reference backend runs and times are wall clock: a
check that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpolicy.bench.timing import time_ms  # noqa: E402
from kvpolicy.kernels import dispatch  # noqa: E402
from kvpolicy.store import TieredStore  # noqa: E402


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the rows and the run's environment")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    p.add_argument("--backend", default="auto", help="kernel backend (auto: triton on CUDA, reference on CPU)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=131072, help="prompt tokens in the pool")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--local", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--unit", type=int, default=16, help="slots per selected unit (a run in the pool)")
    p.add_argument("--overlaps", default="0.5,0.7,0.9", help="share of the previous selection's units kept")
    p.add_argument("--cache-rows", default="0,auto",
                   help="GPU unit cache rows per (sequence, head), comma-separated; 0: none; auto: twice the retrieved rows")
    p.add_argument("--comeback", type=float, default=0.3,
                   help="share of the units not kept that come back from the selection before the previous one "
                        "(units a unit cache may still hold); the rest are drawn afresh")
    p.add_argument("--selections", type=int, default=20, help="timed re-selections per path and cell")
    p.add_argument("--timing", default="replay,eager", help="replay and/or eager (replay needs CUDA)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def _chain(args, units: int, rows: int, overlap: float, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``count`` selections ``(B, H, rows)`` of slots, each keeping ``overlap`` of the previous
    one's units (per sequence and head), units of ``args.unit`` slots after the sink."""
    per = -(-rows // args.unit)  # units a selection holds (the last one cut at ``rows``)
    keep = round(overlap * per)
    offsets = torch.arange(args.unit)
    chain, previous, before = [], None, None
    for _ in range(count):
        picked = torch.empty(args.batch, args.kv_heads, per, dtype=torch.long)
        for b in range(args.batch):
            for h in range(args.kv_heads):
                if previous is None:
                    chosen = torch.randperm(units, generator=gen)[:per]
                else:
                    old = previous[b, h]
                    kept = old[torch.randperm(per, generator=gen)[:keep]]
                    free = torch.ones(units, dtype=torch.bool)
                    free[old] = False
                    back = torch.empty(0, dtype=torch.long)
                    if before is not None and args.comeback > 0:
                        dropped = before[b, h][free[before[b, h]]]  # in the one before, not in the last
                        back = dropped[torch.randperm(dropped.numel(), generator=gen)[: round(args.comeback * (per - keep))]]
                        free[back] = False
                    candidates = free.nonzero().squeeze(1)
                    drawn = candidates[torch.randperm(candidates.numel(), generator=gen)[: per - keep - back.numel()]]
                    fresh = torch.cat([back, drawn])
                    chosen = torch.cat([kept, fresh])[torch.randperm(per, generator=gen)]  # a new score order
                picked[b, h] = chosen
        before, previous = previous, picked
        slots = args.sink + (picked.unsqueeze(-1) * args.unit + offsets).flatten(2)[..., :rows]
        chain.append(slots)
    return chain


def _reset(store: TieredStore) -> None:
    """Nothing held: buffer, cache, map, counters as after a prefill."""
    store.forget_resident()
    if store.slot_map is not None:
        store.slot_map.fill_(-1)
    if store.cache is not None:
        store.cache.cursor.zero_()
        store.cache.slots.fill_(-1)
    store.pool_rows_read.zero_()
    store.rows_fetched.zero_()


def _run_path(store, lookup, chain, ops, device, timing):
    """Times of fetching ``chain[1:]`` after ``chain[0]`` with ``store.lookup = lookup``; returns
    (ms list, rows read, rows fetched, final buffer state)."""
    store.lookup = lookup
    store._fit_map()
    _reset(store)
    slots = chain[0].to(device).clone()
    valid = torch.ones_like(slots, dtype=torch.bool)
    take = torch.ones(slots.shape[0], dtype=torch.bool, device=device)
    fetch = lambda: store.fetch(slots, valid, take, ops)  # noqa: E731
    graph = None
    if timing == "replay":
        # compile and capture with nothing taken (the kernels exit at once), then take every row
        take.zero_()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fetch()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fetch()
        take.fill_(True)
        run = graph.replay
    else:
        run = fetch
    run()  # the first selection, untimed: the buffer (and cache) start from it
    read0, fetched0 = store.pool_rows_read.clone(), store.rows_fetched.clone()
    samples = []
    for selection in chain[1:]:
        slots.copy_(selection.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            run()
            samples.append(1e3 * (time.perf_counter() - started))
    read = int((store.pool_rows_read - read0).sum())
    fetched = int((store.rows_fetched - fetched0).sum())
    r = store.retrieved
    final = [t.clone() for t in (r.keys, r.values, r.slots, r.valid, r.held, r.fill)]
    del graph
    return samples, read, fetched, final


def main() -> None:
    args = _args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a smoke run")
    timings = [t for t in args.timing.split(",") if t]
    if device.type != "cuda":
        timings = ["eager"]
    backend = args.backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "reference"
    ops = dispatch.bind(backend, device)
    retrieval = args.budget - args.sink - args.local
    units = (args.context - args.local - args.sink) // args.unit
    if units * args.unit < 2 * retrieval:
        raise SystemExit(f"--context {args.context} holds {units} units of {args.unit}: too few for {retrieval} rows twice")
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(args.seed)
    print(f"pinned_reselect: B={args.batch}, context {args.context}, budget {args.budget} "
          f"({retrieval} retrieved rows), {args.kv_heads} KV heads x {args.head_dim}, bf16, units of {args.unit}, "
          f"backend {backend} on {device}", flush=True)

    started = time.perf_counter()
    shape = (args.batch, args.kv_heads, args.context, args.head_dim)
    keys = torch.randn(shape, dtype=dtype, device=device, generator=None)
    values = torch.randn(shape, dtype=dtype, device=device)
    valid = torch.ones(args.batch, args.context, dtype=torch.bool, device=device)
    store = TieredStore.from_prefill(keys, values, valid, args.sink, args.local, retrieval, torch.device("cpu"))
    del keys, values
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    assert store.retrieval_capacity == retrieval, (store.retrieval_capacity, retrieval)
    pinned = store.pool.keys.is_pinned() if device.type == "cuda" else False
    print(f"  prefill: pool of {store.pool.nbytes() / 2**30:.2f} GiB in host memory (pinned: {pinned}), "
          f"{time.perf_counter() - started:.1f} s", flush=True)

    row_bytes = 2 * args.head_dim * store.pool.keys.element_size()  # a key and a value
    results = []
    for cache_text in [c for c in args.cache_rows.split(",") if c]:
        cache_rows = 2 * retrieval if cache_text == "auto" else int(cache_text)
        if cache_rows:
            store.set_cache(cache_rows)
        else:
            store.cache = None
        for overlap in _floats(args.overlaps):
            chain = _chain(args, units, retrieval, overlap, args.selections + 1, gen)
            cell = {"cache_rows": cache_rows, "overlap": overlap, "comeback": args.comeback}
            finals = {}
            for timing in timings:
                for lookup in ("compare", "map"):
                    samples, read, fetched, final = _run_path(store, lookup, chain, ops, device, timing)
                    cell[f"{lookup}_{timing}_ms"] = statistics.median(samples)
                    cell[f"{lookup}_{timing}_ms_all"] = samples
                    cell[f"{lookup}_rows_read"], cell["rows_fetched"] = read, fetched
                    finals[(lookup, timing)] = (read, final)
                    print(f"  cache {cache_rows:>5d}, overlap {overlap:.2f}, {timing:>6s}, {lookup:>7s}: "
                          f"{statistics.median(samples):8.3f} ms (median of {len(samples)}), miss {read / fetched:.3f}",
                          flush=True)
            reference = next(iter(finals.values()))
            agree = all(read == reference[0] and all(torch.equal(a, b) for a, b in zip(final, reference[1]))
                        for read, final in finals.values())
            cell["paths_agree"] = agree
            cell["miss_fraction"] = cell["map_rows_read"] / cell["rows_fetched"]
            cell["slot_map_bytes"] = store.slot_map_bytes()
            if not agree:
                print("  WARNING: the two paths read different rows or left different buffers", flush=True)
            # the PCIe floor: the mean missed bytes of one re-selection as one contiguous copy
            missed = cell["map_rows_read"] * row_bytes // max(len(chain) - 1, 1)
            if device.type == "cuda" and missed:
                src = torch.empty(missed, dtype=torch.uint8, pin_memory=True)
                dst = torch.empty(missed, dtype=torch.uint8, device=device)
                cell["h2d_floor_ms"] = time_ms(lambda: dst.copy_(src, non_blocking=True), device, repeats=20)
                del src, dst
            else:
                cell["h2d_floor_ms"] = None
            cell["missed_bytes"] = missed
            results.append(cell)

    print()
    head = f"{'cache':>6s} {'overlap':>7s} {'miss':>6s} {'MB/fetch':>8s}"
    for timing in timings:
        head += f" {'compare ' + timing:>15s} {'map ' + timing:>11s} {'x':>5s}"
    head += f" {'h2d floor':>9s} {'agree':>5s}"
    print(head + "   (ms per layer re-selection, median)")
    for cell in results:
        line = (f"{cell['cache_rows']:>6d} {cell['overlap']:>7.2f} {cell['miss_fraction']:>6.3f} "
                f"{cell['missed_bytes'] / 1e6:>8.2f}")
        for timing in timings:
            old, new = cell[f"compare_{timing}_ms"], cell[f"map_{timing}_ms"]
            line += f" {old:>15.3f} {new:>11.3f} {old / new:>5.2f}"
        floor = cell["h2d_floor_ms"]
        line += f" {'-' if floor is None else f'{floor:.3f}':>9s} {'yes' if cell['paths_agree'] else 'NO':>5s}"
        print(line)
    print(f"slot map: {store.slot_map_bytes() / 2**20:.2f} MiB for this layer (4 bytes per pool slot and KV head)")

    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "backend": backend,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "args": vars(args)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": results}, f, indent=1)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
