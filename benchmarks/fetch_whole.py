"""``fetch_whole`` (a GPU pool's re-selection: the selected rows copied into the retrieved buffer)
as a CUDA-graph replay, per setting of its tunables (``kvpolicy/kernels/triton/fetch.py``'s
``TILE_BYTES`` and ``WARPS``; the first row is the shipped setting), beside the bytes' time at
the given bandwidth.

    python3 benchmarks/fetch_whole.py [--contexts 32768,131072] [--batches 1,4] [--rows 1980] [--zone units]

The pool is a prompt of each context (bf16, Qwen3-8B shape by default: 8 KV heads, head dim
128), every sequence re-selecting ``--rows`` random slots of its zone a (sequence, KV head).
``--zone none`` (the default): pool row = slot, as ParisKV's index of single tokens lays it out;
``--zone units``: a random zone order (the slot -> row map read per row, as LouisKV's units).
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.kernels.triton import fetch
from kvpolicy.store import TieredStore

# (label, TILE_BYTES, WARPS)
VARIANTS = (
    ("shipped", fetch.TILE_BYTES, fetch.WARPS),
    ("tile 8K", 8192, 4),
    ("tile 4K", 4096, 4),
    ("tile 8K 2w", 8192, 2),
    ("tile 32K 8w", 32768, 8),
    ("tile 16K 8w", 16384, 8),
)


def _store(batch, heads, context, dim, rows, zone, device, generator):
    keys = torch.randn(batch, heads, context, dim, generator=generator, device=device).to(torch.bfloat16)
    values = torch.randn(batch, heads, context, dim, generator=generator, device=device).to(torch.bfloat16)
    valid = torch.ones(batch, context, dtype=torch.bool, device=device)
    store = TieredStore.from_prefill(keys, values, valid, 4, 64, rows, device, defer_zone=True)
    order = None
    if zone == "units":
        order = torch.stack([torch.randperm(store.zone_end, generator=generator, device=device)
                             for _ in range(batch * heads)]).view(batch, heads, -1)
    store.lay_out_zone(keys, values, order)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=1980, help="retrieved rows a (sequence, KV head): budget 2048 "
                                                               "less sink 4 and local 64")
    parser.add_argument("--zone", default="none", choices=("none", "units"))
    parser.add_argument("--bandwidth", type=float, default=4.8, help="TB/s, for the bytes' time")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    shipped = (fetch.TILE_BYTES, fetch.WARPS)
    print(f"fetch_whole, {args.rows} rows a (sequence, head), zone {args.zone}; us per replay (median of {args.repeats})")
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            generator = torch.Generator(device=device).manual_seed(0)
            store = _store(batch, args.kv_heads, context, args.head_dim, args.rows, args.zone, device, generator)
            shape = (batch, args.kv_heads, args.rows)
            slots = torch.randint(0, store.zone_end, shape, generator=generator, device=device).sort(-1).values
            slot_valid = torch.ones(shape, dtype=torch.bool, device=device)
            reselect = torch.ones(batch, dtype=torch.bool, device=device)
            moved = 2 * 2 * slots.numel() * args.head_dim * 2  # keys and values, read and written, bf16
            print(f"{batch}x{context // 1024}K: {moved / 1e6:.1f} MB moved, {moved / args.bandwidth / 1e6:.1f} us "
                  f"at {args.bandwidth} TB/s")
            try:
                for label, tile_bytes, warps in VARIANTS:
                    fetch.TILE_BYTES, fetch.WARPS = tile_bytes, warps
                    us = 1e3 * time_replay_ms(lambda: fetch.fetch_whole(store, slots, slot_valid, reselect), device,
                                              args.repeats)
                    print(f"  {label:<14s} {us:7.1f}", flush=True)
            finally:
                fetch.TILE_BYTES, fetch.WARPS = shipped
            del store


if __name__ == "__main__":
    main()
