"""``kvpolicy bench``: GPU benchmarks. The grids and their rows are ``kvpolicy.bench.sweeps``
(capacity: ``kvpolicy.bench.capacity.measure_capacity``); this module reads the flags, prints each
row as it comes and rewrites ``--json`` after each one.

    kvpolicy bench layer --presets louiskv,arkvale@cpu --contexts 131072 --batches 1,4
    kvpolicy bench e2e --contexts 32768,131072 --batches 1,4 --json e2e.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..bench import BUDGET, LOUISKV_RATE
from ..errors import KVPolicyError
from .common import add_plugin_flag, check_writable, device_name, floats, ints


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="GPU benchmarks: one decode layer's time split, the pool gather's bandwidth, "
                                          "TTFT, end-to-end decode, capacity (largest batch, KV over GPU + host)")
    bench.add_argument("what", choices=["layer", "gather", "ttft", "e2e", "capacity"])
    bench.add_argument("--steps", type=int, default=50, help="e2e: timed decode steps per cell")
    bench.add_argument("--contexts", default=None,
                       help="comma-separated context lengths (layer: 32768,131072,524288; ttft: 2048 to 65536; "
                            "capacity: 131072)")
    bench.add_argument("--layers", type=int, default=36, help="ttft: layers of the random Qwen3-8B-shaped model")
    bench.add_argument("--batches", default="1,4,8")
    bench.add_argument("--budget", type=int, default=BUDGET)
    bench.add_argument("--presets", default="louiskv,quest,arkvale",
                       help="comma-separated presets; NAME@PLACEMENT runs that preset at that placement only "
                            "(e.g. louiskv,arkvale@cpu)")
    bench.add_argument("--placements", default="cpu,gpu",
                       help="where the full KV lives: cpu (pinned), gpu, or split (the GPU while it has room, then "
                            "pinned host memory: a context neither holds alone, as 1M tokens at batch 1 on an H200)")
    bench.add_argument("--decode-steps", type=int, default=1024,
                       help="layer: generated tokens the index has room for (its capacity is what selection ranks)")
    bench.add_argument("--eager", action="store_true",
                       help="layer, gather: time each part (each call) launched from Python (default on a GPU: as a "
                            "CUDA-graph replay)")
    bench.add_argument("--runs", default="1,16", help="gather: consecutive rows per run (1: random rows; 16: a "
                       "unit of the unit-ordered pool)")
    bench.add_argument("--gather-ops", default="gather,refresh",
                       help="gather: comma-separated ops timed (gather: gather_rows_into; refresh: refresh_rows, "
                            "keys and values, as a decode step's fetch)")
    bench.add_argument("--resident", default="0",
                       help="gather: comma-separated shares of refresh's rows already in the buffer (not read from the "
                            "pool), as an overlapping re-selection finds them; default 0 (every row crosses)")
    bench.add_argument("--full-kinds", default="full-graph,full-sdpa-graph,full-eager",
                       help="e2e: which full-attention baselines run (full-graph always runs: ratios are against it)")
    bench.add_argument("--backend", default="triton", help="kernel backend: reference or triton")
    bench.add_argument("--branches", default="auto",
                       help="e2e: comma-separated DecodeGraph branch kinds each policy row runs with (auto, node: "
                            "the re-selection as a CUDA graph conditional node; inline: kernels that exit at once)")
    bench.add_argument("--unit-cache-rows", type=int, default=None,
                       help="e2e: the policies' GPU unit cache, rows per sequence and KV head (0: none; default: "
                            "sized where a pool is in host memory)")
    bench.add_argument("--rate", type=float, default=LOUISKV_RATE,
                       help=f"LouisKV's re-selection share for the amortised column (default: {100 * LOUISKV_RATE:.1f}%%, measured "
                            "on SmolLM2's 4K needles, budget 512, with the preset's trigger; EVAL.md)")
    bench.add_argument("--stickiness", default="0",
                       help="e2e: comma-separated per-unit score biases for louiskv's re-selecting rows (bench/overlap.py: "
                            "random weights select afresh, a bias makes successive selections overlap as a real model's do; "
                            "each row's miss column says how much); default 0")
    bench.add_argument("--query-pull", default="0",
                       help="e2e: comma-separated pulls for pariskv's rows: its selection's query moved towards a fixed "
                            "direction by that many times its norm (bench/overlap.py), so selections overlap as a real "
                            "model's do; default 0")
    bench.add_argument("--kmeans", action="store_true",
                       help="cluster with real K-means (default: random units of 16 tokens, same sizes and scatter)")
    bench.add_argument("--repeats", type=int, default=30)
    bench.add_argument("--compiled-layers", action="store_true",
                       help="e2e, capacity: compile each decoder layer's MLP and RMSNorms (torch.compile), which "
                            "lowers the floor for full attention and the policies alike")
    bench.add_argument("--device", default=None)
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    add_plugin_flag(bench)


class BenchRows(list):
    """A bench run's rows, rewritten to the JSON file (if any) after each one: a run cut short by a
    time limit keeps the rows it measured."""

    def __init__(self, path: str | None, meta: dict):
        super().__init__()
        self.path, self.meta = path, meta

    def append(self, row: dict) -> None:
        super().append(row)
        if self.path:
            # a whole new file, then renamed over the old one: a run killed mid-write keeps the last
            path = Path(self.path)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps({"meta": self.meta, "rows": list(self)}, indent=2, default=str),
                               encoding="utf-8")
            partial.replace(path)


# where a benchmark may put the pools; one layer alone has no split to make
PLACEMENTS = ("cpu", "gpu", "split")
LAYER_PLACEMENTS = ("cpu", "gpu")


def preset_placements(args, accepted: tuple[str, ...] = PLACEMENTS) -> list[tuple[str, list[str]]]:
    """``--presets`` with each preset's placements: ``--placements``, or the one after ``NAME@``."""
    default = [p for p in args.placements.split(",") if p]
    for placement in default:
        if placement not in accepted:
            raise KVPolicyError(f"--placements takes {', '.join(accepted)}, got {placement!r}")
    cells = []
    for entry in (p for p in args.presets.split(",") if p):
        name, at, placement = entry.partition("@")
        if not name:
            raise KVPolicyError(f"--presets entry {entry!r} names no preset (NAME or NAME@PLACEMENT)")
        if at and placement not in accepted:
            raise KVPolicyError(f"--presets entry {entry!r}: the placement after '@' must be one of {', '.join(accepted)}")
        cells.append((name, [placement] if at else default))
    return cells


