"""ParisKV's prompt encode (op ``analytic_encode``) per layer at each (tokens a program, warps) setting.

One layer of a Qwen3-8B-shaped prompt (8 KV heads, head_dim 128, 16 subspaces, bf16 keys), CUDA-event
median of eager calls (``kvpolicy.bench.timing.time_ms``), and whether each setting's index equals the
shipped setting's bit for bit: the tokens a program do not change a token's arithmetic, the warps do (the
reductions' order), so another warp count differs in the last bits (within the reference's tolerance;
``tests/kernels/triton/test_analytic_encode.py``). Sets ``analytic_encoding.ENCODE_WARPS``, which the
decode's encode reads too. GPU only::

    python3 benchmarks/encode_tuning.py --contexts 8192,32768 --tokens 1,2,4,8 --warps 1,2,4
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy import analytic
from kvpolicy.bench.timing import time_ms
from kvpolicy.kernels.triton import analytic_encode as module
from kvpolicy.kernels.triton import analytic_encoding


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=_ints, default=[8192, 32768])
    p.add_argument("--tokens", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--warps", type=_ints, default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    heads, dim, subspaces = 8, 128, 16
    shipped = (module.TOKENS, analytic_encoding.ENCODE_WARPS)
    print(f"analytic_encode per layer ({heads} KV heads x {dim}, {subspaces} subspaces, bf16), shipped "
          f"TOKENS={shipped[0]} ENCODE_WARPS={shipped[1]}; {torch.cuda.get_device_name(device)}")
    print(f"{'n':>7s} {'tokens':>6s} {'warps':>5s} {'ms':>8s} {'vs shipped':>10s} same")
    for n in args.contexts:
        keys = torch.randn(1, heads, n, dim, device=device).to(torch.bfloat16)
        signs = analytic.srht_signs(dim, 0, device)

        def outputs():
            return [torch.zeros(1, heads, n, subspaces, dtype=torch.uint8, device=device),
                    torch.zeros(1, heads, n, dim // 2, dtype=torch.uint8, device=device),
                    torch.zeros(1, heads, n, device=device), torch.zeros(1, heads, n, device=device)]

        settings = [shipped] + [(t, w) for t in args.tokens for w in args.warps if (t, w) != shipped]
        first_ms, first_out = None, None
        try:
            for tokens, warps in settings:
                module.TOKENS, analytic_encoding.ENCODE_WARPS = tokens, warps
                out = outputs()
                module.analytic_encode(keys, signs, subspaces, *out)
                same = "-" if first_out is None else str(all(torch.equal(a, b) for a, b in zip(out, first_out)))
                ms = time_ms(lambda: module.analytic_encode(keys, signs, subspaces, *out), device,
                             repeats=args.repeats, warmup=2)
                first_ms, first_out = (ms, out) if first_ms is None else (first_ms, first_out)
                print(f"{n:7d} {tokens:6d} {warps:5d} {ms:8.3f} {ms / first_ms:10.3f} {same}", flush=True)
        finally:
            module.TOKENS, analytic_encoding.ENCODE_WARPS = shipped
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
