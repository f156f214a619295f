"""Instructions and registers of one block of the outlier trigger's key products, compiled offline for sm_90
(no GPU): int8 keys converted to bfloat16 for a bfloat16 query (what ``score_gap_outlier``'s blocks kernel does)
against an int8 x int8 product into int32 (what a query held as int8 digits would allow).

    python3 benchmarks/int8_product_probe.py     # needs Triton's compiler (any machine; sm_90 target)

A stand-in kernel of the blocks kernel's shape: 64 units a program, D = 128, 16 query-head columns, 5 keys a
unit (4 outliers and the rest mean), each key's logits folded into a running logsumexp. Prints each variant's
SASS instruction count, its most frequent instructions and its registers (``cuobjdump``). Session 34: the blocks
kernel (28 us a layer at 1x128K, a third of the H200's HBM speed) is 3,216 straight-line instructions a warp,
592 of them byte permutes of the int8-to-bfloat16 conversion; it is bound by issuing them, not by its bytes.
Uses Triton's compiler internals through ``tests/kernels/triton/hopper_compile.py``'s stand-in driver.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels", "triton"))
import hopper_compile  # noqa: E402

hopper_compile.compiling_launches()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

UNITS, DIM, COLUMNS, KEYS = 64, 128, 16, 5


@triton.jit
def _keys_logsumexp(keys, q, out, INT8: tl.constexpr, M: tl.constexpr):
    units = tl.program_id(0) * 64 + tl.arange(0, 64)
    dims = tl.arange(0, 128)
    columns = tl.arange(0, 16)
    q_t = tl.load(q + dims[:, None] * 16 + columns[None, :])
    if not INT8:
        q_t = q_t.to(tl.bfloat16)
    top = tl.full([64, 16], float("-inf"), tl.float32)
    total = tl.zeros([64, 16], tl.float32)
    for j in tl.static_range(M):
        tile = tl.load(keys + (units[:, None] * M + j) * 128 + dims[None, :])
        if INT8:
            logits = tl.dot(tile, q_t, out_dtype=tl.int32).to(tl.float32)
        else:
            logits = tl.dot(tile.to(tl.bfloat16), q_t, out_dtype=tl.float32)
        new_top = tl.maximum(top, logits)
        total = total * tl.exp(top - new_top) + tl.exp(logits - new_top)
        top = new_top
    tl.store(out + units[:, None] * 16 + columns[None, :], top + tl.log(total))


def main() -> int:
    cuobjdump = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    if not cuobjdump:
        print("int8_product_probe: Triton's cuobjdump was not found", file=sys.stderr)
        return 2
    keys = torch.zeros(128 * UNITS * KEYS * DIM, dtype=torch.int8)
    q = torch.zeros(DIM * COLUMNS, dtype=torch.int8)
    out = torch.zeros(128 * UNITS * COLUMNS)
    seen: set[int] = set()
    for int8 in (False, True):
        _keys_logsumexp[(128,)](keys, q, out, INT8=int8, M=KEYS)
        compiled = [k for cache in _keys_logsumexp.device_caches.values() for k in cache[0].values()]
        kernel = next(k for k in compiled if id(k) not in seen)  # this launch's: the one not seen before
        seen.add(id(kernel))
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([cuobjdump[0], "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([cuobjdump[0], "-res-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        ops = collections.Counter(m.group(2).split(".")[0] for m in
                                  re.finditer(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
        registers = re.search(r"REG:(\d+)", usage)
        label = "int8 x int8 -> int32" if int8 else "int8 keys -> bfloat16, bfloat16 query"
        print(f"{label}: {sum(ops.values())} instructions, {registers.group(1) if registers else '?'} registers; "
              f"most frequent: {', '.join(f'{op} {n}' for op, n in ops.most_common(6))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
