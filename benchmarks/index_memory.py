"""Memory on the attention device over a long generation: the budget's buffers and the retrieval index.

Issue 15, item 1: the unit table reserved one float32 unit (12 D + 17 bytes a KV head) per generated
token, so a long output (LouisKV's case: 16K-32K generated tokens) grew the index past the KV it
retrieves from. This decodes ``--tokens`` tokens through one policy layer on CPU (the layer API, at
SmolLM2's shape by default: 3 KV heads, 9 query heads, head_dim 64; float32) after a short prompt,
and reports at checkpoints, per layer:

    device KV   the attended buffer (sink + retrieved + local): what "KV on attention device" counts
    buffers     the budget's rows, ``budget x 2 x KV heads x D x element size``: its ceiling
    index       the retrieval index's tensors as allocated (``PolicyLayerState.index_bytes``)
    bound       the index's documented cost for the units opened so far: ``unit_bytes(D)`` per
                allocated unit under the table's growth rule (``units/table.py``: prompt units plus
                ``2 x`` the rule's bound for pages, ``3 x`` the units opened for segments, plus 16)
                and ``TOKEN_BYTES`` per order position (``2 x`` the tokens, plus 16)
    per token   what the table reserved before the fix: one unit per generated token
    full KV     the full cache of the tokens so far (the pool, in host memory)

Queries keep one direction (plus noise) and jump to a new one with probability ``--shift`` a step, so
query_cosine fires now and then, as on text, rather than on every step as random queries make it. Usage (CPU, a few minutes at the default):
    python3 benchmarks/index_memory.py [--tokens 32768] [--presets quest,louiskv] [--budget 512]
"""

from __future__ import annotations

import argparse
import time

import torch

import kvpolicy
from kvpolicy.layer import PolicyLayerState
from kvpolicy.units.table import TOKEN_BYTES, UnitTable, unit_bytes


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def documented_bound(table: UnitTable, builder, batch: int, heads: int, dim: int, prompt_order: int) -> int:
    """The bytes the table may hold after the tokens so far, by the growth rule its docstring states."""
    tokens = table.decode_tokens
    opened = int(table.decode_units.max())
    rule = builder.max_decode_units(tokens)
    decode_units = 2 * rule + 16 if rule is not None else 3 * (opened + 1) + 16
    units = table.num_prompt_units + decode_units
    order = prompt_order + 2 * tokens + 16
    small = 3 * 8 * batch + 8  # open_unit, decode_units, order_next
    return batch * heads * (unit_bytes(dim) * units + TOKEN_BYTES * order) + small


def run(name: str, tokens: int, budget: int, prompt: int, kv_heads: int, q_heads: int, dim: int, shift: float,
        checkpoints: list[int], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    policy = kvpolicy.preset(name, budget=budget, backend="reference")
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    batch = 1
    state.prefill(torch.randn(batch, kv_heads, prompt, dim, generator=gen),
                  torch.randn(batch, kv_heads, prompt, dim, generator=gen),
                  torch.ones(batch, prompt, dtype=torch.bool), q_heads)
    table = state.units
    prompt_order = table.order_len
    row = 2 * kv_heads * dim * 4  # one token's key and value, float32, every KV head
    buffers = budget * row * batch
    direction = torch.randn(batch, q_heads, dim, generator=gen)
    start = time.perf_counter()
    print(f"\n{policy.describe()}\n{'tokens':>7s} {'units':>6s} {'capacity':>8s} {'device KV':>9s} {'buffers':>8s} "
          f"{'index':>8s} {'bound':>8s} {'per token':>9s} {'full KV':>8s}   (MiB per layer)", flush=True)
    worst = 0.0
    for step in range(1, tokens + 1):
        if torch.rand((), generator=gen) < shift:
            direction = torch.randn(batch, q_heads, dim, generator=gen)
        query = direction + 0.2 * torch.randn(batch, q_heads, dim, generator=gen)
        state.decode(query, torch.randn(batch, kv_heads, dim, generator=gen),
                     torch.randn(batch, kv_heads, dim, generator=gen), dim**-0.5)
        if step in checkpoints or step == tokens:
            index = state.index_bytes()
            bound = documented_bound(table, policy.decode_units, batch, kv_heads, dim, prompt_order)
            per_token = batch * kv_heads * unit_bytes(dim) * (table.num_prompt_units + step)
            device = state.store.device_bytes()
            worst = max(worst, index / bound)
            assert device <= buffers, (device, buffers)
            print(f"{step:7d} {int(table.decode_units.max()):6d} {table.capacity:8d} {_mib(device)}  {_mib(buffers)} "
                  f"{_mib(index)} {_mib(bound)} {_mib(per_token)}  {_mib(state.store.full_bytes())}", flush=True)
    elapsed = time.perf_counter() - start
    share = float(state.reselections.sum()) / (tokens * batch)
    print(f"{tokens} tokens in {elapsed:.0f} s ({1e3 * elapsed / tokens:.1f} ms/step); re-selected on {share:.0%} of "
          f"steps; index / documented bound at most {worst:.2f}", flush=True)
    return {"preset": name, "tokens": tokens, "index_bytes": state.index_bytes(), "worst_ratio": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens to generate (default 32768)")
    parser.add_argument("--presets", default="quest,louiskv")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens (short: the index is mostly decode units)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shift", type=float, default=0.05, help="chance a step that the query direction jumps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest at these sizes)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoints = sorted({min(args.tokens, 1000 * 2**i) for i in range(16)} | {args.tokens})
    results = [run(name, args.tokens, args.budget, args.prompt, args.kv_heads, args.q_heads, args.head_dim,
                   args.shift, checkpoints) for name in args.presets.split(",")]
    over = [r["preset"] for r in results if r["worst_ratio"] > 1]
    if over:
        raise SystemExit(f"index over its documented bound: {', '.join(over)}")


if __name__ == "__main__":
    main()
