"""Where louiskv's (and pariskv's) time to first token goes, and what cheaper K-means buys.

Five parts, on one GPU (Qwen3-8B shape: 8 KV heads, head_dim 128, 36 layers, batch 1, bf16):

1. ``kmeans`` alone, per layer, at each context (C = n / 16 clusters), for each K-means variant
   ``INIT/ITERS/PRECISION`` (``kvpolicy/units/kmeans.py``: init "spaced" or "pages", precision
   "split" or "bf16"): median ms per layer (CUDA events), x layers, the assignment's FLOP and
   its TFLOP/s; then, at the largest context, device time by kernel (torch.profiler) for the
   first and the last variant.
2. Host syncs during one prefill (``torch.cuda.set_sync_debug_mode``), by source line, for full
   attention and each preset; then again with the "no-sync" experiment (below).
3. TTFT (``kvpolicy.bench.ttft.time_first_token``: until the first token is on the host and every
   layer's units are ready) for full attention, louiskv at each K-means variant, louiskv with
   ``pages`` units (no K-means at all: the floor any K-means change can reach), and pariskv; with
   the host time spent inside the policy's per-layer prefill (sum over layers).
4. The same rows under the "no-sync" experiment: ``torch.tensor(<python int>, device=cuda)`` in
   ``kvpolicy.store``, ``kvpolicy.units.table`` and ``kvpolicy.units.analytic_index`` (one per layer
   each: ``next_slot``, ``order_next``, ``next_position``/``indexed``) is a pageable host-to-device
   copy that torch follows with ``cudaStreamSynchronize``, so the host waits for the layer's
   work (on the side stream: its K-means) before it can queue the next layer. The experiment
   swaps those modules' ``torch.tensor`` for ``torch.full((), value)`` (a fill kernel, no sync)
   for the duration of the rows; it changes no file. If it helps, the owners of those files
   make the same change.
5. ``profile``: device time by kernel over one prefill of ``--census-length`` tokens for full
   attention and each row of part 3, so a policy's time over full attention's is named.

A variant ``INIT/ITERS/PRECISION/SEGMENT`` clusters runs of at most SEGMENT tokens on their own
(``KMeans(segment_tokens=SEGMENT)``). Run settings may follow a variant: ``@pN`` builds the units on
a side stream of CUDA priority N (-1, the default since session 18; ``@p0`` the CUDA default), ``+fuse``
/ ``-fuse`` K-means' update inside its assignment (the default) or in a launch of its own (e.g.
``spaced/8/split@p0-fuse``: session 17's settings); SEGMENT ``whole`` clusters the whole prompt.

Usage (GPU, about 5-8 minutes with the defaults)::

    python3 benchmarks/kmeans_ttft.py --json kmeans_ttft.json
    python3 benchmarks/kmeans_ttft.py --parts kernel --contexts 32768,65536

``--smoke`` runs every part at a tiny size on the CPU (a small Qwen3 config, 2 layers, 256
tokens; the Triton kernels need ``TRITON_INTERPRET=1``) to check that it runs; its figures mean
nothing: ``TRITON_INTERPRET=1 python3 benchmarks/kmeans_ttft.py --smoke``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter

import torch

from kvpolicy.bench.timing import time_ms
from kvpolicy.bench.ttft import qwen3_8b_config, random_model, time_first_token
from kvpolicy.kernels import dispatch
from kvpolicy.layer import PolicyLayerState
from kvpolicy.presets import preset
from kvpolicy.units import KMeans

DEFAULT_VARIANTS = "spaced/8/split,spaced/8/bf16,pages/3/split,pages/2/split,pages/2/bf16,pages/1/bf16"
DEFAULT_TTFT_VARIANTS = "spaced/8/split,pages/2/split,pages/2/bf16"


def split_settings(text: str) -> tuple[str, dict]:
    """A variant's run settings, written after it: ``+fuse`` / ``-fuse`` (the Triton K-means adds
    the keys into the sums inside its assignment or in a launch of its own, ``FUSE_UPDATE``, on by
    default) and ``@pN`` (the side stream that builds the prompt's units at CUDA priority N,
    ``layer.SIDE_STREAM_PRIORITY``; -1 by default, 0 the CUDA default). Returns the variant without
    them, and the settings."""
    settings = {}
    for flag, fuse in (("+fuse", True), ("-fuse", False)):
        if flag in text:
            text, settings["fuse"] = text.replace(flag, ""), fuse
    if "@p" in text:
        text, priority = text.split("@p", 1)
        settings["priority"] = int(priority)
    return text, settings


@contextlib.contextmanager
def applied(settings: dict):
    """Run under a variant's settings (``split_settings``), restored after."""
    from kvpolicy import layer
    from kvpolicy.kernels.triton import kmeans as triton_kmeans

    saved = layer.SIDE_STREAM_PRIORITY, triton_kmeans.FUSE_UPDATE
    layer.SIDE_STREAM_PRIORITY = settings.get("priority", saved[0])
    triton_kmeans.FUSE_UPDATE = settings.get("fuse", saved[1])
    try:
        yield
    finally:
        layer.SIDE_STREAM_PRIORITY, triton_kmeans.FUSE_UPDATE = saved


