"""``select_budget``'s fill launch variants side by side, at a re-selection's decode sizes.

Times the Triton op (ranking "auto") as a CUDA-graph replay with every row re-selecting, for
each combination of the fill's knobs: the output positions in the fill's own program or in a
second launch (``SPLIT_POSITIONS``), its warps, and its block of units/positions. The radix
launches alone are timed too, so the fill's share is the difference. Sizes are K-means-like
(8-24 tokens a unit). Usage (GPU):
    python3 benchmarks/fill_variants.py [--cells 4x8200,1x2050] [--budget 2048]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.kernels.triton import select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="4x8200,1x8200,1x2050", help="BATCHxUNITS, comma-separated")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"select_budget (auto ranking), R={args.budget}, {args.kv_heads} KV heads, every row re-selecting; "
          f"us per replay (median of {args.repeats})", flush=True)
    defaults = (select.SPLIT_POSITIONS, select._NUM_WARPS, select._BLOCK)
    for cell in args.cells.split(","):
        batch, units = (int(x) for x in cell.split("x"))
        torch.manual_seed(0)
        shape = (batch, args.kv_heads, units)
        scores = torch.randn(shape, device=device)
        sizes = torch.randint(8, 25, shape, device=device)
        starts = torch.cumsum(sizes, -1) - sizes
        order = torch.argsort(torch.rand(batch, args.kv_heads, int(sizes.sum(-1).max()), device=device), -1)
        take = torch.ones(batch, dtype=torch.bool, device=device)
        ranking = select.auto_ranking(units, take_inline=True)
        line = f"{batch}x{units} units ({ranking})"
        if ranking == "radix":
            flat, flat_sizes = scores.reshape(-1, units), sizes.reshape(-1, units)
            cand = 1 << (min(units, args.budget) - 1).bit_length()
            ids = torch.empty_like(flat, dtype=torch.long)
            radix = time_replay_ms(lambda: select._radix_select(flat, flat_sizes, take, args.budget, args.kv_heads,
                                                                cand, ids), device, args.repeats)
            line += f": radix launches alone {1e3 * radix:.1f}"
        print(line, flush=True)
        for split, warps, block in itertools.product((False, True), (4, 8), (512, 2048)):
            select.SPLIT_POSITIONS, select._NUM_WARPS, select._BLOCK = split, warps, block
            try:
                ms = time_replay_ms(lambda: select.select_budget(scores, sizes, starts, order, args.budget, take),
                                    device, args.repeats)
            finally:
                select.SPLIT_POSITIONS, select._NUM_WARPS, select._BLOCK = defaults
            print(f"  split={split!s:5s} warps={warps} block={block:4d}: {1e3 * ms:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
