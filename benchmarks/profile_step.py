"""Where a graph-replayed decode step spends its GPU time: kernels per step and their total time.

    python benchmarks/profile_step.py --preset louiskv --context 32768 --batch 1 [--layers 36] [--out FILE]

Builds the e2e benchmark's random Qwen3-8B-shaped model, lays a random context into a policy's
cache, captures the decode step (``DecodeGraph``) and profiles a few replays with the CUDA
profiler. Prints the kernels grouped by name: launches per step and GPU microseconds per step.
``--preset full`` profiles the e2e baseline (StaticCache + split-K kernel) instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kvpolicy.bench.e2e import full_throughput, policy_throughput
from kvpolicy.bench.ttft import qwen3_8b_config, random_model
from kvpolicy.presets import preset


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="louiskv")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--placement", default="cpu")
    parser.add_argument("--trigger", default=None, help='JSON trigger spec, e.g. {"name":"interval","n":9}')
    parser.add_argument("--stickiness", type=float, default=0.0,
                        help="bias unit scores by up to this many times their spread, per unit (bench e2e's "
                             "--stickiness): overlapping selections")
    parser.add_argument("--query-pull", type=float, default=0.0,
                        help="pariskv: pull its selection's query by this many times its norm (bench e2e's --query-pull)")
    parser.add_argument("--steps", type=int, default=5, help="replays profiled")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--branches", default="auto", help="DecodeGraph's branch kind: auto, node, inline")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step needs a CUDA device", file=sys.stderr)
        return 2
    import json

    device = torch.device("cuda")
    model = random_model(qwen3_8b_config(layers=args.layers), device)
    prof = profile(activities=[ProfilerActivity.CUDA])  # entered around the timed replays only
    if args.preset == "full":
        r = full_throughput(model, "full-graph", args.batch, args.context, args.steps, around=prof)
    else:
        options = {"budget": args.budget, "placement": args.placement}
        if args.trigger:
            options["trigger"] = json.loads(args.trigger)
        if args.stickiness:
            from kvpolicy.bench.overlap import StickyTopBudget

            options["selector"] = StickyTopBudget(stickiness=args.stickiness)
        if args.query_pull:
            from kvpolicy.bench.overlap import StickyCollisionRerank

            options["selector"] = StickyCollisionRerank.pulling(preset(args.preset, **options).selector, args.query_pull)
        r = policy_throughput(model, preset(args.preset, **options), args.batch, args.context, args.steps,
                              around=prof, branches=args.branches)
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)
    per = args.steps
    lines = [f"{args.preset} B={args.batch} context={args.context} layers={args.layers} branches={args.branches}: "
             f"{r.ms_per_step:.2f} ms/step "
             f"(wall, under the profiler); per replay:",
             f"{'kernel':70s} {'calls':>7s} {'us/step':>9s} {'avg us':>8s}"]
    for e in rows[: args.rows]:
        lines.append(f"{e.key[:70]:70s} {e.count / per:7.1f} {e.device_time_total / per:9.1f} "
                     f"{e.device_time_total / max(e.count, 1):8.1f}")
    busy = sum(e.device_time_total for e in rows) / per
    total_calls = sum(e.count for e in rows) / per
    lines.append(f"per replay: {total_calls:.0f} kernels, {busy / 1e3:.2f} ms of kernel time, {len(rows)} distinct")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