def label_settings(label: str) -> dict:
    """The run settings of a row labelled ``louiskv[VARIANT]`` (none for other rows)."""
    if not label.startswith("louiskv[") or not label.endswith("]"):
        return {}
    return split_settings(label[len("louiskv["):-1])[1]


def parse_variant(text: str) -> dict:
    """``INIT/ITERS/PRECISION[/SEGMENT]``: KMeans' options (``segment_tokens`` when SEGMENT is given,
    None for ``whole``; else KMeans' default); run settings after it (``split_settings``) are left out."""
    text, _ = split_settings(text)
    parts = text.split("/")
    if len(parts) not in (3, 4):
        raise SystemExit(f"a K-means variant is INIT/ITERS/PRECISION[/SEGMENT] (e.g. pages/2/bf16, "
                         f"spaced/8/split/8192), got {text!r}")
    variant = {"init": parts[0], "iters": int(parts[1]), "precision": parts[2]}
    if len(parts) == 4:  # "whole": the whole prompt at once (segment_tokens None)
        variant["segment_tokens"] = None if parts[3] == "whole" else int(parts[3])
    return variant


def variant_labels(variant: dict, keys, valid, ops):
    """The variant's prompt labels, as the louiskv preset's KMeans builder makes them."""
    return KMeans(tokens_per_cluster=16, **variant).build_labels(keys, valid, ops)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- part 1


