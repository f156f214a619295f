"""Triton 4-bit rerank (op ``rerank``): estimated ``q·k`` of the candidates, then top-k.

One program per (sequence, KV head, block of candidates): it reads each candidate's packed
codes (``D / 2`` bytes, one row per candidate, so only candidates' bytes are touched), splits
the low and high nibbles, looks the 3 magnitude bits up in the 8 levels, applies the sign bit
and dots with the query's even and odd coordinates; ``norm * weight`` scales the result. The
final top-k of the candidates is ``torch.topk`` on the device, shared with the reference so
both rank identically.

A query per head of the group (``rerank="head_softmax"``, ``(B, H, G, D)``) is scored by
``head_softmax.py``'s kernels instead (each head's softmax over the candidates, summed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...analytic import magnitude_levels
from ..dispatch import implement, triton_runs_on
from ..reference_analytic import topk_of_candidates
from . import head_softmax
from .pdl import pdl_kernel, wait_for_previous

# candidates per program: BLOCK_C * D / 2 code bytes in registers (8 KiB at D=128)
_BLOCK_C = 128


@pdl_kernel
@triton.jit
def _rerank_kernel(
    query_ptr, codes_ptr, weight_ptr, norms_ptr, cand_ptr, levels_ptr, out_ptr,
    H, C,
    q_sb, q_sh, q_sd,
    code_sb, code_sh, code_sn, code_sd,
    weight_sb, weight_sh, weight_sn,
    norm_sb, norm_sh, norm_sn,
    cand_sb, cand_sh, cand_sc,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_HALF)
    in_c = c < C
    in_i = i < HALF
    cand = tl.load(cand_ptr + b * cand_sb + h * cand_sh + c * cand_sc, mask=in_c, other=-1).to(tl.int64)
    listed = cand >= 0
    token = tl.where(listed, cand, 0)
    # coordinate 2i is byte i's low nibble, 2i + 1 its high nibble
    q_base = query_ptr + b * q_sb + h * q_sh
    q_even = tl.load(q_base + (2 * i) * q_sd, mask=in_i, other=0.0).to(tl.float32)
    q_odd = tl.load(q_base + (2 * i + 1) * q_sd, mask=in_i, other=0.0).to(tl.float32)
    rows = listed[:, None] & in_i[None, :]
    packed = tl.load(
        codes_ptr + b * code_sb + h * code_sh + token[:, None] * code_sn + i[None, :] * code_sd,
        mask=rows, other=0,
    ).to(tl.int32)
    low = packed & 15
    high = packed >> 4
    low_mag = tl.load(levels_ptr + (low & 7))
    high_mag = tl.load(levels_ptr + (high & 7))
    low_val = tl.where((low & 8) != 0, -low_mag, low_mag)
    high_val = tl.where((high & 8) != 0, -high_mag, high_mag)
    terms = low_val * q_even[None, :] + high_val * q_odd[None, :]
    dot = tl.sum(tl.where(rows, terms, 0.0), axis=1)
    weight = tl.load(weight_ptr + b * weight_sb + h * weight_sh + token * weight_sn, mask=listed, other=0.0)
    norm = tl.load(norms_ptr + b * norm_sb + h * norm_sh + token * norm_sn, mask=listed, other=0.0)
    score = weight.to(tl.float32) * norm.to(tl.float32) * dot
    tl.store(out_ptr + bh * C + c, tl.where(listed, score, float("-inf")), mask=in_c)


def rerank_scores(
    query_rotated: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """Estimated ``q·k / |q|`` per candidate ``(B, H, C)`` float32; see ``reference_analytic.rerank_scores``."""
    batch, heads, n, half = codes.shape
    count = candidates.shape[-1]
    if (tuple(query_rotated.shape) != (batch, heads, 2 * half) or tuple(weight.shape) != (batch, heads, n)
            or tuple(norms.shape) != (batch, heads, n) or tuple(candidates.shape[:2]) != (batch, heads)):
        raise ValueError(
            f"triton rerank: query {tuple(query_rotated.shape)}, weight {tuple(weight.shape)}, norms "
            f"{tuple(norms.shape)} or candidates {tuple(candidates.shape)} do not fit codes {tuple(codes.shape)}"
        )
    out = torch.empty(batch, heads, count, dtype=torch.float32, device=codes.device)
    if out.numel() == 0:
        return out
    levels = magnitude_levels(2 * half, codes.device)
    _rerank_kernel[(batch * heads, triton.cdiv(count, _BLOCK_C))](
        query_rotated, codes, weight, norms, candidates, levels, out,
        heads, count,
        *query_rotated.stride(),
        *codes.stride(),
        *weight.stride(),
        *norms.stride(),
        *candidates.stride(),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_C=_BLOCK_C,
    )
    return out


@implement("triton", "rerank", supports=triton_runs_on)
def rerank(
    query_rotated: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Top-``k`` candidates by estimated ``q·k``, ``(B, H, k)`` long; see ``reference_analytic.rerank``.
    A query per head of the group (``rerank="head_softmax"``, ``(B, H, G, D)``) ranks by
    ``head_softmax.scores`` (``reference_analytic.candidate_scores``)."""
    scores = candidate_scores(query_rotated, codes, weight, norms, candidates)
    return topk_of_candidates(scores, candidates, k)


def candidate_scores(
    query: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """The rerank's score per candidate ``(B, H, C)`` float32 for either query shape; see
    ``reference_analytic.candidate_scores``."""
    if query.dim() == 3:  # the group's mean: rerank_scores checks it
        return rerank_scores(query, codes, weight, norms, candidates)
    head_softmax.check_query("rerank", query, codes)
    batch, heads, n, _ = codes.shape
    if (tuple(weight.shape) != (batch, heads, n) or tuple(norms.shape) != (batch, heads, n)
            or candidates.dim() != 3 or tuple(candidates.shape[:2]) != (batch, heads)):
        raise ValueError(
            f"triton rerank: weight {tuple(weight.shape)}, norms {tuple(norms.shape)} or candidates "
            f"{tuple(candidates.shape)} do not fit codes {tuple(codes.shape)}"
        )
    return head_softmax.scores(query, codes, weight, norms, candidates)
