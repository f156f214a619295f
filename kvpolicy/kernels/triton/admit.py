"""Triton admission (op ``admit_row``): the token leaving the local window joins the retrieved
buffer of each (sequence, head) that has room, or (with ``kept``) replaces the lowest-ranked
selected row of a full one, in one launch.

One program per (sequence, head) reads its fill count (and ``kept``), and where the token is
admitted writes the key and value rows, the slot, the valid and held flags at row ``fill`` (or
``kept - 1``) and advances ``fill`` (or lowers ``kept``); a program that does not admit stores
nothing but the counters the reference resets. The slot comes from a device tensor and
the grid from shapes alone, so the launch can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous


@pdl_kernel
@triton.jit
def _admit_kernel(
    keys_ptr, values_ptr, slots_ptr, valid_ptr, held_ptr, fill_ptr,
    key_ptr, value_ptr, slot_ptr, reselected_ptr, token_valid_ptr, kept_ptr, admitted_ptr,
    R,
    keys_sb, keys_sh, keys_sr, keys_sd,
    values_sb, values_sh, values_sr, values_sd,
    slots_sb, slots_sh, slots_sr,
    valid_sb, valid_sh, valid_sr,
    held_sb, held_sh, held_sr,
    fill_sb, fill_sh,
    key_sb, key_sh, key_sd,
    value_sb, value_sh, value_sd,
    reselected_s, token_valid_s,
    kept_sb, kept_sh, admitted_sb, admitted_sh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    fill_at = fill_ptr + b * fill_sb + h * fill_sh
    fill = tl.load(fill_at).to(tl.int64)
    may = tl.load(reselected_ptr + b * reselected_s) == 0
    allowed = may & (tl.load(token_valid_ptr + b * token_valid_s) != 0)
    room = fill < R
    append = allowed & room
    row = fill
    if EVICT:
        kept_at = kept_ptr + b * kept_sb + h * kept_sh
        kept = tl.load(kept_at).to(tl.int64)
        # a full buffer gives up its lowest-ranked selected row (rows are in score order)
        replace = allowed & (fill >= R) & (kept > 0)
        row = tl.where(room, fill, kept - 1)
        admit = append | replace
        # a re-selected sequence starts counting from its new selection
        tl.store(kept_at, tl.where(may, kept - replace.to(tl.int64), fill))
    else:
        admit = append
    # the row stays in bounds for the masked stores anyway
    row = tl.minimum(tl.maximum(row, 0), R - 1)
    cols = tl.arange(0, BLOCK_D)
    # columns written: all D where the token is admitted, none elsewhere
    cols_ok = cols < tl.where(admit, D, 0)
    k = tl.load(key_ptr + b * key_sb + h * key_sh + cols * key_sd, mask=cols_ok)
    v = tl.load(value_ptr + b * value_sb + h * value_sh + cols * value_sd, mask=cols_ok)
    tl.store(keys_ptr + b * keys_sb + h * keys_sh + row * keys_sr + cols * keys_sd,
             k.to(keys_ptr.dtype.element_ty), mask=cols_ok)
    tl.store(values_ptr + b * values_sb + h * values_sh + row * values_sr + cols * values_sd,
             v.to(values_ptr.dtype.element_ty), mask=cols_ok)
    slot = tl.load(slot_ptr).to(tl.int64)
    tl.store(slots_ptr + b * slots_sb + h * slots_sh + row * slots_sr, slot, mask=admit)
    one = tl.full([], 1, dtype=tl.uint8)
    tl.store(valid_ptr + b * valid_sb + h * valid_sh + row * valid_sr, one, mask=admit)
    # the ring's copy of a token has the same bits as its pool row
    tl.store(held_ptr + b * held_sb + h * held_sh + row * held_sr, one, mask=admit)
    tl.store(fill_at, fill + 1, mask=append)
    if COUNT:
        admitted_at = admitted_ptr + b * admitted_sb + h * admitted_sh
        tl.store(admitted_at, tl.load(admitted_at) + 1, mask=admit)


@implement("triton", "admit_row", supports=triton_runs_on)
def admit_row(buffer, evicted, reselected: torch.Tensor, kept: torch.Tensor | None = None,
              admitted: torch.Tensor | None = None) -> None:
    """Row ``fill`` of each (sequence, head) with room (with ``kept``: row ``kept - 1`` of a full
    one) takes the evicted token where ``~reselected & evicted.valid``; in place, see the reference."""
    key, value, slot, token_valid = evicted.key, evicted.value, evicted.slot, evicted.valid
    batch, heads, capacity, dim = buffer.keys.shape
    device = buffer.keys.device
    shapes = {
        "buffer.values": (buffer.values, (batch, heads, capacity, dim), buffer.keys.dtype),
        "buffer.slots": (buffer.slots, (batch, heads, capacity), torch.long),
        "buffer.valid": (buffer.valid, (batch, heads, capacity), torch.bool),
        "buffer.held": (buffer.held, (batch, heads, capacity), torch.bool),
        "buffer.fill": (buffer.fill, (batch, heads), torch.long),
        "evicted.key": (key, (batch, heads, dim), key.dtype),
        "evicted.value": (value, (batch, heads, dim), value.dtype),
        "reselected": (reselected, (batch,), torch.bool),
        "evicted.valid": (token_valid, (batch,), torch.bool),
    }
    for name, counter in (("kept", kept), ("admitted", admitted)):
        if counter is not None:
            shapes[name] = (counter, (batch, heads), torch.long)
    for name, (tensor, shape, dtype) in shapes.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != device:
            raise ValueError(f"triton admit_row: {name} must be {dtype} {shape} on {device}, got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
    if slot.numel() != 1 or slot.device != device:
        raise ValueError("triton admit_row: evicted.slot must be a one-element tensor on the buffer's device")
    if batch * heads * capacity == 0:
        return
    valid = buffer.valid.view(torch.uint8)  # same memory: the kernel writes the store's tensors
    held = buffer.held.view(torch.uint8)
    # an absent counter: any long tensor as a placeholder pointer, never read (EVICT/COUNT False)
    kept_t = buffer.fill if kept is None else kept
    admitted_t = buffer.fill if admitted is None else admitted
    _admit_kernel[(heads, batch)](
        buffer.keys, buffer.values, buffer.slots, valid, held, buffer.fill,
        key, value, slot, reselected.view(torch.uint8), token_valid.view(torch.uint8), kept_t, admitted_t,
        capacity,
        *buffer.keys.stride(), *buffer.values.stride(), *buffer.slots.stride(),
        *valid.stride(), *held.stride(), *buffer.fill.stride(),
        *key.stride(), *value.stride(),
        reselected.stride(0), token_valid.stride(0),
        *kept_t.stride(), *admitted_t.stride(),
        D=dim, BLOCK_D=triton.next_power_of_2(max(dim, 1)), EVICT=kept is not None, COUNT=admitted is not None,
    )
