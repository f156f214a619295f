"""Triton write of a leaving token into ParisKV's index (op ``analytic_append``), in one launch.

Replaces ``AnalyticIndex.append_leaving_token``'s PyTorch (the flush's where, ``encode_keys``:
the norm, the seven butterfly stages of the rotation, the code's bucketize and packing, the
centroid ids, the calibration weight; then six ``index_copy_`` and the counter: about 73 small
launches a layer and step).

1. ``_encode_kernel``, one program per (sequence, KV head): loads the key and encodes it into
   position ``next_position`` (``analytic_encoding.encode_key_into``, shared with the prompt's op
   ``analytic_encode``: the rotation as two small Hadamard products, the centroid ids, the packed
   4-bit code, the weight and the norm; a single program's arithmetic is this launch's time, so it
   is kept short); the KV head 0 programs write ``token_valid``, the first one the slot.
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
from . import analytic_encoding
from .analytic_encoding import encode_key_into, key_tile, load_levels, rotation_factors
from .pdl import pdl_kernel, wait_for_previous


@pdl_kernel
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
    S: tl.constexpr, DIMS: tl.constexpr, LEVELS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    h = row % H
    position = tl.load(next_ptr)
    d = key_tile(HI, LO)
    key = tl.load(key_ptr + b * key_sb + h * key_sh + d * key_sd).to(tl.float32)
    # everything else this program reads, loaded with the key (none of it depends on the key):
    # loaded where used, each waited behind the rotation's barriers, and the levels' values one
    # after another (predicated loads into one register)
    signs = tl.load(signs_ptr + d)
    thresholds, values = load_levels(thresholds_ptr, values_ptr, LEVELS)
    token_ok = tl.load(valid_ptr + b)
    slot = tl.load(slot_ptr)
    encode_key_into(
        key, signs, thresholds, values,
        codes_ptr + b * code_sb + h * code_sh + position * code_sn, code_sd,
        centroids_ptr + b * cen_sb + h * cen_sh + position * cen_sn, cen_ss,
        weight_ptr + b * weight_sb + h * weight_sh + position * weight_sn,
        norms_ptr + b * norm_sb + h * norm_sh + position * norm_sn,
        inv_sqrt_d, D, HI, LOG_HI, LO, LOG_LO, S, DIMS, LEVELS,
    )
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
        S=subspaces, DIMS=dims, LEVELS=levels.shape[0], **rotation_factors(dim), num_warps=analytic_encoding.ENCODE_WARPS,
    )


if "analytic_append" in OPS:  # registered once dispatch.OPS names the op
    implement("triton", "analytic_append", supports=triton_runs_on)(analytic_append)
