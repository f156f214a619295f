"""Registers, spill stack and global loads of the attention kernel's variants, compiled offline for
an H100/H200 (sm_90): no GPU needed, so a session without a device can still see what a kernel
change costs in registers and whether its loads stay 16-byte ``cp.async`` copies.

    python3 benchmarks/kernel_resources.py [--dim 128] [--group 4] [--dtype bf16] [--arch 90]

Compiles ``kvpolicy.kernels.triton.attention._split_kernel`` as a launch would specialise it (the
pointers and the strides that are multiples of 16 marked so, integers as i32; ``BLOCK_N`` and warps
as ``sparse_decode_attention`` picks them), once per variant: a part alone, with pool rows by slot
(``PoolRows``) and through the prompt zone's map, each loaded both ways (``POOL_ROWS_BY_POINTER``). Prints each variant's registers
and spill stack (``cuobjdump -res-usage``) and its global loads by PTX instruction. Uses Triton's
compiler internals (``ASTSource``, ``GPUTarget``), which move between Triton releases: checked with
Triton 3.9 on the CPU; the lent GPU's 3.6 may allocate differently, so read figures as a comparison
between variants of one run, not as the GPU's.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvpolicy.kernels.triton import attention

CONSTEXPRS = ("G", "G_PAD", "D", "BLOCK_N", "QK_FP32", "PV_FP32", "FROM_POOL", "HAS_ZONE", "BY_POINTER", "PDL")
# integer arguments a launch passes as multiples of 16 (strides of dense (B, H, N, D) tensors)
# (the valid mask's strides are the part's row counts: not marked)
DIVISIBLE = ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn",
             "pk_sb", "pk_sh", "pk_sn", "pv_sb", "pv_sh", "pv_sn")
VARIANTS = {  # (FROM_POOL, HAS_ZONE, BY_POINTER)
    "part alone": (False, False, True),
    "pool rows by slot, a pointer a row": (True, False, True),
    "pool rows by slot, two loads": (True, False, False),
    "pool rows through the zone, a pointer a row": (True, True, True),
    "pool rows through the zone, two loads": (True, True, False),
}


def _pointer_type(name: str, dtype: str) -> str:
    if name in ("q_ptr", "k_ptr", "v_ptr", "pk_ptr", "pv_ptr"):
        return f"*{dtype}"
    return {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "slots_ptr": "*i64", "zone_ptr": "*i32"}.get(name, "*u8")


def compile_variant(from_pool: bool, has_zone: bool, by_pointer: bool, dim: int, group: int, dtype: str, arch: int):
    fn = attention._split_kernel
    params = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for name in params:
        if name in CONSTEXPRS:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _pointer_type(name, dtype)
        else:
            # ints below 2**31 launch as i32, as these do at decode sizes (a 1M-token pool's
            # strides past it would be i64)
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    constexprs = dict(G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=dim,
                      BLOCK_N=attention._block_n(dim, 4 if dtype == "fp32" else 2), QK_FP32=dtype == "fp32",
                      PV_FP32=dtype == "fp32", FROM_POOL=from_pool, HAS_ZONE=has_zone, BY_POINTER=by_pointer,
                      PDL=False)  # (without PDL's wait, which an sm_90 launch has: not measured here)
    divisible = [p for p in params if p.endswith("_ptr") or p in DIVISIBLE]
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(params.index(k),): v for k, v in constexprs.items()},
                       attrs={(params.index(p),): [["tt.divisibility", 16]] for p in divisible})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": attention.NUM_WARPS,
                                   "num_stages": attention.NUM_STAGES_BY_SLOT if from_pool else attention.NUM_STAGES})


def resources(kernel) -> str:
    """``cuobjdump -res-usage``'s line for the kernel's cubin (Triton's own cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        out = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return next(line.strip() for line in out.splitlines() if "REG:" in line)


def loads(kernel) -> dict[str, int]:
    """Global loads and asynchronous copies by PTX instruction."""
    pattern = r"(ld\.global[.\w]*|cp\.async\.c[ag][.\w]*|ld\.local[.\w]*|st\.local[.\w]*)"
    return dict(collections.Counter(m.group(1) for m in re.finditer(pattern, kernel.asm["ptx"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--arch", type=int, default=90, help="compute capability, 90 for sm_90")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}, head_dim {args.dim}, group {args.group}, {args.dtype}")
    for label, variant in VARIANTS.items():
        kernel = compile_variant(*variant, args.dim, args.group, args.dtype, args.arch)
        print(f"{label:44s} {resources(kernel)}")
        print(f"{'':44s} {loads(kernel)}")


if __name__ == "__main__":
    main()
