"""Triton K-means (op ``kmeans``): Lloyd iterations batched over (sequence x KV head).

Same contract and initialisation as ``reference.kmeans`` (``init`` "spaced" or "pages",
``precision`` "split" or "bf16"). "pages" starts with one update (``_accumulate`` +
``_finalize``) from the page labels. Per iteration three launches (two with ``FUSE_UPDATE``, the
default: the assignment does the accumulation):

- ``_assign``: one program per (token block, sequence x head); the key tile stays in
  registers while the program walks all centroids in blocks, scoring ``||c||^2 - 2 x.c``
  with ``tl.dot`` and keeping a running min/argmin (first index wins ties, like argmin).
- ``_accumulate``: valid tokens atomically add their key and a count into float32
  per-cluster buffers.
- ``_finalize``: divides, keeps the old centroid of an emptied cluster, prepares the next
  assignment's operands (below) and zeroes the buffers. It also prepares the initial ones.

Precision. A plain fp32 ``tl.dot`` runs in TF32 on the GPU (inputs rounded to 11 bits),
which flips labels well away from exact ties; IEEE fp32 would leave the tensor cores. So
each centroid is split into two bfloat16 halves, ``c ~= hi + lo`` (about 16 bits kept),
and ``x.c = x.hi + x.lo`` is two bf16 dots with fp32 accumulation: as cheap as one TF32
dot and about 64 times more accurate. bf16 keys are exact in bf16; fp16 and fp32 keys are
split too and a third dot adds ``x_lo.hi`` (``x_lo.lo`` is below the error left). The
error in ``x.c`` stays near 1e-5 of ``|x||c|``, so labels differ from the fp32 reference
only at near-ties (on an H200, bf16 keys, n=32768, C=2048: none of 262144 after 3
iterations). float32 atomic sums add in a varying order, so centroids (and labels at such
near-ties) can differ from run to run in the last bits. Triton's CPU interpreter gets
fp32 operands instead of bf16 ones (it cannot multiply bf16); the products are the same.
``precision="bf16"`` drops the ``lo`` dots: one bf16 dot against the centroid rounded to
bf16 (norm of the rounded centroid), half the assignment's FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous

# True: each assignment adds its keys into the cluster sums itself (the key tile is already in
# its registers), so an iteration is two launches (assign, finalize) instead of three, and the
# keys are read once; the same float32 atomics as ``_accumulate``, in another order. On an H200
# (8 heads, D=128, bf16; session 18) an 8K prefill's K-means kernels took 15.4 ms against 16.5
# (assign + accumulate, 36 layers), and a layer's K-means 5.0 ms against 5.1 at 32K and 5.4 against
# 6.1 at 64K in segments of 16K; measured with bf16 keys only (fp16 and fp32 keys keep their raw
# tile live through the centroid loop too, which may cost registers)
FUSE_UPDATE = True


@triton.jit
def _round_bf16(x):
    """float32 -> bfloat16 rounded to nearest even, spelled out in bits: the GPU's own cast does
    this, Triton's CPU interpreter truncates (which precision "bf16" would see: the reference
    rounds). Finite inputs only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@pdl_kernel