def bench_model(args, device):
    """The random Qwen3-8B-shaped model of ``bench e2e`` / ``capacity`` (``--compiled-layers``: its
    MLPs and RMSNorms compiled, for every row alike)."""
    from ..bench.ttft import qwen3_8b_config, random_model

    model = random_model(qwen3_8b_config(layers=args.layers), device)
    if args.compiled_layers:
        from ..bench.compiled_layers import compile_mlp_and_norms

        routed = compile_mlp_and_norms(model)
        print(f"--compiled-layers: {routed} MLP and RMSNorm modules run compiled (full attention and policies alike)")
    return model


def main(args) -> int:
    import torch

    from ..kernels import dispatch

    device = torch.device(device_name(args))
    if args.what == "capacity" and device.type != "cuda":
        raise KVPolicyError(f"bench capacity sizes its batches from GPU and pinned host memory, so it needs a CUDA "
                            f"--device; got {device}")
    if args.what == "capacity" and "," in args.branches:
        raise KVPolicyError(f"bench capacity runs one --branches kind (auto, node or inline), got {args.branches!r}")
    dispatch.check(args.backend, device)
    if device.type != "cuda":
        print("kvpolicy bench: no CUDA device; timings on the CPU say nothing about the GPU path", file=sys.stderr)
    # a bad --presets or --placements fails before any model is built
    preset_placements(args, LAYER_PLACEMENTS if args.what == "layer" else PLACEMENTS)
    check_writable(args.json, "--json")
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "sub_plugin"}}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = BenchRows(args.json, meta)
    run = {"e2e": e2e, "capacity": capacity, "ttft": ttft, "gather": gather, "layer": layer}[args.what]
    return 1 if run(args, device, rows) else 0


