"""louiskv's pinned interval row by miss fraction: ms per step against full-graph, by stickiness and
GPU unit cache size.

A pinned re-selection's cost is mostly the rows it reads across PCIe (the miss fraction: rows neither
the retrieved buffer nor the unit cache held). Random weights select afresh; ``bench e2e``'s
``--stickiness`` biases louiskv's unit scores so that successive selections overlap as a real
model's do. This times ``bench e2e``'s louiskv/cpu/interval~sN row over a grid of stickiness values
and cache sizes (multiples of the retrieved rows; ``unit_cache_rows=None`` is 2), in one process
beside one full-graph row, so that the row can be read at the miss fraction a real model shows
(``benchmarks/miss_fraction.py``), and the ratios come from one run.

    python3 benchmarks/pinned_rates.py [--context 131072] [--batch 4] [--stickiness 32,48,64]
        [--multiples 2] [--steps 18] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvpolicy.bench import BUDGET, LOUISKV_RATE
from kvpolicy.bench.compiled_layers import compile_mlp_and_norms
from kvpolicy.bench.e2e import full_throughput, policy_throughput
from kvpolicy.bench.overlap import StickyTopBudget
from kvpolicy.bench.sweeps import louiskv_interval, whole_intervals
from kvpolicy.bench.ttft import qwen3_8b_config, random_model
from kvpolicy.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget", type=int, default=BUDGET)
    parser.add_argument("--multiples", default="2",
                        help="comma-separated cache sizes, as multiples of the retrieved rows (0: no cache)")
    parser.add_argument("--stickiness", default="32,48,64", help="comma-separated per-unit score biases")
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    multiples = [int(m) for m in args.multiples.split(",")]
    stickiness = [float(s) for s in args.stickiness.split(",")]
    if any(m < 0 for m in multiples) or 1 in multiples:
        raise SystemExit(f"--multiples: 0 (no cache) or integers >= 2 (a cache holds at least the retrieved rows "
                         f"and the default is 2); got {args.multiples}")
    device = torch.device("cuda")
    model = random_model(qwen3_8b_config(), device)
    compile_mlp_and_norms(model)
    every = louiskv_interval(LOUISKV_RATE)
    steps = whole_intervals(args.steps, every)
    full = full_throughput(model, "full-graph", args.batch, args.context, args.steps)
    print(f"{args.batch}x{args.context}, budget {args.budget}, louiskv pinned interval({every}); full-graph "
          f"{full.ms_per_step:.2f} ms/step", flush=True)
    print(f"{'stickiness':>10s} {'cache rows':>10s} {'multiple':>8s} {'ms/step':>8s} {'vs full':>8s} {'miss':>6s}",
          flush=True)
    rows = [{"kind": "full-graph", "ms_per_step": full.ms_per_step}]
    retrieved = preset("louiskv", budget=args.budget).retrieval_budget
    for bias in stickiness:
        for multiple in multiples:
            policy = preset("louiskv", budget=args.budget, placement="cpu", unit_cache_rows=multiple * retrieved,
                            trigger={"name": "interval", "n": every}, selector=StickyTopBudget(stickiness=bias))
            r = policy_throughput(model, policy, args.batch, args.context, steps)
            rows.append({"kind": "louiskv/cpu/interval", "stickiness": bias, "cache_rows": multiple * retrieved,
                         "multiple": multiple, "ms_per_step": r.ms_per_step,
                         "speedup_vs_full_graph": full.ms_per_step / r.ms_per_step, "miss_fraction": r.miss_fraction})
            print(f"{bias:10g} {multiple * retrieved:10d} {multiple:7d}x {r.ms_per_step:8.2f} "
                  f"{full.ms_per_step / r.ms_per_step:8.2f} {r.miss_fraction:6.2f}", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"context": args.context, "batch": args.batch, "interval": every, "steps": steps,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
