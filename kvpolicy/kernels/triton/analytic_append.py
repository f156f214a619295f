"""Triton write of a leaving token into ParisKV's index (op ``analytic_append``), in one launch.

Replaces ``AnalyticIndex.append_leaving_token``'s PyTorch (the flush's where, ``encode_keys``:
the norm, the seven butterfly stages of the rotation, the code's bucketize and packing, the
centroid ids, the calibration weight; then six ``index_copy_`` and the counter: about 73 small
launches a layer and step).

1. ``_encode_kernel``, one program per (sequence, KV head): loads the key, l2-normalises it and
   applies the SRHT signs, rotates it by the Hadamard signs ``(-1)^popcount(i & j) / sqrt(D)`` as
   two small products (``H_D = H_HI (x) H_LO``: ``D x (HI + LO)`` terms, 3,072 at D = 128, where
   the whole ``D x D`` matrix is 16,384, each a 7-bit parity: a single program's arithmetic is
   this launch's time, so it is kept short), and writes at position ``next_position`` its centroid id per
   subspace (bit ``j``: rotated coordinate ``j`` >= 0), its packed 4-bit code (magnitude: the
   thresholds below ``|x|``, as ``bucketize``; bit 3 the sign), ``weight = 1 / <k, k_hat>``
   (0 where not positive) and its norm; the KV head 0 programs write ``token_valid``, the first
   one the slot.
2. the counters, by the last program to finish (an atomic ticket, left at 0 for the next call:
   ``scratch.zeroed``): the flush (``indexed = next_position`` where the buffer is full) and
   ``next_position + 1``, once every program has read the position (a launch of its own before,
   1.1 us of a 32K step's layer on an H200).

The rotation sums in another order than the reference's butterflies (about 1e-7 apart), so a
centroid bit can differ where a rotated coordinate is within that of 0, a magnitude where it is
within that of a threshold, and weight and norm in their last bits; everything else is exact.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import analytic
from ..dispatch import OPS, implement, triton_runs_on
from . import scratch


@triton.jit
def _hadamard_signs(N: tl.constexpr, LOG_N: tl.constexpr):
    """``(N, N)`` True where the Sylvester Hadamard matrix has +1: ``popcount(i & j)`` even."""
    i = tl.arange(0, N)
    both = i[:, None] & i[None, :]
    parity = tl.zeros([N, N], dtype=tl.int32)
    for bit in tl.static_range(LOG_N):
        parity ^= (both >> bit) & 1
    return parity == 0


@triton.jit
def _encode_kernel(
    key_ptr, signs_ptr, thresholds_ptr, values_ptr, next_ptr, valid_ptr, slot_ptr,
    centroids_ptr, codes_ptr, weight_ptr, norms_ptr, token_valid_ptr, slots_ptr, indexed_ptr, ticket_ptr,
    H, BUFFER,
    key_sb, key_sh, key_sd,
    cen_sb, cen_sh, cen_sn, cen_ss,
    code_sb, code_sh, code_sn, code_sd,
    weight_sb, weight_sh, weight_sn,
    norm_sb, norm_sh, norm_sn,
    tv_sb, tv_sn, slot_s,
    inv_sqrt_d,
    D: tl.constexpr, HI: tl.constexpr, LOG_HI: tl.constexpr, LO: tl.constexpr, LOG_LO: tl.constexpr,
    S: tl.constexpr, DIMS: tl.constexpr, LEVELS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    h = row % H
    position = tl.load(next_ptr)
    # the key as a (HI, LO) tile, coordinate HI-index * LO + LO-index (D = HI * LO)
    hi = tl.arange(0, HI)
    lo = tl.arange(0, LO)
    d = hi[:, None] * LO + lo[None, :]
    key = tl.load(key_ptr + b * key_sb + h * key_sh + d * key_sd).to(tl.float32)
    # everything else this program reads, loaded with the key (none of it depends on the key):
    # loaded where used, each waited behind the rotation's barriers, and the levels' values one
    # after another (predicated loads into one register)
    signs = tl.load(signs_ptr + d)
    t = tl.arange(0, LEVELS)
    thresholds = tl.load(thresholds_ptr + t, mask=t < LEVELS - 1, other=float("inf"))  # no level past the last
    values = tl.load(values_ptr + t)
    token_ok = tl.load(valid_ptr + b)
    slot = tl.load(slot_ptr)
    norm = tl.sqrt(tl.sum(tl.sum(key * key, axis=1), axis=0))
    unit = key / tl.maximum(norm, 1e-12) * signs
    # the rotation: H_D = H_HI (x) H_LO (Sylvester order), so rotating is two small products,
    # over the low index bits then the high ones: D * (LO + HI) terms, not D * D
    by_lo = tl.sum(tl.where(_hadamard_signs(LO, LOG_LO)[None, :, :], unit[:, None, :], -unit[:, None, :]), axis=2)
    rotated = tl.sum(tl.where(_hadamard_signs(HI, LOG_HI)[:, :, None], by_lo[None, :, :], -by_lo[None, :, :]),
                     axis=1) * inv_sqrt_d
    rotated = tl.reshape(rotated, [D])
    # the code: magnitude = thresholds below |x| (bucketize), bit 3 the sign; its value
    magnitude = tl.sum((tl.abs(rotated)[:, None] > thresholds[None, :]).to(tl.int32), axis=1)
    nibble = magnitude | ((rotated < 0).to(tl.int32) << 3)
    # the code's value, values[nibble], picked among the LEVELS loaded up front (values[8 + m] =
    # -values[m]): one of them and zeros summed, so exactly that value
    level = tl.sum(tl.where(magnitude[:, None] == t[None, :], values[None, :], 0.0), axis=1)
    alignment = tl.sum(rotated * tl.where(rotated < 0, -level, level), axis=0)
    weight = tl.where(alignment > 0, 1.0 / tl.maximum(alignment, 1e-30), 0.0)
    # pack coordinate 2i into byte i's low nibble, 2i + 1 into its high one
    low, high = tl.split(tl.reshape(nibble, [D // 2, 2]))
    i = tl.arange(0, D // 2)
    tl.store(codes_ptr + b * code_sb + h * code_sh + position * code_sn + i * code_sd, (low | (high << 4)).to(tl.uint8))
    # centroid id of subspace s: bit j set where coordinate s * DIMS + j is >= 0
    place = 1 << tl.arange(0, DIMS)
    ids = tl.sum(tl.where(tl.reshape(rotated, [S, DIMS]) >= 0, place[None, :], 0), axis=1)
    s = tl.arange(0, S)
    tl.store(centroids_ptr + b * cen_sb + h * cen_sh + position * cen_sn + s * cen_ss, ids.to(tl.uint8))
    tl.store(weight_ptr + b * weight_sb + h * weight_sh + position * weight_sn, weight)
    tl.store(norms_ptr + b * norm_sb + h * norm_sh + position * norm_sn, norm)
    if h == 0:
        tl.store(token_valid_ptr + b * tv_sb + position * tv_sn, token_ok)
        if b == 0:
            tl.store(slots_ptr + position * slot_s, slot)
    # the counters move once every program has read the position: the last one here moves them
    # (and puts the ticket back to 0); the barrier puts this program's reads before its ticket
    tl.debug_barrier()
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        indexed = tl.load(indexed_ptr)
        tl.store(indexed_ptr, tl.where(position - indexed >= BUFFER, position, indexed))
        tl.store(next_ptr, position + 1)
        tl.store(ticket_ptr, 0)


def analytic_append(
    centroids: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    token_valid: torch.Tensor,
    slots: torch.Tensor,
    next_position: torch.Tensor,
    indexed: torch.Tensor,
    signs: torch.Tensor,
    subspaces: int,
    update_buffer: int,
    key: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
) -> None:
    """In place; see ``reference_analytic.analytic_append``."""
    batch, heads, n, half = codes.shape
    dim = 2 * half
    dims = analytic.check_subspaces(dim, subspaces)
    if (tuple(key.shape) != (batch, heads, dim) or tuple(centroids.shape) != (batch, heads, n, subspaces)
            or tuple(weight.shape) != (batch, heads, n) or tuple(norms.shape) != (batch, heads, n)
            or tuple(token_valid.shape) != (batch, n) or tuple(slots.shape) != (n,) or valid.numel() != batch
            or slot.numel() != 1 or next_position.numel() != 1 or indexed.numel() != 1):
        raise ValueError(
            f"triton analytic_append: key {tuple(key.shape)}, centroids {tuple(centroids.shape)}, weight "
            f"{tuple(weight.shape)}, token_valid {tuple(token_valid.shape)}, slots {tuple(slots.shape)} or valid "
            f"{tuple(valid.shape)} do not fit codes {tuple(codes.shape)}"
        )
    if batch * heads == 0:
        return
    device = codes.device
    levels, thresholds, values = analytic._levels_on(dim, device)  # cached with the levels
    # the rotation's two factors: the high half of the index bits (fewer), the low half
    log_d = dim.bit_length() - 1
    log_hi = log_d // 2
    token_bytes = token_valid.view(torch.uint8) if token_valid.dtype == torch.bool else token_valid
    valid_bytes = valid.reshape(batch)
    valid_bytes = valid_bytes.view(torch.uint8) if valid_bytes.dtype == torch.bool else valid_bytes
    _encode_kernel[(batch * heads,)](
        key, signs, thresholds, values, next_position, valid_bytes, slot,
        centroids, codes, weight, norms, token_bytes, slots, indexed, scratch.zeroed(device, "analytic_append", (1,)),
        heads, int(update_buffer),
        *key.stride(), *centroids.stride(), *codes.stride(), *weight.stride(), *norms.stride(),
        *token_bytes.stride(), slots.stride(0),
        1.0 / math.sqrt(dim),
        D=dim, HI=1 << log_hi, LOG_HI=log_hi, LO=dim >> log_hi, LOG_LO=log_d - log_hi, S=subspaces, DIMS=dims,
        LEVELS=levels.shape[0],
    )


if "analytic_append" in OPS:  # registered once dispatch.OPS names the op
    implement("triton", "analytic_append", supports=triton_runs_on)(analytic_append)
