"""ParisKV's candidate top-k: the Triton counting sort against the reference's ``torch.topk``.

Both as CUDA-graph replays at decode sizes: 8 KV heads per sequence, votes of 16 subspaces x 6
tiers (0..96, 1% invalid), candidates 10% of the tokens. Usage (GPU):
    python3 benchmarks/candidate_topk.py [--tokens 131072,1048576] [--batches 1,4]
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.bench.timing import time_replay_ms
from kvpolicy.kernels import dispatch, reference_analytic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="131072,1048576")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    counting_sort = dispatch.get("candidate_topk", "triton", device)
    print(f"candidate_topk, {args.kv_heads} KV heads, k = 10% of the tokens; us per replay (median of {args.repeats})")
    print(f"{'B':>2s} {'tokens':>8s} {'triton':>8s} {'torch.topk':>11s} {'equal':>6s}")
    for batch in (int(b) for b in args.batches.split(",")):
        for n in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator(device=device).manual_seed(n + batch)
            votes = torch.randint(0, 97, (batch, args.kv_heads, n), generator=gen, device=device, dtype=torch.int32)
            votes = votes.masked_fill(torch.rand(votes.shape, generator=gen, device=device) < 0.01, -1)
            k = n // 10
            equal = torch.equal(counting_sort(votes, k, 96), reference_analytic.candidate_topk(votes, k))
            ours = time_replay_ms(lambda: counting_sort(votes, k, 96), device, args.repeats)
            theirs = time_replay_ms(lambda: reference_analytic.candidate_topk(votes, k), device, args.repeats)
            print(f"{batch:2d} {n:8d} {1e3 * ours:8.1f} {1e3 * theirs:11.1f} {str(equal):>6s}", flush=True)


if __name__ == "__main__":
    main()