@triton.jit
def _assign(
    keys_ptr, hi_ptr, lo_ptr, norm_ptr, labels_ptr, valid_ptr, sums_ptr, counts_ptr,
    n, C, D, H,
    stride_b, stride_h, stride_n, stride_d,
    SPLIT_X: tl.constexpr, ONE_DOT: tl.constexpr, UPCAST: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: offsets below reach past 2**31 on long prompts
    b = bh // H
    h = bh % H
    tokens = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    token_ok = tokens < n
    dim_ok = dims < D

    x_ptrs = (keys_ptr + b * stride_b + h * stride_h
              + tokens[:, None].to(tl.int64) * stride_n + dims[None, :] * stride_d)
    x = tl.load(x_ptrs, mask=token_ok[:, None] & dim_ok[None, :], other=0.0)
    if SPLIT_X:
        xf = x.to(tl.float32)
        x_hi = _round_bf16(xf)
        if not ONE_DOT:
            x_lo = (xf - x_hi.to(tl.float32)).to(tl.bfloat16)
    else:
        x_hi = x  # bf16 keys: exact
    if UPCAST:
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; fp32 products of
        # bf16 operands are exact, so this computes the same values as the GPU path
        x_hi = x_hi.to(tl.float32)
        if SPLIT_X and not ONE_DOT:
            x_lo = x_lo.to(tl.float32)

    best = tl.full([BLOCK_N], float("inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_N], tl.int32)
    c_base = bh * C * D
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        # centroid tiles loaded transposed, [BLOCK_D, BLOCK_C], ready for the dot
        c_off = c_base + cols[None, :].to(tl.int64) * D + dims[:, None]
        c_mask = col_ok[None, :] & dim_ok[:, None]
        c_hi = tl.load(hi_ptr + c_off, mask=c_mask, other=0.0)
        if UPCAST:
            c_hi = c_hi.to(tl.float32)
        dot = tl.dot(x_hi, c_hi)
        if not ONE_DOT:
            c_lo = tl.load(lo_ptr + c_off, mask=c_mask, other=0.0)
            if UPCAST:
                c_lo = c_lo.to(tl.float32)
            dot = tl.dot(x_hi, c_lo, dot)
            if SPLIT_X:
                dot = tl.dot(x_lo, c_hi, dot)
        # padding columns score +inf and never win
        norm = tl.load(norm_ptr + bh * C + cols, mask=col_ok, other=float("inf"))
        dist = norm[None, :] - 2.0 * dot
        block_min, block_arg = tl.min(dist, axis=1, return_indices=True)
        # strict <: an earlier block keeps a tie, as torch.argmin keeps the first index
        better = block_min < best
        best = tl.where(better, block_min, best)
        best_idx = tl.where(better, block_arg + c0, best_idx)

    tl.store(labels_ptr + bh * n + tokens, best_idx.to(tl.int64), mask=token_ok)
    if ACCUMULATE:  # _accumulate's atomics from the key tile already in registers (FUSE_UPDATE)
        use = token_ok & (tl.load(valid_ptr + b * n + tokens, mask=token_ok, other=0) != 0)
        mask = use[:, None] & dim_ok[None, :]
        tl.atomic_add(sums_ptr + (bh * C + best_idx)[:, None] * D + dims[None, :], x.to(tl.float32), mask=mask,
                      sem="relaxed")
        tl.atomic_add(counts_ptr + bh * C + best_idx, tl.full([BLOCK_N], 1.0, tl.float32), mask=use, sem="relaxed")


@pdl_kernel
@triton.jit
def _accumulate(
    keys_ptr, valid_ptr, labels_ptr, sums_ptr, counts_ptr,
    n, C, D, H,
    stride_b, stride_h, stride_n, stride_d,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    tokens = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    # invalid tokens add nothing; their labels are never read
    use = tl.load(valid_ptr + b * n + tokens, mask=tokens < n, other=0) != 0
    labels = tl.load(labels_ptr + bh * n + tokens, mask=use, other=0)
    mask = use[:, None] & (dims < D)[None, :]
    x = tl.load(keys_ptr + b * stride_b + h * stride_h
                + tokens[:, None].to(tl.int64) * stride_n + dims[None, :] * stride_d,
                mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(sums_ptr + (bh * C + labels)[:, None] * D + dims[None, :], x, mask=mask, sem="relaxed")
    tl.atomic_add(counts_ptr + bh * C + labels, tl.full([BLOCK_N], 1.0, tl.float32), mask=use, sem="relaxed")


@pdl_kernel
@triton.jit
def _finalize(
    centroids_ptr, sums_ptr, counts_ptr, hi_ptr, lo_ptr, norm_ptr,
    C, D,
    HI_NORM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    pid_c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < C
    mask = col_ok[:, None] & (dims < D)[None, :]
    off = (bh * C + cols)[:, None] * D + dims[None, :]
    count = tl.load(counts_ptr + bh * C + cols, mask=col_ok, other=0.0)
    total = tl.load(sums_ptr + off, mask=mask, other=0.0)
    old = tl.load(centroids_ptr + off, mask=mask, other=0.0)
    # an emptied cluster keeps its old centroid
    c = tl.where(count[:, None] > 0, total / tl.maximum(count, 1.0)[:, None], old)
    tl.store(centroids_ptr + off, c, mask=mask)
    c_hi = _round_bf16(c)
    tl.store(hi_ptr + off, c_hi, mask=mask)
    tl.store(lo_ptr + off, (c - c_hi.to(tl.float32)).to(tl.bfloat16), mask=mask)
    if HI_NORM:  # precision "bf16": the distance is to the rounded centroid
        c_round = c_hi.to(tl.float32)
        tl.store(norm_ptr + bh * C + cols, tl.sum(c_round * c_round, axis=1), mask=col_ok)
    else:
        tl.store(norm_ptr + bh * C + cols, tl.sum(c * c, axis=1), mask=col_ok)
    tl.store(sums_ptr + off, tl.zeros([BLOCK_C, BLOCK_D], tl.float32), mask=mask)
    tl.store(counts_ptr + bh * C + cols, tl.zeros([BLOCK_C], tl.float32), mask=col_ok)


def _pow2(x: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(x)))


def _assign_config(n: int, C: int, block_d: int, split_x: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_C, num_warps, num_stages) of ``_assign``, the fastest measured on an
    H200 at n=131072, C=8192, D=128 (bf16 keys 8.5 ms per (sequence x 8 heads), 520 TFLOP/s;
    split keys 12 ms). A 128-token tile amortises each centroid load over 128 rows."""
    if block_d > 128:  # stay within shared memory
        block_n, block_c, warps = 64, 64, 4
    elif split_x:
        block_n, block_c, warps = 128, 128, 8
    else:
        block_n, block_c, warps = 128, 64, 4
    return _pow2(n, 16, block_n), _pow2(C, 16, block_c), warps, 2


@implement("triton", "kmeans", supports=triton_runs_on)
def kmeans(
    keys: torch.Tensor, valid: torch.Tensor, num_clusters: int, iters: int, init: str = "spaced",
    precision: str = "split",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's K-means per (sequence, KV head); see ``reference.kmeans`` for the contract
    (``init`` "spaced" or "pages", ``precision`` "split" or "bf16")."""
    if init not in reference.KMEANS_INITS:
        raise ValueError(f"kmeans: init must be one of {', '.join(reference.KMEANS_INITS)}, got {init!r}")
    if precision not in reference.KMEANS_PRECISIONS:
        raise ValueError(f"kmeans: precision must be one of {', '.join(reference.KMEANS_PRECISIONS)}, got {precision!r}")
    batch, heads, n, dim = keys.shape
    device = keys.device
    C = num_clusters
    if keys.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        keys = keys.float()

    # initialisation: the reference's own ops, so the starting tokens are identical
    seen = torch.cumsum(valid.long(), dim=-1)  # (B, n)
    count = seen[:, -1:].clamp(min=1)
    spaced = torch.linspace(0, 1, C, device=device)
    wanted = (spaced * (count - 1)).round().long() + 1
    first = torch.searchsorted(seen.contiguous(), wanted.contiguous()).clamp(max=n - 1)  # (B, C)
    centroids = keys.gather(2, first[:, None, :, None].expand(batch, heads, C, dim)).float().contiguous()
    if init == "pages":
        labels = reference.kmeans_page_labels(valid, C)[:, None, :].expand(batch, heads, n).contiguous()
    else:
        labels = torch.zeros(batch, heads, n, dtype=torch.long, device=device)
    if iters <= 0 and init == "spaced":
        return labels, centroids

    sums = torch.zeros(batch, heads, C, dim, dtype=torch.float32, device=device)
    counts = torch.zeros(batch, heads, C, dtype=torch.float32, device=device)
    c_hi = torch.empty(batch, heads, C, dim, dtype=torch.bfloat16, device=device)
    c_lo = torch.empty_like(c_hi)
    norms = torch.empty(batch, heads, C, dtype=torch.float32, device=device)
    valid8 = valid.to(torch.uint8).contiguous()

    block_d = _pow2(dim, 16, 1 << 30)
    split_x = keys.dtype != torch.bfloat16
    block_n, block_c, warps, stages = _assign_config(n, C, block_d, split_x)
    block_cf = _pow2(C, 1, max(1, 4096 // block_d))
    block_na = _pow2(n, 1, max(1, 4096 // block_d))
    bh = batch * heads
    strides = keys.stride()

    finalize_grid = (triton.cdiv(C, block_cf), bh)
    one_dot = precision == "bf16"

    def accumulate() -> None:
        _accumulate[(triton.cdiv(n, block_na), bh)](
            keys, valid8, labels, sums, counts, n, C, dim, heads, *strides,
            BLOCK_N=block_na, BLOCK_D=block_d,
        )

    def finalize() -> None:
        _finalize[finalize_grid](centroids, sums, counts, c_hi, c_lo, norms, C, dim, HI_NORM=one_dot,
                                 BLOCK_C=block_cf, BLOCK_D=block_d)

    if init == "pages":
        accumulate()  # the pages' mean keys; an empty page keeps its spaced token
    # (with zero counts, finalize only prepares the split centroids and norms of the initial ones)
    finalize()
    fused = FUSE_UPDATE
    for _ in range(iters):
        _assign[(triton.cdiv(n, block_n), bh)](
            keys, c_hi, c_lo, norms, labels, valid8, sums, counts, n, C, dim, heads, *strides,
            SPLIT_X=split_x, ONE_DOT=one_dot, UPCAST=not keys.is_cuda, ACCUMULATE=fused, BLOCK_N=block_n,
            BLOCK_C=block_c, BLOCK_D=block_d, num_warps=warps, num_stages=stages,
        )
        if not fused:  # the assignment did not add the keys into the sums itself
            accumulate()
        finalize()
    return labels, centroids