def assignment_flop(n: int, clusters: int, heads: int, dim: int, iters: int, precision: str,
                    segment_tokens: int | None = None) -> float:
    dots = 1 if precision == "bf16" else 2  # bf16 keys: x.hi (+ x.lo with "split")
    if segment_tokens is not None and n > segment_tokens:
        clusters = -(-clusters // -(-n // segment_tokens))  # each token meets only its segment's clusters
    return 2.0 * n * clusters * dim * heads * dots * iters


def kernel_times(device, backend, contexts, variants, heads, dim, layers, repeats) -> list[dict]:
    ops = dispatch.bind(backend, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    print(f"\n== 1. kmeans per layer ({heads} KV heads x {dim} dims, {dtype}, C = n/16), backend {backend}")
    print(f"{'n':>7s} {'variant':>15s} {'ms/layer':>9s} {'x' + str(layers) + ' ms':>9s} {'assign TFLOP':>12s} "
          f"{'TFLOP/s':>8s} {'vs first':>8s}")
    for n in contexts:
        gen = torch.Generator(device="cpu").manual_seed(n)
        keys = torch.randn(1, heads, n, dim, generator=gen).to(device=device, dtype=dtype)
        valid = torch.ones(1, n, dtype=torch.bool, device=device)
        valid[:, :4] = False  # the sink is not clustered
        clusters = -(-n // 16)
        first = None
        for name in variants:
            v = parse_variant(name)
            with applied(split_settings(name)[1]):
                ms = time_ms(lambda: variant_labels(v, keys, valid, ops), device, repeats=repeats, warmup=1)
            flop = assignment_flop(n, clusters, heads, dim, v["iters"], v["precision"],
                                   v.get("segment_tokens", KMeans.segment_tokens))
            first = ms if first is None else first
            rows.append({"n": n, "variant": name, "ms_per_layer": ms, "ms_all_layers": ms * layers,
                         "assign_flop": flop, "tflops": flop / ms / 1e9 if ms > 0 else None})
            rate = f"{flop / ms / 1e9:8.1f}" if ms > 0 and flop else f"{'-':>8s}"
            print(f"{n:7d} {name:>15s} {ms:9.3f} {ms * layers:9.1f} {flop * layers / 1e12:12.2f} {rate} "
                  f"{ms / first:8.3f}", flush=True)
        del keys, valid
    return rows


def _device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def kernel_breakdown(device, backend, n, variants, heads, dim) -> list[dict]:
    if device.type != "cuda":
        print("\n(kernel breakdown: CUDA only, skipped)")
        return []
    from torch.profiler import ProfilerActivity, profile

    ops = dispatch.bind(backend, device)
    keys = torch.randn(1, heads, n, dim, device=device, dtype=torch.bfloat16)
    valid = torch.ones(1, n, dtype=torch.bool, device=device)
    rows = []
    for name in variants:
        v = parse_variant(name)
        call = lambda: variant_labels(v, keys, valid, ops)  # noqa: E731
        with applied(split_settings(name)[1]):
            call()
            _sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                _sync(device)
        table = sorted(((e.key, _device_us(e), e.count) for e in prof.key_averages()), key=lambda r: -r[1])
        print(f"\n-- device time by kernel, n={n}, {name} (one call, one layer)")
        for key, us, count in table[:12]:
            if us <= 0:
                continue
            print(f"  {us / 1e3:8.3f} ms  x{count:<3d} {key[:90]}")
            rows.append({"n": n, "variant": name, "kernel": key, "ms": us / 1e3, "count": count})
    return rows


# ---------------------------------------------------------------------------------------- part 2/4


class _NoScalarSyncTorch:
    """``torch`` as the patched modules see it: ``tensor(<python scalar>, device=cuda)`` becomes a
    fill kernel instead of a pageable copy followed by a stream sync; everything else is torch."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, dtype=None, device=None, **kwargs):
        if (not args and not kwargs and device is not None and torch.device(device).type == "cuda"
                and isinstance(data, (int, float)) and not isinstance(data, bool)):
            if dtype is None:
                dtype = torch.long if isinstance(data, int) else torch.get_default_dtype()
            return torch.full((), data, dtype=dtype, device=device)
        return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)


_PATCHED_MODULES = ("kvpolicy.store", "kvpolicy.units.table", "kvpolicy.units.analytic_index")


@contextlib.contextmanager
def no_scalar_sync(enabled: bool = True):
    if not enabled:
        yield
        return
    modules = [sys.modules[name] for name in _PATCHED_MODULES if name in sys.modules]
    saved = [m.torch for m in modules]
    proxy = _NoScalarSyncTorch()
    for m in modules:
        m.torch = proxy
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.torch = original


def sync_census(model, policies: dict, length: int, nosync: bool) -> list[dict]:
    device = next(model.parameters()).device
    if device.type != "cuda":
        print("\n(sync census: CUDA only, skipped)")
        return []
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    mask = torch.ones_like(ids)
    from kvpolicy.integrations.transformers import cache_argument_name

    rows = []
    print(f"\n== 2. host syncs during one prefill of {length} tokens{' (no-sync experiment)' if nosync else ''}")
    for label, policy in policies.items():
        found: Counter = Counter()

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
            ours = [f for f in frames if "kvpolicy" in f.filename] or frames[-1:]
            where = " <- ".join(f"{f.filename.split('/kvpolicy/')[-1]}:{f.lineno}" for f in reversed(ours[-3:]))
            found[where] += 1

        with torch.inference_mode(), policy.apply(model) as session, no_scalar_sync(nosync):
            cache = session.new_cache()
            _sync(device)
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = hook
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                          **{cache_argument_name(model): cache})
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            _sync(device)
            del cache
        total = sum(found.values())
        print(f"-- {label}: {total} syncs")
        for where, count in found.most_common(10):
            print(f"  {count:5d}  {where}")
            rows.append({"policy": label, "nosync": nosync, "where": where, "count": count})
        if not found:
            rows.append({"policy": label, "nosync": nosync, "where": None, "count": 0})
    return rows


# ---------------------------------------------------------------------------------------- part 5


def prefill_profile(model, policies: dict, length: int, top: int = 15) -> list[dict]:
    """Device time by kernel over one prefill of ``length`` tokens (after a warm-up), per policy:
    where a policy's TTFT goes beyond full attention's."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        print("\n(prefill profile: CUDA only, skipped)")
        return []
    from torch.profiler import ProfilerActivity, profile

    from kvpolicy.integrations.transformers import PolicyCache, cache_argument_name

    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    mask = torch.ones_like(ids)
    rows = []
    print(f"\n== 5. device time by kernel over one prefill of {length} tokens (units ready)")
    for label, policy in policies.items():
        with torch.inference_mode(), applied(label_settings(label)), policy.apply(model) as session:
            def prefill():
                cache = session.new_cache()
                model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                      **{cache_argument_name(model): cache})
                if isinstance(cache, PolicyCache):
                    for state in cache.policy_layers():
                        state.wait_for_units()
                _sync(device)

            prefill()
            started = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                prefill()
            wall = 1e3 * (time.perf_counter() - started)
        events = [e for e in prof.key_averages() if _device_us(e) > 0 and e.device_type.name == "CUDA"]
        table = sorted(((e.key, _device_us(e), e.count) for e in events), key=lambda r: -r[1])
        total = sum(us for _, us, _ in table) / 1e3
        print(f"-- {label}: {total:.1f} ms of kernel time, {wall:.1f} ms wall (under the profiler)")
        for key, us, count in table[:top]:
            print(f"  {us / 1e3:8.2f} ms  x{count:<5d} {key[:90]}")
        rows += [{"policy": label, "length": length, "kernel": key, "ms": us / 1e3, "count": count}
                 for key, us, count in table]
        rows.append({"policy": label, "length": length, "kernel": "(total)", "ms": total, "wall_ms": wall})
    print_beyond_full(rows, top)
    return rows


def print_beyond_full(rows: list[dict], top: int) -> None:
    """Per policy, the kernels whose device time most exceeds full attention's (by kernel name)."""
    full = {r["kernel"]: r for r in rows if r["policy"] == "full" and r["kernel"] != "(total)"}
    for label in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        mine = [r for r in rows if r["policy"] == label and r["kernel"] != "(total)"]
        extra = sorted(((r["ms"] - full.get(r["kernel"], {}).get("ms", 0.0), r) for r in mine), key=lambda e: -e[0])
        print(f"-- {label}: kernels beyond full attention's (ms more, calls here / in full)")
        for more, r in extra[:top]:
            if more <= 0:
                break
            print(f"  {more:8.2f} ms  x{r['count']:<5d}/{full.get(r['kernel'], {}).get('count', 0):<5d} {r['kernel'][:90]}")


# ---------------------------------------------------------------------------------------- part 3


@contextlib.contextmanager
def prefill_host_clock():
    """Sum of host seconds spent in ``PolicyLayerState.prefill`` (every layer, every call)."""
    spent = [0.0]
    original = PolicyLayerState.prefill

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    PolicyLayerState.prefill = timed
    try:
        yield spent
    finally:
        PolicyLayerState.prefill = original


def ttft_policies(args, placement: str) -> dict:
    common = {"budget": args.budget, "placement": placement, "backend": args.backend}
    out = {}
    for name in args.ttft_variants.split(","):
        v = parse_variant(name)
        out[f"louiskv[{name}]"] = preset("louiskv", prefill_units={"name": "kmeans", "tokens_per_cluster": 16, **v},
                                          **common)
    out["louiskv[pages units]"] = preset("louiskv", prefill_units={"name": "pages", "size": 16}, **common)
    if not args.no_pariskv:
        out["pariskv"] = preset("pariskv", **common)
    return out


def ttft_rows(model, args, contexts, nosync_modes) -> list[dict]:
    rows = []
    print(f"\n== 3/4. TTFT, batch 1, budget {args.budget}, repeats {args.repeats} (median; a warm-up first)")
    print(f"{'policy':28s} {'pool':4s} {'nosync':6s} {'length':>7s} {'TTFT ms':>9s} {'vs full':>8s} "
          f"{'units ready':>11s} {'prefill host ms':>15s}")
    for length in contexts:
        full = time_first_token(model, preset("full"), 1, length, repeats=args.repeats)
        rows.append({"policy": "full", "placement": None, "nosync": False, "length": length,
                     "ttft_ms": full.ttft_ms, "vs_full": 1.0, "units_ready_ms": None, "prefill_host_ms": None})
        print(f"{'full':28s} {'-':4s} {'-':6s} {length:7d} {full.ttft_ms:9.1f} {1.0:8.3f}", flush=True)
        for placement in args.placements.split(","):
            for nosync in nosync_modes:
                for label, policy in ttft_policies(args, placement).items():
                    with no_scalar_sync(nosync), applied(label_settings(label)), prefill_host_clock() as spent:
                        r = time_first_token(model, policy, 1, length, repeats=args.repeats)
                    host_ms = 1e3 * spent[0] / (args.repeats + 1)  # per prefill (the warm-up included)
                    ready = r.units_ready_ms if r.units_ready_ms is not None else r.ttft_ms
                    rows.append({"policy": label, "placement": placement, "nosync": nosync, "length": length,
                                 "ttft_ms": r.ttft_ms, "vs_full": ready / full.ttft_ms,
                                 "units_ready_ms": r.units_ready_ms, "prefill_host_ms": host_ms})
                    print(f"{label:28s} {placement:4s} {str(nosync):6s} {length:7d} {r.ttft_ms:9.1f} "
                          f"{ready / full.ttft_ms:8.3f} {ready:11.1f} {host_ms:15.1f}", flush=True)
    print("(vs full: units ready / full's TTFT, the issue's measure; TTFT ms: first token on the host)")
    return rows


# ---------------------------------------------------------------------------------------- main


def smoke_model(device):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         use_sliding_window=False, tie_word_embeddings=False)
    return random_model(config, device, dtype=torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="kernel,syncs,ttft", help="comma-separated: kernel, syncs, ttft, profile")
    p.add_argument("--contexts", default="2048,8192,32768,65536", help="kernel and TTFT contexts")
    p.add_argument("--ttft-contexts", default=None, help="TTFT contexts (default: --contexts)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="part 1: K-means variants INIT/ITERS/PRECISION")
    p.add_argument("--ttft-variants", default=DEFAULT_TTFT_VARIANTS, help="part 3: louiskv's K-means variants")
    p.add_argument("--placements", default="gpu", help="TTFT pools: gpu and/or cpu (pinned)")
    p.add_argument("--nosync", default="off,on", help="TTFT rows without / with the no-sync experiment")
    p.add_argument("--no-pariskv", action="store_true")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--repeats", type=int, default=2, help="TTFT runs per row after a warm-up (median)")
    p.add_argument("--kernel-repeats", type=int, default=5)
    p.add_argument("--census-length", type=int, default=8192)
    p.add_argument("--backend", default="triton")
    p.add_argument("--device", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1), figures mean nothing")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke:
        device = torch.device("cpu")
        args.contexts, args.layers, args.repeats, args.kernel_repeats = "256", 2, 1, 1
        args.variants, args.ttft_variants, args.budget, args.census_length = "spaced/2/split,pages/1/bf16/128", "pages/1/bf16/128", 128, 256
        args.placements = "cpu"
    dispatch.check(args.backend, device)
    if device.type != "cuda":
        print("kmeans_ttft: no CUDA device; timings on the CPU say nothing about the GPU", file=sys.stderr)
    parts = set(args.parts.split(","))
    contexts = _ints(args.contexts)
    ttft_contexts = _ints(args.ttft_contexts) if args.ttft_contexts else contexts
    nosync_modes = [{"off": False, "on": True}[m] for m in args.nosync.split(",") if m]
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": vars(args)}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps({k: out[k] for k in ("device", "torch", "triton") if k in out}))

    heads, dim = (2, 32) if args.smoke else (8, 128)
    if "kernel" in parts:
        variants = args.variants.split(",")
        out["kernel"] = kernel_times(device, args.backend, contexts, variants, heads, dim, args.layers,
                                     args.kernel_repeats)
        out["kernel_breakdown"] = kernel_breakdown(device, args.backend, max(contexts), [variants[0], variants[-1]],
                                                   heads, dim)
    if parts & {"syncs", "ttft", "profile"}:
        model = smoke_model(device) if args.smoke else random_model(qwen3_8b_config(layers=args.layers), device)
        if "syncs" in parts:
            census = {"full": preset("full")}
            census.update({k: v for k, v in ttft_policies(args, args.placements.split(",")[0]).items()
                           if k.startswith("louiskv[") and "pages units" not in k and k.endswith(f"{args.ttft_variants.split(',')[0]}]")})
            if not args.no_pariskv:
                census["pariskv"] = preset("pariskv", budget=args.budget, placement=args.placements.split(",")[0],
                                           backend=args.backend)
            out["syncs"] = sync_census(model, census, args.census_length, nosync=False)
            out["syncs"] += sync_census(model, {k: v for k, v in census.items() if k != "full"}, args.census_length,
                                        nosync=True)
        if "ttft" in parts:
            out["ttft"] = ttft_rows(model, args, ttft_contexts, nosync_modes)
        if "profile" in parts:
            profiled = {"full": preset("full")}
            profiled.update(ttft_policies(args, args.placements.split(",")[0]))
            out["profile"] = prefill_profile(model, profiled, args.census_length)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
