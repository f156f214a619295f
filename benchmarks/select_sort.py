"""``select_budget``'s five rankings side by side: a full in-kernel ``tl.sort``, the threshold
select, ``torch.sort`` or ``torch.topk`` (of the best ``min(U, R)`` keys) before the launch, and
the radix select spread over (row, chunk) programs.

Times the Triton op as a CUDA-graph replay at decode sizes, each way, for steps that re-select
(``take`` all True) and steps that keep their selection (``take`` all False: the in-kernel paths
skip the ranking, the torch.sort path still sorts every row). Usage (GPU):
    python3 benchmarks/select_sort.py [--units 1024,2048,4096,8192,16384] [--batches 1,4]
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.kernels.triton import select as triton_select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="1024,2048,4096,8192,16384")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"select_budget, R={args.budget}, {args.kv_heads} KV heads; us per replay (median of {args.repeats})")
    print(f"{'B':>2s} {'units':>6s} {'take':>5s} {'full tl.sort':>13s} {'threshold':>10s} {'torch.sort':>11s} "
          f"{'topk':>7s} {'radix':>7s}")
    for batch in (int(b) for b in args.batches.split(",")):
        for units in (int(u) for u in args.units.split(",")):
            torch.manual_seed(0)
            shape = (batch, args.kv_heads, units)
            scores = torch.randn(shape, device=device)
            sizes = torch.randint(1, 32, shape, device=device)
            starts = torch.cumsum(sizes, -1) - sizes
            order = torch.arange(int(sizes.sum(-1).max()), device=device).expand(batch, args.kv_heads, -1).contiguous()
            for take_all in (True, False):
                take = torch.full((batch,), take_all, dtype=torch.bool, device=device)
                times = []
                for ranking in ("full", "threshold", "torch.sort", "topk", "radix"):
                    if ranking == "full" and units > 8192:  # the full sort's block spills past 8,192
                        times.append(None)
                        continue
                    triton_select.RANKING = ranking
                    try:
                        ms = time_replay_ms(lambda: triton_select.select_budget(scores, sizes, starts, order,
                                                                                args.budget, take),
                                            device, args.repeats)
                    finally:
                        triton_select.RANKING = "auto"
                    times.append(1e3 * ms)
                full = f"{times[0]:13.1f}" if times[0] is not None else f"{'-':>13s}"
                print(f"{batch:2d} {units:6d} {str(take_all):>5s} {full} {times[1]:10.1f} {times[2]:11.1f} "
                      f"{times[3]:7.1f} {times[4]:7.1f}", flush=True)


if __name__ == "__main__":
    main()
