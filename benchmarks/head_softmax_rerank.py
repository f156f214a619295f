"""collision_rerank's rerank="head_softmax" against "group_mean" (ParisKV's), per layer, on one GPU.

Per context x batch (Qwen3-8B shape by default: 8 KV heads, 32 query heads, head_dim 128, a
2048-token budget; a random index, timing only), each as a CUDA-graph replay (ms a layer):

- the whole selection (``CollisionRerank.select`` on the fused ops) with ``rerank="group_mean"``,
  with ``rerank="head_softmax"`` (the logit queries from ``query_votes(logit_queries=True)``), and
  with ``rerank="head_softmax"`` building them as before (``analytic.head_logit_queries``, ~20
  PyTorch launches), and head_softmax's time over group_mean's;
- ``query_votes`` alone, without and with ``logit_queries``;
- ``rerank_select`` alone on the same candidates: the group's mean query, then the heads' logit
  queries at each of head_softmax.py's logits-pass settings (``LOGITS_VARIANTS``: candidates a
  step and warps; the first row is the shipped one);
- each kernel's device time (torch.profiler, median over the repeats, launch order) of the two
  whole selections.

Usage (GPU, about a minute):

    python3 benchmarks/head_softmax_rerank.py
    python3 benchmarks/head_softmax_rerank.py --contexts 32768,131072 --batches 1,4 --json head_softmax.json

``TRITON_INTERPRET=1 python3 benchmarks/head_softmax_rerank.py --smoke`` runs the same code on the CPU
at a toy size (eager wall clock: the figures mean nothing) to check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pariskv_select import _short, _timer, bound_ops, kernel_times, random_index  # noqa: E402

from kvpolicy import analytic  # noqa: E402
from kvpolicy.selectors import CollisionRerank  # noqa: E402
from kvpolicy.selectors import collision_rerank  # noqa: E402

# head_softmax.py's logits pass: (label, {constant: value}); the first is the shipped setting
LOGITS_VARIANTS = (
    ("shipped", {}),
    ("logits 64x4w", {"_LOGITS_SUB": 64, "_LOGITS_WARPS": 4}),
    ("logits 64x8w", {"_LOGITS_SUB": 64, "_LOGITS_WARPS": 8}),
    ("logits 128x4w", {"_LOGITS_SUB": 128, "_LOGITS_WARPS": 4}),
    ("logits 32x4w", {"_LOGITS_SUB": 32, "_LOGITS_WARPS": 4}),
    ("logits 256x8w", {"_LOGITS_SUB": 256, "_LOGITS_WARPS": 8}),
)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=_ints, default=[32768, 131072])
    parser.add_argument("--batches", type=_ints, default=[1, 4])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048, help="tokens attended: sink 4 + local 64 + retrieved")
    parser.add_argument("--update-buffer", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, a toy size")
    args = parser.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
        args.contexts, args.batches, args.kv_heads, args.q_heads, args.head_dim = [600], [1], 2, 8, 32
        args.budget, args.update_buffer, args.repeats = 200, 8, 1
    args.device = torch.device("cpu" if args.smoke else "cuda")
    return args


def _constants(settings: dict):
    from kvpolicy.kernels.triton import head_softmax

    return mock.patch.multiple(head_softmax, **(settings or {"_LOGITS_SUB": head_softmax._LOGITS_SUB}))


def measure(args: argparse.Namespace, batch: int, context: int) -> dict:
    device = args.device
    retrieval = args.budget - 4 - 64
    index = random_index(batch, args.kv_heads, context, args.head_dim, args.update_buffer - 1, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    query = torch.randn(batch, args.q_heads, args.head_dim, device=device, dtype=dtype)
    group = query.view(batch, args.kv_heads, -1, args.head_dim)
    ops = bound_ops("triton", device, True)
    timed = _timer(device, args.repeats)
    mean, heads = CollisionRerank(), CollisionRerank(rerank="head_softmax")
    row: dict = {"context": context, "batch": batch, "group": group.shape[2]}
    row["select group_mean"] = timed(lambda: mean.select(query, index, retrieval, ops))
    row["select head_softmax"] = timed(lambda: heads.select(query, index, retrieval, ops))
    with mock.patch.object(collision_rerank, "_votes_logit_queries", lambda _: False):
        row["select head_softmax, PyTorch logit queries"] = timed(lambda: heads.select(query, index, retrieval, ops))
    row["head_softmax / group_mean"] = row["select head_softmax"] / row["select group_mean"]

    tiers = mean.tiers_for(args.head_dim // index.subspaces)
    votes = torch.tensor(analytic.tier_weights(tiers), dtype=torch.int32, device=device)
    row["query_votes"] = timed(lambda: ops.query_votes(group, index.signs, index.subspaces, votes))
    row["query_votes + logit queries"] = timed(lambda: ops.query_votes(group, index.signs, index.subspaces, votes,
                                                                       logit_queries=True))
    rotated, table, logit_queries = ops.query_votes(group, index.signs, index.subspaces, votes, logit_queries=True)
    width = mean.candidates_for(index.capacity, retrieval)
    candidates = ops.collision_candidates(table, index.centroids, index.token_valid, index.indexed, width,
                                          index.subspaces * tiers, *mean.rule_for(retrieval))
    rest = (index.codes, index.weight, index.norms, candidates, index.token_valid, index.slots, index.indexed,
            index.next_position, retrieval)
    row["candidates a row"] = width
    row["rerank_select group_mean"] = timed(lambda: ops.rerank_select(rotated, *rest))
    for label, settings in LOGITS_VARIANTS:
        with _constants(settings):
            row[f"rerank_select head_softmax {label}"] = timed(lambda: ops.rerank_select(logit_queries, *rest))
    for name, selector in (("group_mean", mean), ("head_softmax", heads)):
        kernels = kernel_times(lambda: selector.select(query, index, retrieval, ops), device, args.repeats)
        row[f"kernels {name}"] = None if kernels is None else [(_short(k), us) for k, us in kernels]
    return row


def print_row(row: dict, cuda: bool) -> None:
    print(f"\n{row['batch']}x{row['context']} (G={row['group']}, {row['candidates a row']} candidates a row), "
          f"ms a layer ({'graph replay' if cuda else 'eager on the CPU interpreter: meaningless'}):")
    for key, value in row.items():
        if isinstance(value, float):
            print(f"  {key:58s} {value:8.4f}")
    for name in ("group_mean", "head_softmax"):
        kernels = row[f"kernels {name}"]
        if kernels is None:
            print(f"  kernels {name}: calls launched different kernels; not grouped")
            continue
        print(f"  kernels {name} ({len(kernels)} launches, {sum(us for _, us in kernels):.1f} us):")
        for kernel, us in kernels if cuda else ():  # on the CPU: PyTorch's ops, meaningless
            print(f"    {kernel:56s} {us:8.1f} us")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    rows = []
    with torch.inference_mode():
        for context in args.contexts:
            for batch in args.batches:
                row = measure(args, batch, context)
                print_row(row, args.device.type == "cuda")
                rows.append(row)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
