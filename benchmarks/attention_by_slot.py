"""The attention kernel over a retrieved buffer read by slot from a GPU pool (``PoolRows``) against the
same rows copied into the buffer, as CUDA-graph replays of ``--calls`` launches (a step's layers).

    python3 benchmarks/attention_by_slot.py [--context 2304] [--batches 1,4,8] [--rows 1980]

One attended part a (sequence, KV head): sink 4 | retrieved ``--rows`` | local 64, every row valid, bf16,
Qwen3-8B's heads (32 query, 8 KV, head dim 128). The pool holds a prompt of ``--context`` tokens laid out
unit by unit (a random zone order, as LouisKV's units), and the retrieved rows name random slots of it.
Rows, each timed side by side in one run, at 2, 3 and 4 software-pipeline stages (``attention.NUM_STAGES`` for a
part's own rows, ``NUM_STAGES_BY_SLOT`` for rows read by slot; shipped 3 and 2):
- ``copied``: the rows in the buffer itself (as a policy that keeps its selection has them: its re-selection
  copies them, ``store.ATTEND_POOL_BY_SLOT``);
- ``by slot``: read from the pool through the slot -> row map (as an every-step policy's are);
- ``by row``: the same with the map already applied (the slots are pool rows: no zone map to read).
Each at the kernel's own split choice, then at each of ``--split-tokens`` (tokens a split: more tiles a program
let its loads pipeline, fewer programs hide less latency).
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.bench.timing import time_ms, time_replay_ms
from kvpolicy.kernels import reference
from kvpolicy.kernels.triton import attention
from kvpolicy.tiers import PoolRows

SINK, LOCAL = 4, 64


def _case(batch, context, rows, q_heads, kv_heads, dim, device, gen):
    dtype = torch.bfloat16
    n = SINK + rows + LOCAL
    keys = torch.randn(batch, kv_heads, n, dim, generator=gen, device=device).to(dtype)
    values = torch.randn(batch, kv_heads, n, dim, generator=gen, device=device).to(dtype)
    valid = torch.ones(batch, kv_heads, n, dtype=torch.bool, device=device)
    pool_keys = torch.randn(batch, kv_heads, context, dim, generator=gen, device=device).to(dtype)
    pool_values = torch.randn(batch, kv_heads, context, dim, generator=gen, device=device).to(dtype)
    zone = context - LOCAL
    zone_rows = torch.stack([torch.randperm(zone, generator=gen, device=device)
                             for _ in range(batch * kv_heads)]).view(batch, kv_heads, zone).to(torch.int32)
    slots = torch.stack([torch.randperm(zone, generator=gen, device=device)[:rows]
                         for _ in range(batch * kv_heads)]).view(batch, kv_heads, rows)
    by_slot = PoolRows(pool_keys, pool_values, slots, SINK, zone_rows, zone)
    by_row = PoolRows(pool_keys, pool_values, reference.pool_rows(slots, zone_rows).long(), SINK)
    copied_keys, copied_values = reference.with_pool_rows(keys, values, by_slot)
    query = torch.randn(batch, q_heads, dim, generator=gen, device=device).to(dtype)
    return query, {
        "copied": (copied_keys, copied_values, valid),
        "by slot": (keys, values, valid, by_slot),
        "by row": (keys, values, valid, by_row),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2304)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--rows", type=int, default=1980, help="retrieved rows a (sequence, KV head)")
    parser.add_argument("--calls", type=int, default=36, help="launches a replay (a step's layers)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--split-tokens", default="128,256", help="comma-separated forced split sizes also timed")
    parser.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1, a check of the script, "
                                                          "timed eagerly")
    args = parser.parse_args()
    device = torch.device(args.device)
    timer = time_replay_ms if device.type == "cuda" else time_ms
    gen = torch.Generator(device=device).manual_seed(0)
    scale = 128 ** -0.5
    splits = [None] + [int(t) for t in args.split_tokens.split(",") if t]
    shipped = attention.NUM_STAGES, attention.NUM_STAGES_BY_SLOT
    print(f"{'batch':>5} {'row':<28} {'split':>6} {'us a call':>10} {'vs copied':>10}")
    for batch in (int(b) for b in args.batches.split(",")):
        query, parts = _case(batch, args.context, args.rows, 32, 8, 128, device, gen)
        expected = attention.sparse_decode_attention(query, [parts["copied"]], scale)
        # (label, part, pipeline stages)
        variants = [(f"{part}, {stages} stages", part, stages) for stages in (3, 2, 4)
                    for part in ("copied", "by slot", "by row")]
        for split in splits:
            base = None  # this split's copied rows at 3 stages, the first variant
            for label, part, stages in variants:
                attention.NUM_STAGES = attention.NUM_STAGES_BY_SLOT = stages
                out = attention.sparse_decode_attention(query, [parts[part]], scale, split_tokens=split)
                # the same loads and arithmetic as the copied rows at the same split: bit for bit
                if not torch.equal(out, attention.sparse_decode_attention(query, [parts["copied"]], scale,
                                                                          split_tokens=split)):
                    raise SystemExit(f"attention_by_slot: {label} differs from the copied rows at batch {batch}")
                torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)

                def calls(part=parts[part], split=split):
                    for _ in range(args.calls):
                        attention.sparse_decode_attention(query, [part], scale, split_tokens=split)

                us = 1e3 * timer(calls, device, repeats=args.repeats) / args.calls
                base = base or us
                print(f"{batch:>5} {label:<28} {split or 'auto':>6} {us:>10.2f} {us / base:>10.2f}", flush=True)
            attention.NUM_STAGES, attention.NUM_STAGES_BY_SLOT = shipped


if __name__ == "__main__":
    main()
