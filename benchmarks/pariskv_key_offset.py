"""ParisKV's selection against a key offset shared by every key, with and without centering (CPU).

Real keys often share a large common component (one direction every key leans along). q.k and
q.(k - mean) rank keys identically (q.mean is one constant per query), but the analytic index
encodes each key's direction: a shared offset makes every key's sign patterns and 4-bit codes
alike, and the selection loses the keys that differ. This measures it on synthetic keys:
``n`` random keys plus an offset of ``offset * sqrt(head_dim)`` along one random direction, a
needle along the group's mean query, and collision_rerank (reference ops, preset defaults) at
retrieval budget ``--capacity``: whether the needle is kept, and the recall of the exact top 30
by q.k, with the index built from the keys as they are or from the keys less their mean.

    python3 benchmarks/pariskv_key_offset.py --head-dims 128,256 --offsets 0,2,5,10

Session 9 (CPU, the defaults: 6 seeds, n 600, capacity 45), top-30 recall at offsets 0 / 2 / 5 / 10:
head_dim 128 0.922 / 0.767 / 0.572 / 0.444, centered 0.939 at each; head_dim 256 0.911 / 0.772 /
0.578 / 0.483, centered 0.917 at each; the needle kept in every case. Not specific to head_dim 256. Centering is not implemented: the index would hold each head's prompt mean and
subtract it at every append (kernels/triton/analytic_append.py included).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpolicy.selectors import CollisionRerank  # noqa: E402
from kvpolicy.units import Analytic  # noqa: E402


def trial(dim: int, offset: float, seed: int, center: bool, n: int, capacity: int, buffer: int) -> tuple[bool, float]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(dim, generator=gen)
    shared = shared / shared.norm() * offset * dim ** 0.5
    keys = torch.randn(1, 1, n, dim, generator=gen) + shared
    query = torch.randn(1, 4, dim, generator=gen)
    mean_query = query.view(1, 1, 4, dim).mean(2)[0, 0]
    needle = n // 2
    keys[0, 0, needle] = shared + mean_query / mean_query.norm() * 1.5 * dim ** 0.5
    built = keys - keys.mean(2, keepdim=True) if center else keys
    index = Analytic(update_buffer=buffer).build_index(built, torch.ones(1, n, dtype=torch.bool), "reference", 0)
    selection = CollisionRerank().select(query, index, capacity, "reference")
    picked = set(selection.slots[0, 0][selection.slot_valid[0, 0]].tolist())
    best = set((keys[0, 0] @ mean_query).topk(30).indices.tolist())
    return needle in picked, len(best & picked) / 30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128,256")
    parser.add_argument("--offsets", default="0,2,5,10")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--capacity", type=int, default=45)
    parser.add_argument("--update-buffer", type=int, default=15)
    args = parser.parse_args(argv)
    if args.n < 31 or args.capacity < 1 or args.seeds < 1:
        parser.error("--n must be at least 31 (a top 30 and a needle), --capacity and --seeds at least 1")
    torch.set_num_threads(1)
    print(f"{'head_dim':>8s} {'offset':>6s} {'centered':>8s} {'needle kept':>11s} {'top-30 recall':>13s}")
    for dim in (int(d) for d in args.head_dims.split(",")):
        for offset in (float(o) for o in args.offsets.split(",")):
            for center in (False, True):
                runs = [trial(dim, offset, seed, center, args.n, args.capacity, args.update_buffer) for seed in range(args.seeds)]
                kept = sum(k for k, _ in runs)
                recall = sum(r for _, r in runs) / len(runs)
                print(f"{dim:8d} {offset:6.1f} {str(center):>8s} {kept:>5d} / {len(runs):<3d} {recall:13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
