"""``resident_rows`` (which wanted rows the retrieved buffer already holds) as a CUDA-graph replay:
the Triton op's slot map against the reference's sort + binary search, side by side.

    python3 benchmarks/resident_rows.py [--rows 2048] [--batches 1,4] [--kv-heads 8] [--overlap 0.5]

Session 7's profile of a re-selecting step at 4 x 128K found this op the costliest of the
re-selection (83 us a layer, then an all-pairs comparison). Each wanted row is in the buffer with probability ``--overlap``.
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.kernels import reference
from kvpolicy.kernels.triton import refresh
from kvpolicy.tiers import RetrievedBuffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"resident_rows, R={args.rows}, {args.kv_heads} KV heads, overlap {args.overlap}; us per replay "
          f"(median of {args.repeats})")
    print(f"{'B':>2s} {'triton':>8s} {'reference':>10s}")
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator(device=device).manual_seed(0)
        shape = (batch, args.kv_heads, args.rows)
        current = torch.randperm(1 << 20, generator=generator, device=device)[: batch * args.kv_heads * args.rows]
        current = current.view(shape).contiguous()
        held = torch.ones(shape, dtype=torch.bool, device=device)
        fresh = current + (1 << 20)
        keep = torch.rand(shape, generator=generator, device=device) < args.overlap
        wanted = torch.where(keep, current.flip(-1), fresh).contiguous()
        take = torch.ones(batch, dtype=torch.bool, device=device)
        source = torch.empty(shape, dtype=torch.int32, device=device)
        read = torch.zeros(batch, dtype=torch.long, device=device)
        slot_map = torch.full((*shape[:2], 1 << 21), -1, dtype=torch.int32, device=device)
        rows = current.new_zeros(*shape, 0, dtype=torch.bfloat16)  # the op reads only labels and held flags
        buffer = RetrievedBuffer(rows, rows, held, slots=current, held=held, fill=current.new_zeros(shape[:2]))
        times = []
        for op in (refresh.resident_rows, reference.resident_rows):
            times.append(1e3 * time_replay_ms(lambda op=op: op(wanted, take, buffer, source, read, slot_map), device,
                                              args.repeats))
        print(f"{batch:2d} {times[0]:8.1f} {times[1]:10.1f}", flush=True)


if __name__ == "__main__":
    main()