def e2e(args, device, rows: BenchRows) -> bool:
    """``bench e2e``; True if a cell failed."""
    from .. import graph_branch
    from ..bench import sweeps

    full_kinds = [k for k in args.full_kinds.split(",") if k]
    unknown = set(full_kinds) - set(sweeps.FULL_KINDS)
    if unknown:
        raise SystemExit(f"kvpolicy bench e2e: unknown --full-kinds {', '.join(sorted(unknown))}; "
                         "accepted: " + ", ".join(sweeps.FULL_KINDS))
    branch_kinds = [k for k in args.branches.split(",") if k]
    for kind in branch_kinds:
        graph_branch.resolve(kind, device, emulate=device.type != "cuda")  # a bad kind fails before the model loads
    stickiness, pulls = floats(args.stickiness, "stickiness"), floats(args.query_pull, "query-pull")  # so do these
    model = bench_model(args, device)
    every = sweeps.louiskv_interval(args.rate)
    print(f"louiskv's trigger runs as interval({every}) = {100 / every:.1f}% re-selection (measured rate "
          f"{100 * args.rate:.1f}%), and as every_step (worst case)")
    print(f"budget-floor: full-graph at the {args.budget}-token context a step of the budget attends (sink + "
          "retrieved + local), the best any policy can do on this stack; 'over floor' is a row's ms above it. "
          "louiskv's /reuse row never re-selects after its first step (a reusing step alone), /score_gap_reuse "
          "is the same with the preset's SmolLM2 trigger, score_gap (its step cost), /score_gap_exact_reuse that "
          "trigger with exact products (the preset's query is in fixed point), /score_gap_every2_reuse that "
          "trigger measuring at one step in two, /every_step re-selects at every step")
    interval_steps = sweeps.whole_intervals(args.steps, every)
    if interval_steps != args.steps:
        print(f"louiskv's /interval rows time {interval_steps} steps ({interval_steps // every} whole intervals), "
              f"the other rows {args.steps}")
    print("miss: of the rows a policy's re-selections fetched after its first, the share read from the pool "
          "(neither the retrieved buffer nor the unit cache held them; random weights select afresh each time; "
          "a pool in GPU memory is read whole, 1.00); ~sN: louiskv's unit scores biased by up to N per unit "
          "(--stickiness), ~pN: pariskv's query pulled by N times its norm (--query-pull), so selections overlap more")
    print(f"{'kind':28s} {'B':>2s} {'context':>8s} {'ms/step':>8s} {'tokens/s':>9s} {'vs full-graph':>13s} "
          f"{'over floor':>10s} {'miss':>5s}")
    failed = False
    for row in sweeps.e2e(model, contexts=ints(args.contexts or "32768,131072", "contexts"),
                          batches=ints(args.batches, "batches"), cells=preset_placements(args), budget=args.budget,
                          steps=args.steps, backend=args.backend, full_kinds=full_kinds, branch_kinds=branch_kinds,
                          rate=args.rate, unit_cache_rows=args.unit_cache_rows,
                          stickiness=stickiness, pulls=pulls):
        if "error" in row:
            if row.get("traceback"):
                print(row["traceback"], end="", file=sys.stderr)
            failed = failed or bool(row.get("failed"))
            print(f"{row['kind']:28s} {row['batch']:2d} {row['context']:8d}   {row['error']}", flush=True)
            continue
        rows.append(row)
        speedup, over = row["speedup_vs_full_graph"], row["over_floor_ms"]
        ratio = f"{speedup:13.2f}" if speedup else ""
        over_text = f"{over:10.2f}" if over is not None else ""
        miss = row.get("miss_fraction")
        miss_text = f" {miss:5.2f}" if miss is not None else ""
        print(f"{row['kind']:28s} {row['batch']:2d} {row['context']:8d} {row['ms_per_step']:8.2f} "
              f"{row['tokens_per_s']:9.1f} {ratio} {over_text}{miss_text}", flush=True)
    return failed


