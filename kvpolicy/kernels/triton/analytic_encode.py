"""Triton encoding of a prompt's keys into ParisKV's fresh index (op ``analytic_encode``), one launch a layer.

Replaces ``analytic.encode_keys`` on the whole prompt in ``AnalyticIndex.from_prompt`` (the norm, the
seven butterfly stages of the rotation, the code's bucketize and packing, the dequantized alignment,
the centroid ids, each a small elementwise launch over ``(B, H, n, D)``, then four copies into the
index: ~70 ms of an 8K prefill's kernel time over 36 layers on an H200, most of it launches).

``_encode_prompt_kernel``: one program per ``TOKENS`` consecutive tokens of one (sequence, KV head),
each token encoded as a decode step encodes its leaving token (``analytic_encoding.encode_key_into``,
shared with ``_encode_kernel`` of ``analytic_append.py``) and written straight into its position of
the index. The signs and the code levels are loaded once per program. Same tolerance against the
reference as ``analytic_append``: a centroid bit or a magnitude can differ where a rotated coordinate
is within ~1e-7 of 0 or of a threshold, weight and norm in their last bits; everything else is exact.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import analytic
from ..dispatch import OPS, implement, triton_runs_on
from . import analytic_encoding
from .analytic_encoding import encode_key_into, key_tile, load_levels, rotation_factors
from .pdl import pdl_kernel, wait_for_previous

# tokens a program encodes one after another: the signs' and levels' loads amortised, and still
# 8,192 programs at 8K tokens x 8 KV heads (enough to fill an H200)
TOKENS = 8


@pdl_kernel
@triton.jit
def _encode_prompt_kernel(
    key_ptr, signs_ptr, thresholds_ptr, values_ptr,
    centroids_ptr, codes_ptr, weight_ptr, norms_ptr,
    H, N,
    key_sb, key_sh, key_sn, key_sd,
    cen_sb, cen_sh, cen_sn, cen_ss,
    code_sb, code_sh, code_sn, code_sd,
    weight_sb, weight_sh, weight_sn,
    norm_sb, norm_sh, norm_sn,
    inv_sqrt_d,
    D: tl.constexpr, HI: tl.constexpr, LOG_HI: tl.constexpr, LO: tl.constexpr, LOG_LO: tl.constexpr,
    S: tl.constexpr, DIMS: tl.constexpr, LEVELS: tl.constexpr, TOKENS: tl.constexpr, PDL: tl.constexpr,
):
    # tokens on axis 0 (up to 2^31 programs), (sequence, head) on axis 1 (65,535 at most)
    wait_for_previous(PDL)
    first = tl.program_id(0).to(tl.int64) * TOKENS
    row = tl.program_id(1).to(tl.int64)
    b = row // H
    h = row % H
    d = key_tile(HI, LO)
    signs = tl.load(signs_ptr + d)
    thresholds, values = load_levels(thresholds_ptr, values_ptr, LEVELS)
    for j in range(TOKENS):
        token = first + j
        if token < N:  # the last program's block runs past the prompt
            key = tl.load(key_ptr + b * key_sb + h * key_sh + token * key_sn + d * key_sd).to(tl.float32)
            encode_key_into(
                key, signs, thresholds, values,
                codes_ptr + b * code_sb + h * code_sh + token * code_sn, code_sd,
                centroids_ptr + b * cen_sb + h * cen_sh + token * cen_sn, cen_ss,
                weight_ptr + b * weight_sb + h * weight_sh + token * weight_sn,
                norms_ptr + b * norm_sb + h * norm_sh + token * norm_sn,
                inv_sqrt_d, D, HI, LOG_HI, LO, LOG_LO, S, DIMS, LEVELS,
            )


def analytic_encode(
    keys: torch.Tensor,
    signs: torch.Tensor,
    subspaces: int,
    centroids: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
) -> None:
    """In place; see ``reference_analytic.analytic_encode``."""
    if keys.dim() != 4 or codes.dim() != 4:
        raise ValueError(
            f"triton analytic_encode: keys {tuple(keys.shape)} must be (B, H, n, D) and codes {tuple(codes.shape)} "
            f"(B, H, capacity, D // 2)"
        )
    batch, heads, n, dim = keys.shape
    dims = analytic.check_subspaces(dim, subspaces)
    capacity = codes.shape[2]
    if (tuple(codes.shape) != (batch, heads, capacity, dim // 2) or capacity < n
            or tuple(centroids.shape) != (batch, heads, capacity, subspaces)
            or tuple(weight.shape) != (batch, heads, capacity) or tuple(norms.shape) != (batch, heads, capacity)
            or tuple(signs.shape) != (dim,)):
        raise ValueError(
            f"triton analytic_encode: keys {tuple(keys.shape)}, signs {tuple(signs.shape)}, centroids "
            f"{tuple(centroids.shape)}, codes {tuple(codes.shape)}, weight {tuple(weight.shape)} or norms "
            f"{tuple(norms.shape)} do not fit (B, H, capacity >= n) with {subspaces} subspaces"
        )
    if (centroids.dtype, codes.dtype, weight.dtype, norms.dtype) != (torch.uint8, torch.uint8, torch.float32,
                                                                     torch.float32):
        raise ValueError(
            f"triton analytic_encode: centroids {centroids.dtype} and codes {codes.dtype} must be uint8, weight "
            f"{weight.dtype} and norms {norms.dtype} float32"
        )
    if batch * heads > 65535:
        raise ValueError(f"triton analytic_encode: {batch} x {heads} (sequence, head) rows, at most 65,535")
    if batch * heads * n == 0:
        return
    levels, thresholds, values = analytic._levels_on(dim, keys.device)  # cached with the levels
    _encode_prompt_kernel[(triton.cdiv(n, TOKENS), batch * heads)](
        keys, signs.contiguous(), thresholds, values, centroids, codes, weight, norms,
        heads, n,
        *keys.stride(), *centroids.stride(), *codes.stride(), *weight.stride(), *norms.stride(),
        1.0 / math.sqrt(dim),
        S=subspaces, DIMS=dims, LEVELS=levels.shape[0], TOKENS=TOKENS, **rotation_factors(dim), num_warps=analytic_encoding.ENCODE_WARPS,
    )


if "analytic_encode" in OPS:  # registered once dispatch.OPS names the op
    implement("triton", "analytic_encode", supports=triton_runs_on)(analytic_encode)
