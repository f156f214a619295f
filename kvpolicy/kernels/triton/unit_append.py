"""Triton decode-unit append (op ``append_to_unit``): a token leaving the local window, filed
in its sequence's open unit of the ``UnitTable`` in one launch.

One program per sequence: it decides the sequence's open unit (a new one on a cut), writes
``open_unit`` / ``decode_units`` itself, and updates that unit's ``start``, ``size``, key
statistics and ``selectable`` for every head, ``[BLOCK_H, D]`` at a time, and the token's
``order`` entry. One program owns all of a sequence's entries, so no program can read a counter
another has already advanced. The float32 statistics use the same single rounding per element
as the reference (an add, a min, a max), so results are bit-identical. Positions and slots are
read from device tensors and the grid comes from shapes alone: the launch can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous

# float32 elements of one [BLOCK_H, BLOCK_D] tile: four such tiles (key, sum, min, max) stay in
# registers of a 4-warp program (16 per thread each)
_TILE = 2048


@pdl_kernel
@triton.jit
def _append_kernel(
    order_ptr, start_ptr, size_ptr, sum_ptr, min_ptr, max_ptr, mean_ptr, sel_ptr, open_ptr, units_ptr,
    position_ptr, slot_ptr, key_ptr, valid_ptr, cut_ptr, boundary_ptr,
    H, num_prompt_units, max_size, boundary_sb,
    order_sb, order_sh, order_sp,
    start_sb, start_sh, start_su,
    size_sb, size_sh, size_su,
    sum_sb, sum_sh, sum_su, sum_sd,
    min_sb, min_sh, min_su, min_sd,
    max_sb, max_sh, max_su, max_sd,
    mean_sb, mean_sh, mean_su, mean_sd,
    sel_sb, sel_sh, sel_su,
    open_s, units_s,
    key_sb, key_sh, key_sd,
    valid_s, cut_s,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BY_RULE: tl.constexpr, AT_BOUNDARY: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    position = tl.load(position_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    valid = tl.load(valid_ptr + b * valid_s) != 0
    old_open = tl.load(open_ptr + b * open_s).to(tl.int64)
    if BY_RULE:
        # the builder's cut rule (UnitBuilder.cut_rule), decided here rather than in ~10 launches
        open_size = tl.load(size_ptr + b * size_sb + tl.maximum(old_open, 0) * size_su)
        open_size = tl.where(old_open >= 0, open_size, 0)
        cut = (open_size == 0) | (open_size >= max_size)
        if AT_BOUNDARY:
            cut = cut | (tl.load(boundary_ptr + b * boundary_sb + slot) != 0)
        cut = cut & valid
    else:
        cut = tl.load(cut_ptr + b * cut_s) != 0
    opened_so_far = tl.load(units_ptr + b * units_s).to(tl.int64)
    # a cut opens unit num_prompt_units + decode_units[b]
    opened = tl.where(cut, opened_so_far + num_prompt_units, old_open)
    # no open unit: unit 0, rewritten with what it holds unless the token is valid (as the reference)
    unit = tl.maximum(opened, 0)
    now_selectable = valid & (opened >= 0)

    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        h_ok = heads < H
        tl.store(order_ptr + b * order_sb + heads * order_sh + position * order_sp,
                 tl.zeros([BLOCK_H], dtype=tl.int64) + slot, mask=h_ok)

        start_at = start_ptr + b * start_sb + heads * start_sh + unit * start_su
        old_start = tl.load(start_at, mask=h_ok, other=0)
        tl.store(start_at, tl.where(cut, position, old_start), mask=h_ok)
        size_at = size_ptr + b * size_sb + heads * size_sh + unit * size_su
        old_size = tl.load(size_at, mask=h_ok, other=0)
        new_size = tl.where(cut, 0, old_size) + valid.to(tl.int64)
        tl.store(size_at, new_size, mask=h_ok)
        sel_at = sel_ptr + b * sel_sb + heads * sel_sh + unit * sel_su
        old_sel = tl.load(sel_at, mask=h_ok, other=0) != 0
        tl.store(sel_at, (old_sel | now_selectable).to(tl.uint8), mask=h_ok)

        mask = h_ok[:, None] & col_ok[None, :]
        k = tl.load(key_ptr + b * key_sb + heads[:, None] * key_sh + cols[None, :] * key_sd, mask=mask, other=0.0)
        k = k.to(tl.float32)
        sum_at = sum_ptr + b * sum_sb + heads[:, None] * sum_sh + unit * sum_su + cols[None, :] * sum_sd
        min_at = min_ptr + b * min_sb + heads[:, None] * min_sh + unit * min_su + cols[None, :] * min_sd
        max_at = max_ptr + b * max_sb + heads[:, None] * max_sh + unit * max_su + cols[None, :] * max_sd
        old_sum = tl.where(cut, 0.0, tl.load(sum_at, mask=mask, other=0.0))
        old_min = tl.where(cut, float("inf"), tl.load(min_at, mask=mask, other=0.0))
        old_max = tl.where(cut, float("-inf"), tl.load(max_at, mask=mask, other=0.0))
        # torch.minimum / maximum propagate NaN; so do these
        new_sum = tl.where(valid, old_sum + k, old_sum)
        tl.store(sum_at, new_sum, mask=mask)
        # reference.half_mean: a correctly rounded division, clamped, rounded to nearest even
        mean = tl.div_rn(new_sum, tl.maximum(new_size, 1).to(tl.float32)[:, None])
        # NaN stays NaN, as through torch.clamp
        mean = tl.maximum(mean, -65504.0, propagate_nan=tl.PropagateNan.ALL)
        mean = tl.minimum(mean, 65504.0, propagate_nan=tl.PropagateNan.ALL)
        mean_at = mean_ptr + b * mean_sb + heads[:, None] * mean_sh + unit * mean_su + cols[None, :] * mean_sd
        tl.store(mean_at, mean.to(tl.float16), mask=mask)
        tl.store(min_at, tl.where(valid, tl.minimum(old_min, k, propagate_nan=tl.PropagateNan.ALL), old_min), mask=mask)
        tl.store(max_at, tl.where(valid, tl.maximum(old_max, k, propagate_nan=tl.PropagateNan.ALL), old_max), mask=mask)

    tl.store(open_ptr + b * open_s, opened)
    tl.store(units_ptr + b * units_s, opened_so_far + cut.to(tl.int64))


def _launch(table_tensors, position, slot, key, valid, cut, boundary, max_size, at_boundary, num_prompt_units):
    order, start, size, key_sum, key_min, key_max, key_mean, selectable, open_unit, decode_units = table_tensors
    batch, heads, dim = key.shape
    sel = selectable.view(torch.uint8)  # same memory: the kernel writes the table's tensor
    block_d = triton.next_power_of_2(max(dim, 1))
    block_h = min(triton.next_power_of_2(heads), max(1, _TILE // block_d))
    by_rule = cut is None
    cut_arg = valid if by_rule else cut  # unread under the rule
    boundary_arg = boundary if boundary is not None else cut_arg  # unread without the rule
    _append_kernel[(batch,)](
        order, start, size, key_sum, key_min, key_max, key_mean, sel, open_unit, decode_units,
        position, slot, key, valid.view(torch.uint8), cut_arg.view(torch.uint8), boundary_arg.view(torch.uint8),
        heads, num_prompt_units, max_size, boundary_arg.stride(0),
        *order.stride(), *start.stride(), *size.stride(),
        *key_sum.stride(), *key_min.stride(), *key_max.stride(), *key_mean.stride(),
        *sel.stride(), open_unit.stride(0), decode_units.stride(0),
        *key.stride(), valid.stride(0), cut_arg.stride(0),
        D=dim, BLOCK_H=block_h, BLOCK_D=block_d, BY_RULE=by_rule, AT_BOUNDARY=bool(at_boundary),
    )


@implement("triton", "append_leaving_by_rule", supports=triton_runs_on)
def append_leaving_by_rule(table, slot, key, valid, boundary, max_size: int, at_boundary: bool) -> None:
    """One launch of ``reference_step.append_leaving_by_rule`` (the cut decided in the kernel)."""
    batch, heads, _ = key.shape
    if batch == 0 or heads == 0:
        return
    if boundary.dtype != torch.bool or boundary.shape[0] != batch or boundary.stride(1) != 1:
        raise ValueError(f"triton append_leaving_by_rule: boundary must be bool (B, capacity), got "
                         f"{boundary.dtype} {tuple(boundary.shape)}")
    tensors = (table.order, table.start, table.size, table.key_sum, table.key_min, table.key_max, table.key_mean,
               table.selectable, table.open_unit, table.decode_units)
    _launch(tensors, table.order_next, slot, key, valid, None, boundary, int(max_size), at_boundary,
            table.num_prompt_units)


@implement("triton", "append_to_unit", supports=triton_runs_on)
def append_to_unit(
    order: torch.Tensor,
    start: torch.Tensor,
    size: torch.Tensor,
    key_sum: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    key_mean: torch.Tensor,
    selectable: torch.Tensor,
    open_unit: torch.Tensor,
    decode_units: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    cut: torch.Tensor,
    num_prompt_units: int,
) -> None:
    """File one leaving token in its sequence's open unit, in place, in one launch; see the reference."""
    batch, heads, dim = key.shape
    units = start.shape[-1]
    shapes = {
        "order": (order, (batch, heads, order.shape[-1]), torch.long),
        "start": (start, (batch, heads, units), torch.long),
        "size": (size, (batch, heads, units), torch.long),
        "key_sum": (key_sum, (batch, heads, units, dim), torch.float32),
        "key_min": (key_min, (batch, heads, units, dim), torch.float32),
        "key_max": (key_max, (batch, heads, units, dim), torch.float32),
        "key_mean": (key_mean, (batch, heads, units, dim), torch.float16),
        "selectable": (selectable, (batch, heads, units), torch.bool),
        "open_unit": (open_unit, (batch,), torch.long),
        "decode_units": (decode_units, (batch,), torch.long),
        "valid": (valid, (batch,), torch.bool),
        "cut": (cut, (batch,), torch.bool),
    }
    for name, (tensor, shape, dtype) in shapes.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != key.device:
            raise ValueError(f"triton append_to_unit: {name} must be {dtype} {shape} on {key.device}, got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
    for name, tensor in (("position", position), ("slot", slot)):
        if tensor.numel() != 1 or tensor.device != key.device:
            raise ValueError(f"triton append_to_unit: {name} must be a one-element tensor on the key's device")
    if batch == 0 or heads == 0:
        return
    tensors = (order, start, size, key_sum, key_min, key_max, key_mean, selectable, open_unit, decode_units)
    _launch(tensors, position, slot, key, valid, cut, None, 0, False, num_prompt_units)