def capacity(args, device, rows: BenchRows) -> bool:
    """``bench capacity``: full-graph at its largest batch against louiskv/split at its own."""
    from ..bench.capacity import measure_capacity
    from ..bench.sweeps import louiskv_interval
    from ..policy import bytes_text

    contexts = ints(args.contexts or "131072", "contexts")
    model = bench_model(args, device)
    every = louiskv_interval(args.rate)
    print(f"full-graph at the largest batch whose KV fits on the GPU, against louiskv (budget {args.budget}, "
          f"interval({every}) = {100 / every:.1f}% re-selection, {'K-means' if args.kmeans else 'random-group'} "
          "prompt units) at the largest batch whose KV fits on the GPU and pinned host memory (placement split)",
          flush=True)

    def show(r) -> None:
        rows.append(r.as_dict())
        ms = f"{r.ms_per_step:8.2f}" if r.ms_per_step is not None else f"{'-':>8s}"
        tps = f"{r.tokens_per_s:9.1f}" if r.tokens_per_s is not None else f"{'-':>9s}"
        ratio = f"{r.speedup_vs_full:8.2f}" if r.speedup_vs_full is not None else f"{'-':>8s}"
        layers = "-" if r.pool_device_layers is None else str(r.pool_device_layers)
        print(f"{r.kind:14s} {r.batch:3d} {r.planned_batch:7d} {r.context:8d} {ms} {tps} {ratio} "
              f"{bytes_text(r.pool_device_bytes):>11s} {bytes_text(r.pool_host_bytes):>9s} {layers:>10s}", flush=True)

    header = (f"{'kind':14s} {'B':>3s} {'planned':>7s} {'context':>8s} {'ms/step':>8s} {'tokens/s':>9s} "
              f"{'vs full':>8s} {'pool on GPU':>11s} {'pinned':>9s} {'GPU layers':>10s}")
    for context in contexts:
        first = []

        def on_row(r) -> None:
            if not first:
                print(header, flush=True)
                first.append(True)
            show(r)

        measure_capacity(model, context, args.steps, budget=args.budget, backend=args.backend, rate=args.rate,
                         kmeans=args.kmeans, branches=args.branches, say=lambda message: print(message, flush=True),
                         on_row=on_row)
    return False


def ttft(args, device, rows: BenchRows) -> bool:
    """``bench ttft``: time to first token, full attention and each preset."""
    from ..bench import sweeps
    from ..bench.ttft import qwen3_8b_config, random_model

    lengths = ints(args.contexts or "2048,4096,8192,16384,32768,65536", "contexts")
    model = random_model(qwen3_8b_config(layers=args.layers), device)
    print(f"{'preset':9s} {'pool':4s} {'B':>2s} {'length':>7s} {'TTFT ms':>9s} {'vs full':>8s} {'units ready ms':>15s}")
    for row in sweeps.ttft(model, lengths=lengths, batches=ints(args.batches, "batches"), cells=preset_placements(args),
                           budget=args.budget, backend=args.backend, repeats=args.repeats):
        rows.append(row)
        ready = "" if row["units_ready_ms"] is None else f"{row['units_ready_ms']:15.1f}"
        print(f"{row['preset']:9s} {row['placement'] or '-':4s} {row['batch']:2d} {row['length']:7d} "
              f"{row['ttft_ms']:9.1f} {row['vs_full']:8.3f} {ready}", flush=True)
    return False


