"""ParisKV's selection per layer and its single-row gather from a pinned pool, on one GPU.

Per layer (Qwen3-8B shape by default: 8 KV heads, 32 query heads, head_dim 128, 16 subspaces,
6 tiers), at each context x batch:

- the whole selection (``CollisionRerank.select``: query encoding, collision votes,
  candidates, the 4-bit rerank, its top-k and the buffer-first composition), as a CUDA-graph
  replay, once through the fused ops (``query_votes`` + ``collision_candidates`` +
  ``rerank_select``) and once through the composed ones (``collision_count`` +
  ``candidate_topk`` + ``rerank`` + the composition in PyTorch), and each path's parts; for
  the fused path also the old rerank (``rerank``: scores, then ``torch.topk``) on the same
  candidates, for comparison (not part of its total);
- a leaving token's write into the index (``analytic_append`` on the fused path, the reference
  PyTorch on the composed one), which every decode step runs beside the selection;
- the single-row gather (``gather_rows_into``) of a selection's rows (the retrieval budget per
  (sequence, KV head), random slots, the same slots sorted by address, and in the order
  ``rerank_select`` lists them: the buffer's newest slots, then the rest by address) from a pinned pool
  of the largest context, in GB/s, against a plain pinned host-to-device copy of the same
  bytes measured in the same run.

Also, on the fused path, each of ``rerank_select``'s methods (``radix``, ``split``, ``torch``;
``kvpolicy/kernels/triton/rerank_select.py``) alone and as the whole selection's last op, and
the device time of every kernel the selection launches (``torch.profiler``, median over the
repeats, in launch order), printed as one table per size.

The index is random (ids, codes, weights): timing only, no accuracy. Usage (GPU, ~3 min):

    python3 benchmarks/pariskv_select.py --json pariskv_select.json
    python3 benchmarks/pariskv_select.py --contexts 131072 --batches 4 --no-gather

``--votes group_mean,head_max`` times the selection with each of ``CollisionRerank``'s votes, side
by side (``head_max``: every query head votes, per-head tables; the fused path only, without
session 10's before rows, the rerank methods and the old rerank, which do not depend on the
votes), and prints head_max's time over group_mean's per size:

    python3 benchmarks/pariskv_select.py --contexts 32768 --batches 1 --votes group_mean,head_max --quick --no-gather
    python3 benchmarks/pariskv_select.py --contexts 131072 --batches 4 --votes group_mean,head_max --quick --no-gather

``--device cpu`` runs the same code eagerly at toy sizes (wall clock, reference backend unless
``--backend triton`` under ``TRITON_INTERPRET=1``) to check that it runs; its figures mean
nothing. ``--smoke`` is that check with the Triton kernels at a tiny size (needs
``TRITON_INTERPRET=1`` without a GPU): ``TRITON_INTERPRET=1 python3 benchmarks/pariskv_select.py --smoke``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import torch

from kvpolicy import analytic
from kvpolicy.bench.timing import time_ms, time_replay_ms
from kvpolicy.kernels import dispatch, reference_analytic
from kvpolicy.selectors import CollisionRerank
from kvpolicy.selectors.collision_rerank import VOTES
from kvpolicy.units.analytic_index import AnalyticIndex

FUSED_OPS = ("query_votes", "collision_candidates", "rerank_select")
RERANK_METHODS = ("radix", "row", "split", "torch")
# rerank_select's methods, then the radix method's tunables (module constants of
# kvpolicy/kernels/triton/rerank_select.py) around their defaults: each timed alone
RERANK_VARIANTS = (
    ("radix", {"METHOD": "radix"}),
    ("row", {"METHOD": "row"}),  # at most _ROW_MAX_WIDTH candidates a row (measure_methods skips it past that)
    ("split", {"METHOD": "split"}),
    ("torch", {"METHOD": "torch"}),
    ("radix score 64x8w", {"METHOD": "radix", "_RADIX_SCORE_SUB": 64, "_RADIX_SCORE_WARPS": 8}),
    ("radix score 128x8w", {"METHOD": "radix", "_RADIX_SCORE_SUB": 128, "_RADIX_SCORE_WARPS": 8}),
    ("radix score 32x4w old", {"METHOD": "radix", "_RADIX_SCORE_SUB": 32, "_RADIX_SCORE_WARPS": 4}),
    ("radix words 64x8w", {"METHOD": "radix", "SCORE_WORDS": True, "_RADIX_SCORE_SUB": 64, "_RADIX_SCORE_WARPS": 8}),
    ("radix min chunk 128", {"METHOD": "radix", "_RADIX_MIN_CHUNK": 128}),
    # as before the small-call chunks: the 256 floor whatever the programs
    ("radix min chunk 256 always", {"METHOD": "radix", "_RADIX_MIN_CHUNK_PROGRAMS": 0}),
    ("radix programs 2048", {"METHOD": "radix", "_RADIX_PROGRAMS": 2048}),
    ("radix programs 8192", {"METHOD": "radix", "_RADIX_PROGRAMS": 8192}),
    ("radix programs 16384", {"METHOD": "radix", "_RADIX_PROGRAMS": 16384}),
)

# collision_candidates' tunables (kernels/triton/collision_candidates.py; the first row is the
# shipped setting): positions a program, keys a step, warps of the votes and compaction passes
COLLISION_VARIANTS = (
    ("shipped", {}),
    # as before session 18: chunks of 2048, a large call's threshold pass launched
    ("before session 18", {"_CHUNK": 2048, "FOLD_LARGE_THRESHOLD": False}),
    # as before the small-call chunks: _CHUNK positions at every size, the threshold pass in steps of 32
    ("before: small calls' chunk at _CHUNK", {"_MIN_CHUNK": 4096, "_WHOLE_ROW_CHUNKS": 0, "FOLD_LARGE_THRESHOLD": False}),
    # the threshold pass launched at every size (whole rows in one step)
    ("threshold launch", {"FOLD_SMALL_THRESHOLD": False}),
    ("chunk 2048", {"_CHUNK": 2048}),
    ("chunk 8192", {"_CHUNK": 8192}),
    ("sub 512", {"_SUB": 512}),
    ("sub 128", {"_SUB": 128}),
    ("votes 8 warps", {"_VOTES_WARPS": 8}),
    ("votes 2 warps", {"_VOTES_WARPS": 2}),
    ("votes 8w sub 512", {"_VOTES_WARPS": 8, "_SUB": 512}),
    ("compact 8 warps", {"_COMPACT_WARPS": 8}),
    # a small call's chunk below 512 (batch 1 at 32K: 1,280 or 2,560 programs of 2 or 1 keys a
    # thread, for a votes pass bound by its lookups' latency, not by its ids' 4 MB)
    ("small chunk 256", {"_PASS_PROGRAMS": 2048, "_MIN_CHUNK": 256}),
    ("small chunk 128", {"_PASS_PROGRAMS": 4096, "_MIN_CHUNK": 128}),
    ("small chunk 256 votes 2w", {"_PASS_PROGRAMS": 2048, "_MIN_CHUNK": 256, "_VOTES_WARPS": 2}),
)

# --quick (session 10's before/after): collision_candidates' pipelines and two fused tunables,
# rerank_select's radix method alone, no composed path
QUICK_COLLISION_VARIANTS = (
    ("shipped", {}),
    # as before session 18: chunks of 2048, a large call's threshold pass launched
    ("before session 18", {"_CHUNK": 2048, "FOLD_LARGE_THRESHOLD": False}),
    ("threshold launch", {"FOLD_SMALL_THRESHOLD": False}),
    # the shipped pipeline is "pass"; the fused one (votes and suffix counts in one pass) beside it
    ("fused pipeline", {"PIPELINE": "fused"}),
    ("votes 8 warps", {"_VOTES_WARPS": 8}),
    ("fused pipeline, compact sub 2048", {"PIPELINE": "fused", "_COMPACT_SUB": 2048}),
    ("chunk 2048", {"_CHUNK": 2048}),
    ("sub 512", {"_SUB": 512}),
)
QUICK_RERANK_VARIANTS = (
    ("radix", {"METHOD": "radix"}),
    ("row", {"METHOD": "row"}),  # at most _ROW_MAX_WIDTH candidates a row (measure_methods skips it past that)
    # before session 19: the level and place passes on the score pass's chunks at every size
    ("radix level chunk of the score pass", {"METHOD": "radix", "_RADIX_LEVEL_LARGE_CALL": 1 << 62}),
    ("radix level chunk 1024 at every size", {"METHOD": "radix", "_RADIX_LEVEL_LARGE_CALL": 0}),
    ("radix level chunk 2048", {"METHOD": "radix", "_RADIX_LEVEL_MIN_CHUNK": 2048}),
)
# the whole selection as it ran before session 10 (module, constant, value)
BEFORE = (
    ("kvpolicy.kernels.triton.query_votes", "RANKS", "count"),
    ("kvpolicy.kernels.triton.collision_candidates", "PIPELINE", "pass"),
)


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _votes(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values or any(v not in VOTES for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated votes of {', '.join(VOTES)}, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=_ints, default=[131072, 1048576], help="tokens per sequence (retrieval zone)")
    parser.add_argument("--batches", type=_ints, default=[4])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048, help="tokens attended: sink 4 + local 64 + retrieved")
    parser.add_argument("--update-buffer", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backend", default=None, help="kernel backend (default: triton on cuda, reference on cpu)")
    parser.add_argument("--no-gather", action="store_true", help="skip the pinned gather")
    parser.add_argument("--quick", action="store_true",
                        help="the fused path only, with session 10's before/after rows and few variants (~1 min at 128K+1M)")
    parser.add_argument("--votes", type=_votes, default=["group_mean"],
                        help="CollisionRerank's votes, each timed (comma-separated: group_mean, head_max)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny CPU run of the Triton kernels under TRITON_INTERPRET=1 (checks that it runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
        args.device, args.backend = "cpu", "triton"
        args.contexts, args.batches, args.kv_heads, args.q_heads = [900], [1], 2, 4
        args.head_dim, args.budget, args.update_buffer, args.repeats = 32, 160, 8, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for a toy run)")
    if args.q_heads % args.kv_heads:
        parser.error(f"--q-heads {args.q_heads} must be a multiple of --kv-heads {args.kv_heads}")
    analytic.check_head_dim(args.head_dim)
    if args.budget - 68 <= args.update_buffer:
        parser.error(f"--budget {args.budget} leaves no room to retrieve past sink 4, local 64 and the buffer")
    args.backend = args.backend or ("triton" if args.device == "cuda" else "reference")
    return args


def random_index(batch: int, heads: int, context: int, head_dim: int, buffered: int, device: torch.device) -> AnalyticIndex:
    """An analytic index of ``context`` retrieval-zone tokens (random ids and codes) and
    ``buffered`` tokens in its update buffer, at capacity ``context + buffered``."""
    subspaces = analytic.DEFAULT_SUBSPACES if head_dim <= 128 else head_dim // analytic.MAX_SUBSPACE_DIMS
    dims = head_dim // subspaces
    capacity = context + buffered
    gen = torch.Generator(device=device).manual_seed(context + batch)
    # weight and norms interleaved in one buffer, as AnalyticIndex.from_prompt lays them out
    pair = torch.stack([1 + 0.1 * torch.rand(batch, heads, capacity, generator=gen, device=device),
                        1 + torch.rand(batch, heads, capacity, generator=gen, device=device)], dim=-1)
    return AnalyticIndex(
        centroids=torch.randint(0, 1 << dims, (batch, heads, capacity, subspaces), generator=gen, device=device,
                                dtype=torch.uint8),
        codes=torch.randint(0, 256, (batch, heads, capacity, head_dim // 2), generator=gen, device=device,
                            dtype=torch.uint8),
        weight=pair[..., 0],
        norms=pair[..., 1],
        token_valid=torch.ones(batch, capacity, dtype=torch.bool, device=device),
        slots=torch.arange(capacity, device=device),
        next_position=torch.tensor(capacity, device=device),
        indexed=torch.tensor(context, device=device),
        signs=analytic.srht_signs(head_dim, 0, device),
        subspaces=subspaces,
        update_buffer=max(1, buffered),
        num_prompt_units=context,
        length=capacity,
    )


def bound_ops(backend: str, device: torch.device, fused: bool) -> dispatch.Ops:
    """A private ops table with the fused ops (from their modules if dispatch does not list them
    yet) or without them (the selector then composes collision_count and candidate_topk)."""
    ops = dispatch.Ops(backend, device)
    for name in FUSED_OPS:
        if not fused:
            if hasattr(ops, name):
                delattr(ops, name)
        elif not hasattr(ops, name):
            if backend == "reference":
                setattr(ops, name, getattr(reference_analytic, name))
            else:
                import importlib

                setattr(ops, name, getattr(importlib.import_module(f"kvpolicy.kernels.triton.{name}"), name))
    return ops


def count_kernels(fn: Callable[[], object], device: torch.device) -> int | None:
    """GPU kernels one eager call of ``fn`` launches (torch.profiler's CUDA kernel events);
    None on the CPU, where nothing launches."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled and warm
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def kernel_times(fn: Callable[[], object], device: torch.device, repeats: int) -> list[tuple[str, float]] | None:
    """``(kernel name, median us)`` for each kernel one eager call of ``fn`` launches, in launch
    order: ``repeats`` calls under torch.profiler, the k-th kernel of every call grouped (its
    device time, without launch gaps). On the CPU (a toy run) the top-level CPU ops instead, so
    the code runs; their figures mean nothing. None where the calls launch different numbers of
    kernels (then the grouping would be wrong)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    repeats = max(1, repeats)
    fn()  # compiled and warm
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.cpu_parent is None]
    events.sort(key=lambda e: e.time_range.start)
    if not events or len(events) % repeats:
        return None
    per_call = len(events) // repeats
    slots = [[] for _ in range(per_call)]
    for at, event in enumerate(events):
        slots[at % per_call].append(event)
    if any(len({e.name for e in slot}) != 1 for slot in slots):
        return None
    return [(slot[0].name, statistics.median(e.time_range.elapsed_us() for e in slot)) for slot in slots]


def _short(name: str) -> str:
    """A kernel's name without its C++ template arguments and signature."""
    short = name.replace("(anonymous namespace)", "").removeprefix("void ")
    short = short.split("(")[0].split("<")[0].strip()
    return short.split("::")[-1] or name


def _timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        return lambda fn: time_replay_ms(fn, device, repeats)
    return lambda fn: time_ms(fn, device, repeats, warmup=1)


def measure_append(args: argparse.Namespace, batch: int, device: torch.device, ops: dispatch.Ops,
                   fused: bool) -> float:
    """ms of one leaving token's write into the index (``analytic_append`` where ``fused``,
    else the reference PyTorch), on an index of its own: each call writes the next position,
    so room is reserved for every timed call (its cost does not depend on the context)."""
    index = random_index(batch, args.kv_heads, 256, args.head_dim, 1, device)
    index.reserve(4 * args.repeats + 64)  # warm-up, capture and replays each write one position
    key = torch.randn(batch, args.kv_heads, args.head_dim, device=device)
    valid = torch.ones(batch, dtype=torch.bool, device=device)
    slot = torch.tensor(10**6, device=device)
    boundary = torch.zeros(batch, dtype=torch.bool, device=device)
    table = ops if fused else None  # None: the reference's PyTorch

    def append():
        index.append_leaving_token(slot, key, valid, boundary, None, table)

    return _timer(device, args.repeats)(append)


@torch.inference_mode()
def measure_selection(args: argparse.Namespace, batch: int, context: int, device: torch.device,
                      vote_mode: str = "group_mean") -> list[dict]:
    """Per path, the whole selection's and its parts' ms per layer, with ``vote_mode`` (head_max: the
    fused path only, no before rows, rerank methods or old rerank)."""
    retrieval = args.budget - 4 - 64
    index = random_index(batch, args.kv_heads, context, args.head_dim, args.update_buffer - 1, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    query = torch.randn(batch, args.q_heads, args.head_dim, device=device, dtype=dtype)
    selector = CollisionRerank(votes=vote_mode)
    mean_only = vote_mode == "group_mean"  # the rows that do not depend on the votes
    per_head = {} if mean_only else {"per_head": True}
    tiers = selector.tiers_for(args.head_dim // index.subspaces)
    votes_per_rank = torch.tensor(analytic.tier_weights(tiers), dtype=torch.int32, device=device)
    width = selector.candidates_for(index.capacity, retrieval)
    rule = selector.rule_for(retrieval)
    max_votes = index.subspaces * tiers
    group = query.view(batch, args.kv_heads, -1, args.head_dim)
    timed = _timer(device, args.repeats)
    id_bytes = index.centroids.numel()
    rows = []
    for fused in ((True,) if args.quick or not mean_only else (True, False)):
        ops = bound_ops(args.backend, device, fused)
        total = timed(lambda: selector.select(query, index, retrieval, ops))
        before = {}
        kernels = count_kernels(lambda: selector.select(query, index, retrieval, ops), device)
        parts: dict[str, float] = {}
        if fused:
            rotated, table = ops.query_votes(group, index.signs, index.subspaces, votes_per_rank, **per_head)
            parts["query_votes"] = timed(lambda: ops.query_votes(group, index.signs, index.subspaces, votes_per_rank,
                                                                 **per_head))
            candidates = ops.collision_candidates(table, index.centroids, index.token_valid, index.indexed, width,
                                                  max_votes, *rule)
            parts["collision_candidates"] = timed(lambda: ops.collision_candidates(
                table, index.centroids, index.token_valid, index.indexed, width, max_votes, *rule))
            if args.backend == "triton":
                collision = measure_collision_variants(
                    args, (table, index.centroids, index.token_valid, index.indexed, width, max_votes, *rule), device)
        else:
            encoded = analytic.encode_query(group.float().mean(2), index.signs, index.subspaces, (1 << tiers) - 1)
            rotated = encoded.rotated
            parts["encode_query"] = timed(lambda: analytic.encode_query(
                group.float().mean(2), index.signs, index.subspaces, (1 << tiers) - 1))
            voted = index.retrieval_mask()[:, None, :].expand(batch, args.kv_heads, index.capacity)
            votes = ops.collision_count(encoded.centroids, index.centroids, voted, votes_per_rank)
            parts["collision_count"] = timed(lambda: ops.collision_count(
                encoded.centroids, index.centroids, voted, votes_per_rank))
            parts["candidate_topk"] = timed(lambda: ops.candidate_topk(votes, width, max_votes))
            keep = reference_analytic.candidate_count(voted[:, 0].sum(-1), *rule)
            candidates = torch.where(torch.arange(width, device=device) < keep.view(batch, 1, 1),
                                     ops.candidate_topk(votes, width, max_votes), -1)
        methods: dict[str, dict] = {}
        profile = None
        if not (fused and args.backend == "triton"):
            collision = {}
        if fused:
            select_args = (rotated, index.codes, index.weight, index.norms, candidates, index.token_valid,
                           index.slots, index.indexed, index.next_position, retrieval)
            parts["rerank_select"] = timed(lambda: ops.rerank_select(*select_args))
            profile = kernel_times(lambda: selector.select(query, index, retrieval, ops), device, args.repeats)
            if args.backend == "triton" and mean_only:
                before = measure_before(lambda: selector.select(query, index, retrieval, ops), device, args.repeats,
                                        group, index, votes_per_rank, ops.rerank_select, select_args)
            if args.backend == "triton" and mean_only:
                methods = measure_methods(args, select_args, lambda: selector.select(query, index, retrieval, ops),
                                          device)
        else:
            parts["rerank"] = timed(lambda: ops.rerank(rotated, index.codes, index.weight, index.norms, candidates,
                                                       retrieval))
        parts["rest"] = total - sum(parts.values())
        old_kernels = None
        if fused and not args.quick and mean_only:  # the old rerank (scores + torch.topk, best first) on the same candidates, beside it
            parts["old_rerank"] = timed(lambda: ops.rerank(rotated, index.codes, index.weight, index.norms, candidates,
                                                           retrieval))
            old_kernels = kernel_times(lambda: ops.rerank(rotated, index.codes, index.weight, index.norms, candidates,
                                                          retrieval), device, args.repeats)
        votes_ms = parts["collision_candidates" if fused else "collision_count"]
        listed = int((candidates >= 0).sum())
        rows.append({
            "kind": "selection", "path": "fused" if fused else "composed", "votes": vote_mode, "backend": args.backend,
            "batch": batch,
            "context": context, "kv_heads": args.kv_heads, "q_heads": args.q_heads, "head_dim": args.head_dim,
            "subspaces": index.subspaces, "tiers": tiers, "retrieval": retrieval, "candidates_per_row": listed
            // (batch * args.kv_heads), "ms": total, "parts_ms": parts, "kernels": kernels,
            # the centroid ids every step must read, at the whole selection's time
            "id_bytes": id_bytes, "id_gbps": id_bytes / total / 1e6,
            # ... and at the time of the part that reads them
            "votes_part_id_gbps": id_bytes / votes_ms / 1e6,
            # a leaving token's write into the index (every decode step, beside the selection)
            "append_ms": measure_append(args, batch, device, ops, fused),
            # the device time of each kernel of the whole selection (fused path), launch order
            "kernels_us": profile,
            # rerank_select's methods: alone, as the selection's last op, and their kernels
            "methods": methods,
            # the old rerank's kernels (its score kernel, then torch.topk's)
            "old_rerank_kernels_us": old_kernels,
            # collision_candidates per tunable setting (COLLISION_VARIANTS)
            "collision_variants": collision,
            # the whole selection and query_votes with the kernels before session 10 (BEFORE)
            "before": before,
        })
    return rows


def measure_before(select: Callable[[], object], device: torch.device, repeats: int, group, index,
                   votes_per_rank, select_op: Callable, select_args: tuple) -> dict:
    """The whole selection (and query_votes alone) with ``BEFORE``'s settings, beside the
    shipped ones: ms, kernels, and whether the selection's rows are the same."""
    import importlib

    timed = _timer(device, repeats)
    qv = importlib.import_module("kvpolicy.kernels.triton.query_votes")
    query_votes = lambda: qv.query_votes(group, index.signs, index.subspaces, votes_per_rank)  # noqa: E731
    after = select()
    result = {"query_votes_after_ms": timed(query_votes)}
    saved = [(importlib.import_module(module), name) for module, name, _ in BEFORE]
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    try:
        for module, name, value in BEFORE:
            setattr(importlib.import_module(module), name, value)
        old = select()
        result["same_rows"] = all(torch.equal(getattr(after, f), getattr(old, f)) for f in ("unit_ids", "slots", "slot_valid"))
        result["ms"] = timed(select)
        result["kernels_us"] = kernel_times(select, device, repeats)
        result["query_votes_ms"] = timed(query_votes)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    # rerank_select alone on this index, then with weight and norms in two buffers (before session 10)
    call = lambda weight, norms: (lambda: select_op(*select_args[:2], weight, norms, *select_args[4:]))  # noqa: E731
    result["rerank_select_ms"] = timed(call(*select_args[2:4]))
    apart = [t.contiguous() for t in select_args[2:4]]
    result["rerank_select_apart_ms"] = timed(call(*apart))
    result["rerank_select_apart_same"] = all(
        torch.equal(a, b) for a, b in zip(call(*apart)(), call(*select_args[2:4])()))
    return result


def measure_collision_variants(args: argparse.Namespace, call_args: tuple, device: torch.device) -> dict[str, dict]:
    """Per ``COLLISION_VARIANTS`` setting: ``collision_candidates``' ms, its kernels' device
    times, and whether its candidates equal the shipped setting's (they must: integer votes)."""
    import importlib

    # the module, not the package's attribute of the same name (the op function)
    module = importlib.import_module("kvpolicy.kernels.triton.collision_candidates")
    timed = _timer(device, args.repeats)
    variants = QUICK_COLLISION_VARIANTS if args.quick else COLLISION_VARIANTS
    names = {name for _, settings in variants for name in settings}
    saved = {name: getattr(module, name) for name in names}
    results = {}
    first = None
    try:
        for label, settings in variants:
            for name, value in settings.items():
                setattr(module, name, value)
            out = module.collision_candidates(*call_args)
            same = None
            if first is None:
                first = out
            else:
                same = bool(torch.equal(out, first))
            results[label] = {
                "settings": settings,
                "ms": timed(lambda: module.collision_candidates(*call_args)),
                "kernels_us": kernel_times(lambda: module.collision_candidates(*call_args), device, args.repeats),
                "equals_shipped": same,
            }
            for name, value in saved.items():
                setattr(module, name, value)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    return results


def measure_methods(args: argparse.Namespace, select_args: tuple, select: Callable[[], object],
                    device: torch.device) -> dict[str, dict]:
    """Per variant of the Triton ``rerank_select`` (``RERANK_VARIANTS``: its methods, then the
    radix method's tunables): its ms alone and the whole selection's with it (replays on a GPU),
    its kernels' device times, and whether its rows equal the first variant's (they must, up to
    float rounding at the threshold: each matches the reference)."""
    from kvpolicy.kernels.triton import rerank_select as module

    timed = _timer(device, args.repeats)
    variants = QUICK_RERANK_VARIANTS if args.quick else RERANK_VARIANTS
    names = {name for _, settings in variants for name in settings}
    saved = {name: getattr(module, name) for name in names}
    results = {}
    first = None
    try:
        for label, settings in variants:
            if settings.get("METHOD") == "row" and select_args[4].shape[-1] > module._ROW_MAX_WIDTH:
                continue  # the row method refuses a row wider than that
            for name, value in settings.items():
                setattr(module, name, value)
            out = module.rerank_select(*select_args)
            same = None
            if first is None:
                first = out
            else:
                same = all(torch.equal(a, b) for a, b in zip(out, first))
            results[label] = {
                "settings": settings,
                "ms": timed(lambda: module.rerank_select(*select_args)),
                "select_ms": timed(select),
                "kernels_us": kernel_times(lambda: module.rerank_select(*select_args), device, args.repeats),
                "equals_radix": same,
            }
            for name, value in saved.items():
                setattr(module, name, value)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    results["auto"] = {"method": module.method_for(select_args[4].shape[-1])}
    return results


@torch.inference_mode()
def measure_gather(args: argparse.Namespace, batch: int, context: int, device: torch.device) -> list[dict]:
    """One pool of keys (B, H, context, D) in pinned memory; a selection's rows gathered to the GPU."""
    from kvpolicy.pinned import pinned_empty

    retrieval = args.budget - 4 - 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (batch, args.kv_heads, context, args.head_dim)
    pinned = device.type == "cuda"
    pool = pinned_empty(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
    # contents: one random block repeated, written from the GPU (drawing GBs on the host is slow)
    block = torch.randn(1 << 20, dtype=dtype, device=device)
    flat = pool.view(-1)
    for start in range(0, flat.numel(), block.numel()):
        part = flat[start:start + block.numel()]
        part.copy_(block[: part.numel()], non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize(device)
    gather_into = dispatch.get("gather_rows_into", args.backend, device)
    gen = torch.Generator(device=device).manual_seed(7)
    # distinct random slots per (sequence, head), as a selection's
    slots = torch.rand(batch, args.kv_heads, context, generator=gen, device=device).topk(retrieval, -1).indices
    take = torch.ones(batch, dtype=torch.bool, device=device)
    out = torch.empty(batch, args.kv_heads, retrieval, args.head_dim, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy_ms = time_ms(lambda: target.copy_(source, non_blocking=True), device, args.repeats)
    timed = _timer(device, args.repeats)
    rows = []
    ordered = slots.sort(-1).values
    # rerank_select's order: the update buffer's tokens (the newest slots) first, then the
    # retrieved ones by position (by slot)
    buffered = min(args.update_buffer - 1, retrieval)
    as_selected = torch.cat([ordered[..., retrieval - buffered:], ordered[..., :retrieval - buffered]], -1)
    for order, chosen in (("random", slots), ("sorted", ordered), ("selection", as_selected)):
        ms = timed(lambda: gather_into(pool, chosen, take, out))
        rows.append({
            "kind": "gather", "order": order, "backend": args.backend, "batch": batch, "context": context,
            "kv_heads": args.kv_heads, "rows": retrieval, "row_bytes": args.head_dim * out.element_size(),
            "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6, "copy_ms": copy_ms, "copy_gbps": nbytes / copy_ms / 1e6,
        })
    del pool
    return rows


def _label(context: int) -> str:
    return f"{context >> 20}M" if context % (1 << 20) == 0 else f"{context >> 10}K" if context % 1024 == 0 else str(context)


def print_table(results: dict) -> None:
    print(f"ParisKV selection per layer ({results['device']}, torch {results['torch']}, triton {results['triton']}); "
          f"ms per {'replay' if results['device_type'] == 'cuda' else 'eager call (toy run)'}")
    for row in results["selection"]:
        parts = "  ".join(f"{name} {ms:.3f}" for name, ms in row["parts_ms"].items())
        launches = "" if row.get("kernels") is None else f", {row['kernels']} kernels"
        print(f"  {_label(row['context']):>5s} x{row['batch']} {_path(row):>17s}: {row['ms']:.3f} ms{launches} "
              f"({row['candidates_per_row']} candidates/row; ids at {row['id_gbps']:.0f} GB/s, "
              f"{row['votes_part_id_gbps']:.0f} in the votes part)  [{parts}]; "
              f"append {row['append_ms']:.3f} ms")
    print_votes_ratios(results["selection"])
    for row in results["selection"]:
        print_kernels(row, results["device_type"] == "cuda")
    for row in results["gather"]:
        print(f"  gather {_label(row['context']):>5s} x{row['batch']} {row['order']:>9s} rows: {row['gbps']:.1f} GB/s "
              f"({row['bytes'] / 1e6:.1f} MB in {row['ms']:.3f} ms); plain H2D copy of the same bytes "
              f"{row['copy_gbps']:.1f} GB/s ({row['gbps'] / row['copy_gbps']:.2f}x)")


def _path(row: dict) -> str:
    return row["path"] if row["votes"] == "group_mean" else f"{row['path']} {row['votes']}"


def print_votes_ratios(rows: list[dict]) -> None:
    """head_max's fused selection and its parts over group_mean's, per size where both ran."""
    mean = {(r["batch"], r["context"]): r for r in rows if r["path"] == "fused" and r["votes"] == "group_mean"}
    for row in rows:
        base = mean.get((row["batch"], row["context"]))
        if row["path"] != "fused" or row["votes"] != "head_max" or base is None:
            continue
        parts = "  ".join(f"{name} {1e3 * row['parts_ms'][name]:.1f} us ({row['parts_ms'][name] / base['parts_ms'][name]:.2f}x)"
                          for name in FUSED_OPS)
        print(f"  {_label(row['context']):>5s} x{row['batch']} head_max / group_mean: whole selection "
              f"{1e3 * row['ms']:.1f} us against {1e3 * base['ms']:.1f} ({row['ms'] / base['ms']:.2f}x)  [{parts}]")


# kernels printed a list (all go to --json)
_LISTED = 40


def print_kernels(row: dict, cuda: bool) -> None:
    """One table a size (fused path): the selection's kernels, then rerank_select's methods."""
    if row["path"] != "fused":
        return
    what = "us of device time" if cuda else "us of CPU ops (toy run: the figures mean nothing)"
    print(f"  {_label(row['context'])} x{row['batch']}, {row['candidates_per_row']} candidates/row, "
          f"R {row['retrieval']}: kernels of the whole selection ({_path(row)}, rerank_select auto), {what} "
          f"(median of the repeats)")
    if row["kernels_us"] is None:
        print("    (not profiled: the calls launched different kernels)")
    else:
        for name, us in row["kernels_us"][:_LISTED]:
            print(f"    {_short(name):<40s} {us:9.1f}")
        if len(row["kernels_us"]) > _LISTED:
            print(f"    ... {len(row['kernels_us']) - _LISTED} more")
        print(f"    {'sum of kernels':<40s} {sum(us for _, us in row['kernels_us']):9.1f}   "
              f"(replay of the whole: {1e3 * row['ms']:.1f})")
    before = row.get("before") or {}
    if before:
        print(f"    before session 10 (query_votes count, collision pass): whole selection {1e3 * before['ms']:.1f} us "
              f"(now {1e3 * row['ms']:.1f}), query_votes {1e3 * before['query_votes_ms']:.1f} us "
              f"(now {1e3 * before['query_votes_after_ms']:.1f}); same rows: {before['same_rows']}")
        print(f"      rerank_select with weight and norms interleaved {1e3 * before['rerank_select_ms']:.1f} us, "
              f"in two buffers (before) {1e3 * before['rerank_select_apart_ms']:.1f} us; "
              f"same rows: {before['rerank_select_apart_same']}")
        if before.get("kernels_us"):
            text = ", ".join(f"{_short(name)} {us:.1f}" for name, us in before["kernels_us"][:_LISTED])
            print(f"      before kernels: {text}")
    variants = row.get("collision_variants") or {}
    if variants:
        print("    collision_candidates by setting: replay us | its kernels (us) | equal to the shipped candidates")
        for label, v in variants.items():
            kernels = ", ".join(f"{_short(name)} {us:.1f}" for name, us in (v["kernels_us"] or [])[:_LISTED])
            same = "-" if v["equals_shipped"] is None else str(v["equals_shipped"])
            print(f"      {label:<22s} {1e3 * v['ms']:9.1f} | {kernels} | {same}")
    methods = {k: v for k, v in row.get("methods", {}).items() if k != "auto"}
    if not methods:
        return
    auto = row["methods"].get("auto", {}).get("method")
    print(f"    rerank_select by method (auto picks {auto}): replay us alone | whole selection | "
          f"sum of its kernels | equal to radix's rows")
    for method, m in methods.items():
        kernels = m["kernels_us"]
        total = "-" if kernels is None else f"{sum(us for _, us in kernels):.1f}"
        same = "-" if m["equals_radix"] is None else str(m["equals_radix"])
        print(f"      {method:<22s} {1e3 * m['ms']:9.1f} | {1e3 * m['select_ms']:9.1f} | {total:>9s} | {same}")
    if row.get("old_rerank_kernels_us"):
        text = ", ".join(f"{_short(name)} {us:.1f}" for name, us in row["old_rerank_kernels_us"][:_LISTED])
        print(f"      old rerank (scores + torch.topk) kernels: {text}")
    for method, m in methods.items():
        if m["kernels_us"] is not None:
            text = ", ".join(f"{_short(name)} {us:.1f}" for name, us in m["kernels_us"][:_LISTED])
            more = len(m["kernels_us"]) - _LISTED
            print(f"      {method} kernels: {text}{f', ... {more} more' if more > 0 else ''}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "device_type": device.type,
        "torch": torch.__version__, "triton": triton_version, "argv": list(sys.argv[1:] if argv is None else argv),
        "selection": [], "gather": [],
    }
    for batch in args.batches:
        for context in args.contexts:
            rows = [row for mode in args.votes for row in measure_selection(args, batch, context, device, mode)]
            results["selection"] += rows
            print_table({**results, "selection": rows, "gather": []})
    if not args.no_gather:
        batch, context = max(args.batches), max(args.contexts)
        results["gather"] = measure_gather(args, batch, context, device)
    print_table(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
