"""``select_budget`` at a re-selection's decode sizes, for two kinds of units: its whole cost, the
radix launches' share, and the fill's variants.

Times the Triton op (ranking "auto") as a CUDA-graph replay with every row re-selecting, for units
of 8-24 tokens each and K-means-like ones of random keys (1-96 tokens, scores spread as
1/sqrt(size), so the winners are mostly 1-3-token units, ~760 at R = 2,048). Usage (GPU):
    python3 benchmarks/fill_variants.py [--cells 4x8200,1x32800] [--budget 2048]

Columns: the radix launches alone; the whole op as shipped; without the middle sort block (the
winners past 256 sorted in the whole min(U, R) block); with the fill at 16 warps instead of 8.
Two fill variants were measured with it and dropped (select.py says why): the output positions as
their own launch (session 11's first call, docs/bench/session11/fill/) and a rank launch ordering
the winners (second call, docs/bench/session11/louis/).
"""


from __future__ import annotations

import argparse

import torch

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.kernels.triton import select


def _units(kind: str, shape: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, sizes) of ``kind`` "uniform" (8-24 tokens) or "kmeans" (skewed sizes, small units score wider)."""
    if kind == "uniform":
        return torch.randn(shape, device=device), torch.randint(8, 25, shape, device=device)
    # sizes of K-means clusters of 8,192 random 128-dim keys at 16 tokens a cluster (8 iterations):
    # quantiles 10/25/50/75/90/99% = 1/2/6/25/46/87 tokens; a log-uniform draw over 1-96 is close
    sizes = torch.exp(torch.rand(shape, device=device) * torch.log(torch.tensor(96.0))).floor().long()
    return torch.randn(shape, device=device) / sizes.float().sqrt(), sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="4x8200,1x32800", help="BATCHxUNITS, comma-separated")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"select_budget (auto ranking), R={args.budget}, {args.kv_heads} KV heads, every row re-selecting; "
          f"us per replay (median of {args.repeats})", flush=True)
    print(f"{'cell':>8s} {'units':>8s} {'winners':>8s} {'radix alone':>12s} {'whole op':>9s} {'no mid':>7s} "
          f"{'16 warps':>9s}", flush=True)
    for cell in args.cells.split(","):
        batch, units = (int(x) for x in cell.split("x"))
        for kind in ("uniform", "kmeans"):
            torch.manual_seed(0)
            shape = (batch, args.kv_heads, units)
            scores, sizes = _units(kind, shape, device)
            starts = torch.cumsum(sizes, -1) - sizes
            order = torch.argsort(torch.rand(batch, args.kv_heads, int(sizes.sum(-1).max()), device=device), -1)
            take = torch.ones(batch, dtype=torch.bool, device=device)
            flat, flat_sizes = scores.reshape(-1, units), sizes.reshape(-1, units)
            cand = 1 << (min(units, args.budget) - 1).bit_length()
            ids = torch.empty_like(flat, dtype=torch.long)
            radix = time_replay_ms(lambda: select._radix_select(flat, flat_sizes, take, args.budget, args.kv_heads,
                                                                cand, ids), device, args.repeats)
            line = select._radix_select(flat, flat_sizes, take, args.budget, args.kv_heads, cand, ids)[2]
            winners = float(line[:, select._RADIX_COUNTER.value].float().mean())
            columns = []
            for mid, warps in ((select._RADIX_MID_SORT, select._NUM_WARPS), (0, select._NUM_WARPS),
                               (select._RADIX_MID_SORT, 16)):
                shipped = select._RADIX_MID_SORT, select._NUM_WARPS
                select._RADIX_MID_SORT, select._NUM_WARPS = mid, warps
                try:
                    columns.append(time_replay_ms(
                        lambda: select.select_budget(scores, sizes, starts, order, args.budget, take),
                        device, args.repeats))
                finally:
                    select._RADIX_MID_SORT, select._NUM_WARPS = shipped
            whole, no_mid, wide = (1e3 * c for c in columns)
            print(f"{cell:>8s} {kind:>8s} {winners:8.0f} {1e3 * radix:12.1f} {whole:9.1f} {no_mid:7.1f} {wide:9.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