def gather(args, device, rows: BenchRows) -> bool:
    """``bench gather``: each op's bandwidth (``gather_rows_into``, ``refresh_rows``) from the pool
    against a pinned copy of as many bytes, timed as graph replays on a GPU unless ``--eager``."""
    from ..bench import sweeps
    from ..bench.gather import OPS

    ops = [op.strip() for op in args.gather_ops.split(",")]
    if not ops or any(op not in OPS for op in ops):
        raise KVPolicyError(f"--gather-ops: {args.gather_ops!r}; accepted: a comma-separated list of {', '.join(OPS)}")
    replay = device.type == "cuda" and not args.eager
    if replay and args.backend == "reference":
        raise KVPolicyError("bench gather --backend reference on a GPU reads the pinned pool on the host, which a CUDA "
                          "graph cannot capture: pass --eager, or --backend triton or auto")
    resident = floats(args.resident, "resident")
    if any(not 0.0 <= share <= 1.0 for share in resident):
        raise KVPolicyError(f"--resident takes shares in [0, 1], got {args.resident!r}")
    header = (f"{'op':>7s} {'batch':>5s} {'rows/head':>9s} {'run':>4s} {'resident':>8s} {'ms':>7s} {'GB/s':>7s} "
              f"{'copy GB/s':>9s} {'ratio':>6s}")
    print(f"each call timed {'as a CUDA-graph replay' if replay else 'eagerly (launched from Python)'}")
    if device.type != "cuda":
        print(header)
    for row in sweeps.gather(device, batches=ints(args.batches, "batches"), runs=ints(args.runs, "runs"),
                             rows=args.budget, backend=args.backend, repeats=args.repeats, ops=ops, replay=replay,
                             resident=resident):
        rows.append(row)
        if "pinned_allocation" in row:
            a = row["pinned_allocation"]
            print(f"pinned host memory, {a['bytes'] >> 20} MiB: first allocation {a['first_ms']:.1f} ms, again after "
                  f"free {a['again_ms']:.1f} ms, GPU->pinned copy {a['copy_ms']:.2f} ms", flush=True)
            print(header)
            continue
        print(f"{row['op']:>7s} {row['batch']:5d} {row['rows']:9d} {row['run']:4d} {row['resident']:8.2f} "
              f"{row['call_ms']:7.3f} {row['gather_gbps']:7.1f} {row['copy_gbps']:9.1f} {row['ratio']:6.2f}", flush=True)
    return False


def layer(args, device, rows: BenchRows) -> bool:
    """``bench layer``: one decode layer's time split per preset and placement."""
    from ..bench import sweeps

    replay = device.type == "cuda" and not args.eager
    print(f"each part timed {'as a CUDA-graph replay' if replay else 'eagerly (launched from Python)'}")
    print(f"{'preset':9s} {'pool':4s} {'B':>2s} {'context':>8s} {'trigger':>8s} {'select':>8s} {'transfer':>9s} "
          f"{'attn':>7s} {'reselect':>9s} {'reuse':>7s} {'amortised':>9s} {'full':>7s}   (ms)")
    for row in sweeps.layer(device, contexts=ints(args.contexts or "32768,131072,524288", "contexts"),
                            batches=ints(args.batches, "batches"), cells=preset_placements(args, LAYER_PLACEMENTS),
                            budget=args.budget, backend=args.backend, rate=args.rate, random_units=not args.kmeans, repeats=args.repeats,
                            replay=replay, decode_steps=args.decode_steps):
        rows.append(row)
        full = "" if row["full_sdpa_ms"] is None else f"{row['full_sdpa_ms']:7.3f}"
        print(f"{row['preset']:9s} {row['placement']:4s} {row['batch']:2d} {row['context']:8d} {row['trigger_ms']:8.3f} "
              f"{row['selection_ms']:8.3f} {row['transfer_ms']:9.3f} {row['attention_ms']:7.3f} "
              f"{row['reselect_ms']:9.3f} {row['reuse_ms']:7.3f} {row['amortised_ms']:9.3f} {full}", flush=True)
    return False
