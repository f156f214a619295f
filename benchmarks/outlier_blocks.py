"""The outlier score-gap trigger's fused op (``score_gap_outlier_fire``) at decode sizes, one setting of
its kernels' module constants at a time: each checked against the reference, then timed.

A replay runs the op once for each of ``--layers`` trigger states (each its own tables, so the
replay reads them from HBM as a decode step does, not from the L2), as a CUDA graph. Prints us per
layer, the blocks kernel's share from the CUDA profiler, and the bytes it must read a layer over
its time (GB/s). ``--challengers C`` then times the trigger with ``C`` challengers a
query head: a measured step (the whole table; each call starts with none listed) and a step between
measured ones (the held units and the challengers alone), at each of ``--challenger-variants``. Usage (GPU):
    python3 benchmarks/outlier_blocks.py [--context 131072] [--batch 1] [--only base,stages2] [--challengers 8]
        [--challenger-variants shipped,blocks+tile] [--fixed-query]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.bench.trigger_states import decode_trigger_state
from kvpolicy.kernels import dispatch, reference_step
from kvpolicy.triggers.score_gap import ScoreGap

GAP = "kvpolicy.kernels.triton.score_gap"
OUTLIER = "kvpolicy.kernels.triton.score_gap_outlier"
# the settings compared: name -> {module: {constant: value}}, each over session 27's settings (its
# name "base"), but "shipped", the modules' own
SESSION27 = {OUTLIER: {"_KEY_PRODUCT": "tf32", "_TILE_ELEMENTS": 4096, "_KEY_STAGES": 0, "_BLOCKS_WARPS": 4},
             GAP: {"_ROW_BLOCK": 4, "_ROW_SPAN": 64}}
VARIANTS = {
    "shipped": None,
    "base": {},
    "warps2": {OUTLIER: {"_BLOCKS_WARPS": 2}},
    "stages2": {OUTLIER: {"_KEY_STAGES": 2}},
    "stages3": {OUTLIER: {"_KEY_STAGES": 3}},
    "bf16": {OUTLIER: {"_KEY_PRODUCT": "query"}},
    "bf16+stages2": {OUTLIER: {"_KEY_PRODUCT": "query", "_KEY_STAGES": 2}},
    "tile2048": {OUTLIER: {"_TILE_ELEMENTS": 2048}},
    "tile8192": {OUTLIER: {"_TILE_ELEMENTS": 8192}},
    "rows1x256": {GAP: {"_ROW_BLOCK": 1, "_ROW_SPAN": 256}},
    "rows2x256": {GAP: {"_ROW_BLOCK": 2, "_ROW_SPAN": 256}},
    "bf16+tile8192": {OUTLIER: {"_KEY_PRODUCT": "query", "_TILE_ELEMENTS": 8192}},
    "bf16+stages2+tile8192": {OUTLIER: {"_KEY_PRODUCT": "query", "_KEY_STAGES": 2, "_TILE_ELEMENTS": 8192}},
    "bf16+stages2+w2": {OUTLIER: {"_KEY_PRODUCT": "query", "_KEY_STAGES": 2, "_BLOCKS_WARPS": 2}},
    # around the fastest of session 28's first run (bf16+tile8192)
    "bf16+tile8192+rows1x256": {OUTLIER: {"_KEY_PRODUCT": "query", "_TILE_ELEMENTS": 8192},
                                GAP: {"_ROW_BLOCK": 1, "_ROW_SPAN": 256}},
    "bf16+tile8192+w8": {OUTLIER: {"_KEY_PRODUCT": "query", "_TILE_ELEMENTS": 8192, "_BLOCKS_WARPS": 8}},
    "bf16+tile16384": {OUTLIER: {"_KEY_PRODUCT": "query", "_TILE_ELEMENTS": 16384}},
    "bf16+tile16384+w8": {OUTLIER: {"_KEY_PRODUCT": "query", "_TILE_ELEMENTS": 16384, "_BLOCKS_WARPS": 8}},
    # over the shipped settings ("shipped", ...): a register cap, so more programs share an SM (session 36, offline,
    # with fixed_query: 76 registers and 12 KB of shared memory, 6 programs an SM; 64 spill 32 bytes and allow 8)
    "maxnreg96": ("shipped", {OUTLIER: {"_BLOCKS_MAXNREG": 96}}),
    "maxnreg80": ("shipped", {OUTLIER: {"_BLOCKS_MAXNREG": 80}}),
    "maxnreg64": ("shipped", {OUTLIER: {"_BLOCKS_MAXNREG": 64}}),
    # the decode units' means in tiles of 16 dims (session 36; offline 12 KB of shared memory and 76 registers against
    # the whole tile's 28 KB and 104), the default for session 36 only: 26.0 us against the whole tile's 23.5 at
    # 1x128K on an H100 (session 37)
    "decode16": ("shipped", {OUTLIER: {"_DECODE_DIMS": 16}}),
    # the decision in a launch of its own after the blocks launch (before session 38), where the shipped op makes it
    # in the blocks launch's last program of each sequence (up to 16 blocks a row)
    "decide-launch": ("shipped", {OUTLIER: {"_DECIDE_IN_BLOCKS_UP_TO": 0}}),
    # fewer units a block (16 and 32 at D = 128): more programs, each a shorter chain, where a small table's few
    # programs are latency-bound (a 2,304-token context: 3 blocks a row)
    "units16": ("shipped", {OUTLIER: {"_TILE_ELEMENTS": 2048}}),
    "units32": ("shipped", {OUTLIER: {"_TILE_ELEMENTS": 4096}}),
    "units16+decide-launch": ("shipped", {OUTLIER: {"_TILE_ELEMENTS": 2048, "_DECIDE_IN_BLOCKS_UP_TO": 0}}),
    # the follow launch before the blocks launch (before session 39), where the shipped op reads the open unit's add
    # in the blocks launch and makes the follow's writes in the decision
    "follow-launch": ("shipped", {OUTLIER: {"_LEAVING_IN_BLOCKS": False}}),
}


# with --challengers: the settings of a step between measured ones compared (the outlier module's
# constants; "shipped": as they are; "own+loop" is session 30's fourth version, shipped)
CHALLENGER_VARIANTS = {
    "shipped": {},
    "own+loop": {"_BETWEEN_LAUNCH": "own", "_BETWEEN_KEYS": "loop"},
    "own+tile": {"_BETWEEN_LAUNCH": "own", "_BETWEEN_KEYS": "tile"},
    "blocks+loop": {"_BETWEEN_LAUNCH": "blocks", "_BETWEEN_KEYS": "loop"},
    "blocks+tile": {"_BETWEEN_LAUNCH": "blocks", "_BETWEEN_KEYS": "tile"},
}


def settings_of(name: str) -> dict:
    """Variant ``name``'s settings in full: session 27's with its own over them (none for "shipped"; its own
    alone for a ``("shipped", settings)`` variant)."""
    variant = VARIANTS[name]
    if variant is None:
        return {}
    if isinstance(variant, tuple):
        return {module: dict(values) for module, values in variant[1].items()}
    merged = {module: dict(values) for module, values in SESSION27.items()}
    for module, values in variant.items():
        merged.setdefault(module, {}).update(values)
    return merged


def apply(settings: dict) -> dict:
    """Set the module constants ``settings`` names; returns the values they replace."""
    replaced = {}
    for module_name, values in settings.items():
        module = sys.modules[module_name]
        for name, value in values.items():
            if not hasattr(module, name):
                raise SystemExit(f"outlier_blocks: {module_name} has no {name!r}")
            replaced.setdefault(module_name, {})[name] = getattr(module, name)
            setattr(module, name, value)
    return replaced


def kernel_us(fn, steps: int = 5) -> dict[str, float]:
    """GPU microseconds a call of ``fn`` spends in each kernel, by name (the CUDA profiler)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / steps
    return dict(totals)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--query-heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--unit-size", type=int, default=16)
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--only", default="", help=f"comma-separated variants of {', '.join(VARIANTS)}")
    parser.add_argument("--challengers", type=int, default=0, help="also time the trigger with this many "
                        "challengers a query head, a measured step and a step between")
    parser.add_argument("--challenger-variants", default="shipped",
                        help=f"with --challengers, the settings of a step between compared: comma-separated of "
                             f"{', '.join(CHALLENGER_VARIANTS)}")
    parser.add_argument("--fixed-query", action="store_true",
                        help="the trigger's query in fixed point (ScoreGap.fixed_query: int8 products)")
    parser.add_argument("--best-settings", default=None,
                        help="write the fastest variant's settings here, one MODULE.NAME=VALUE a line "
                             "(benchmarks/with_settings.py's arguments)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("outlier_blocks needs a CUDA device", file=sys.stderr)
        return 2
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"outlier_blocks: unknown variants {unknown}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ops = dispatch.bind("triton", device)
    __import__(OUTLIER)
    gen = torch.Generator(device).manual_seed(0)
    prompt_units = args.context // args.unit_size
    states = [decode_trigger_state(gen, args.batch, args.kv_heads, prompt_units, args.unit_size, args.budget,
                                   args.dim, args.outliers) for _ in range(args.layers)]
    queries = [torch.randn(args.batch, args.query_heads, args.dim, generator=gen, device=device).bfloat16()
               for _ in states]
    trigger = ScoreGap(margin=1e9, measure="mass", leaving="ignored", estimate="outlier", outliers=args.outliers,
                       group="each", fixed_query=args.fixed_query)
    trigger.validate()
    scale = args.dim ** -0.5
    reference = copy.deepcopy(states[0])
    want_fire = reference_step.score_gap_outlier_fire(trigger, reference, queries[0], scale)
    # the bytes the blocks kernel must read a layer: each prompt unit's int8 keys and rest mean, their
    # scales, counts and valid flags; each unit's selectable flag, size and held mark
    per_prompt_unit = (args.outliers + 1) * args.dim + 3 * 4 + args.outliers
    table_bytes = args.batch * args.kv_heads * (prompt_units * per_prompt_unit + (prompt_units + 64) * (1 + 8 + 1))
    print(f"score_gap_outlier_fire, {args.batch}x{args.context}, {args.kv_heads} KV heads, {args.query_heads} query "
          f"heads, D={args.dim}, {args.outliers} outliers, {args.layers} layers; blocks kernel reads "
          f"{table_bytes / 1e6:.1f} MB a layer")
    print(f"{'variant':22s} {'us/layer':>9s} {'blocks us':>10s} {'GB/s':>7s} {'other kernels (us/layer)'}")
    timed = {}
    for name in names:
        replaced = apply(settings_of(name))
        try:
            check, again = copy.deepcopy(states[0]), copy.deepcopy(states[0])
            got_fire = ops.score_gap_outlier_fire(trigger, check, queries[0], scale)
            ops.score_gap_outlier_fire(trigger, again, queries[0], scale)
            if not torch.equal(check.gap, again.gap):
                print(f"{name:22s} NOT REPEATABLE: gap {check.gap.tolist()}, then {again.gap.tolist()}")
            if not torch.equal(got_fire, want_fire) or not torch.allclose(check.gap, reference.gap, rtol=1e-4,
                                                                           atol=1e-4):
                print(f"{name:22s} DIFFERS from the reference: gap {check.gap.tolist()} against "
                      f"{reference.gap.tolist()}")
                continue

            def step():
                for state, query in zip(states, queries):
                    ops.score_gap_outlier_fire(trigger, state, query, scale)

            ms = time_replay_ms(step, device, args.repeats)
            timed[name] = ms
            kernels = kernel_us(step)
            blocks = sum(us for k, us in kernels.items() if "blocks" in k) / args.layers
            others = ", ".join(f"{k.strip('_')} {us / args.layers:.1f}" for k, us in sorted(kernels.items())
                               if "blocks" not in k)
            print(f"{name:22s} {1e3 * ms / args.layers:9.1f} {blocks:10.1f} {table_bytes / blocks / 1e3:7.0f} {others}",
                  flush=True)
        finally:
            apply(replaced)
    if args.challengers:
        for variant in args.challenger_variants.split(","):
            if variant not in CHALLENGER_VARIANTS:
                print(f"outlier_blocks: unknown challenger variant {variant!r}; choose from "
                      f"{list(CHALLENGER_VARIANTS)}", file=sys.stderr)
                return 2
            replaced = apply({OUTLIER: CHALLENGER_VARIANTS[variant]})
            try:
                time_challengers(args, states, queries, ops, scale, table_bytes, variant)
            finally:
                apply(replaced)
    if args.best_settings and timed:
        best = min(timed, key=timed.get)
        print(f"fastest: {best}")
        with open(args.best_settings, "w") as out:
            out.writelines(f"{module}.{name}={value!r}\n" for module, values in settings_of(best).items()
                           for name, value in values.items())
    return 0


def time_challengers(args, states, queries, ops, scale: float, table_bytes: int, variant: str) -> None:
    """The op with ``args.challengers`` challengers (at the settings ``variant`` names, already applied):
    a measured step (the challengers cleared
    before each call, so it reads the whole table) and a step between (``every`` so large that no
    timed step is a measured one; the first call lists the challengers). Checked against the reference
    over a measured step and a step between first."""
    for phase in ("whole", "between"):
        trigger = ScoreGap(margin=1e9, measure="mass", leaving="ignored", estimate="outlier", outliers=args.outliers,
                           group="each", every=1 << 20, challengers=args.challengers)
        trigger.validate()
        layers = [copy.deepcopy(state) for state in states]
        reference, check = copy.deepcopy(layers[0]), copy.deepcopy(layers[0])
        for _ in range(2):  # the first lists the challengers (none yet), the second measures against them
            want = reference_step.score_gap_outlier_fire(trigger, reference, queries[0], scale)
            got = ops.score_gap_outlier_fire(trigger, check, queries[0], scale)
            if not torch.equal(got, want) or not torch.allclose(check.gap, reference.gap, rtol=1e-4, atol=1e-4):
                print(f"challengers {variant} {phase}: DIFFERS from the reference: gap {check.gap.tolist()} against "
                      f"{reference.gap.tolist()}")
                return
        for state, query in zip(layers, queries):
            ops.score_gap_outlier_fire(trigger, state, query, scale)  # lists the challengers

        def step():
            for state, query in zip(layers, queries):
                if phase == "whole":
                    state.challengers.fill_(-1)
                ops.score_gap_outlier_fire(trigger, state, query, scale)

        ms = time_replay_ms(step, states[0].held.device, args.repeats)
        kernels = kernel_us(step)
        blocks = sum(us for k, us in kernels.items() if "blocks" in k) / args.layers
        others = ", ".join(f"{k.strip('_')} {us / args.layers:.1f}" for k, us in sorted(kernels.items())
                           if "blocks" not in k)
        label = f"chal {args.challengers} {variant} {phase}"
        print(f"{label:30s} {1e3 * ms / args.layers:9.1f} {blocks:10.1f} {table_bytes / blocks / 1e3:7.0f} {others}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
