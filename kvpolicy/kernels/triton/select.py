"""Triton budget fill (op ``select_budget``): same contract and results as the reference.

The ranking is ``torch.sort(stable=True)``, exactly the reference's, so ties break the same
way. Everything after it is one kernel launch, one program per (sequence, KV head):

1. zero a per-program scratch row of ``R`` "a unit starts here" flags;
2. walk the ranking in blocks, carrying the running token total and taken count: a block
   prefix sum of the ranked sizes gives each unit's ``[begin, end)`` in the budget; taken
   units (selectable, non-empty, ``begin < R``) are compacted into ``unit_ids`` by a prefix
   sum of the taken flags, their ``start - begin`` goes to a compact scratch row, and a flag
   marks ``begin``;
3. walk the ``R`` output positions in blocks: a prefix sum of the flags numbers the taken unit
   covering each position, so ``slot = order[clamp(p + start - begin)]`` needs no search.

Steps are separated by a block barrier (the scratch is written and read by different threads
of the program). Registers stay bounded by the block sizes whatever ``U`` and ``R`` are. No
host syncs: shapes alone size the grid and the scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on

# units / positions per block step and warps per program (H200, U=8192, R=2048: the fill
# takes ~30 us of ~110, the stable sort the rest; block size and warps barely matter)
_BLOCK = 2048
_NUM_WARPS = 8


@triton.jit
def _fill_kernel(
    ranked_ptr, ranked_scores_ptr, sizes_ptr, starts_ptr, order_ptr,
    unit_ids_ptr, num_units_ptr, slots_ptr, slot_valid_ptr,
    heads_ptr, shift_ptr,
    U, N, R, SHIFT_LEN,
    BLOCK_U: tl.constexpr, BLOCK_R: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    u_base = bh * U
    r_base = bh * R
    zero = bh * 0  # an int64 scalar, for loop-carried totals

    # 1. no unit starts anywhere yet
    for r0 in range(0, R, BLOCK_R):
        p = r0 + tl.arange(0, BLOCK_R)
        tl.store(heads_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=tl.int8), mask=p < R)
    tl.debug_barrier()

    # 2. units in score order
    total = zero  # tokens of all selectable units so far (not capped at R, like the reference)
    count = zero  # units taken so far
    for u0 in range(0, U, BLOCK_U):
        i = u0 + tl.arange(0, BLOCK_U)
        in_range = i < U
        unit = tl.load(ranked_ptr + u_base + i, mask=in_range, other=0)
        score = tl.load(ranked_scores_ptr + u_base + i, mask=in_range, other=float("-inf"))
        selectable = in_range & (score > float("-inf"))  # NaN is not selectable either
        size = tl.load(sizes_ptr + u_base + unit, mask=selectable, other=0).to(tl.int64)
        start = tl.load(starts_ptr + u_base + unit, mask=selectable, other=0).to(tl.int64)
        end = tl.cumsum(size, 0) + total
        begin = end - size
        taken = selectable & (size > 0) & (begin < R)
        taken_i = taken.to(tl.int64)
        position = tl.cumsum(taken_i, 0) + count - 1
        tl.store(unit_ids_ptr + u_base + position, unit, mask=taken)
        tl.store(shift_ptr + bh * SHIFT_LEN + position, start - begin, mask=taken)
        tl.store(heads_ptr + r_base + begin, tl.full([BLOCK_U], 1, dtype=tl.int8), mask=taken)
        total += tl.sum(size, 0)
        count += tl.sum(taken_i, 0)
    # the rest of unit_ids is -1 (disjoint from the compacted writes, so no barrier)
    for u0 in range((count // BLOCK_U) * BLOCK_U, U, BLOCK_U):
        i = u0 + tl.arange(0, BLOCK_U)
        tl.store(unit_ids_ptr + u_base + i, tl.full([BLOCK_U], -1, dtype=tl.int64), mask=(i >= count) & (i < U))
    tl.store(num_units_ptr + bh, count)
    tl.debug_barrier()

    # 3. output positions: the k-th flag at or before p is the taken unit covering p
    seen = zero
    for r0 in range(0, R, BLOCK_R):
        p = r0 + tl.arange(0, BLOCK_R)
        in_range = p < R
        head = tl.load(heads_ptr + r_base + p, mask=in_range, other=0).to(tl.int64)
        which = tl.cumsum(head, 0) + seen - 1
        valid = in_range & (p < total)
        shift = tl.load(shift_ptr + bh * SHIFT_LEN + which, mask=valid, other=0)
        index = tl.minimum(tl.maximum(p + shift, 0), N - 1)
        slot = tl.load(order_ptr + bh * N + index, mask=valid, other=0)
        tl.store(slots_ptr + r_base + p, slot, mask=in_range)
        tl.store(slot_valid_ptr + r_base + p, valid, mask=in_range)
        seen += tl.sum(head, 0)


@implement("triton", "select_budget", supports=triton_runs_on)
def select_budget(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    starts: torch.Tensor,
    order: torch.Tensor,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill a token budget with the best-scoring units; see ``reference.select_budget``."""
    *lead, units = scores.shape
    device = scores.device
    capacity = int(capacity)
    ranked_scores, ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    unit_ids = torch.empty(*lead, units, dtype=torch.long, device=device)
    num_units = torch.empty(*lead, dtype=torch.long, device=device)
    slots = torch.empty(*lead, capacity, dtype=order.dtype, device=device)
    slot_valid = torch.empty(*lead, capacity, dtype=torch.bool, device=device)
    programs = ranked.numel() // units if units else 0
    if programs == 0:
        num_units.zero_()
        slots.zero_()
        slot_valid.zero_()
        return unit_ids, num_units, slots, slot_valid
    # scratch: per program, R flags and one shift per taken unit (at most min(U, R) of them)
    heads = torch.empty(programs, capacity, dtype=torch.int8, device=device)
    shift_len = max(1, min(units, capacity))
    shift = torch.empty(programs, shift_len, dtype=torch.long, device=device)
    _fill_kernel[(programs,)](
        ranked, ranked_scores.contiguous(), sizes.contiguous(), starts.contiguous(), order.contiguous(),
        unit_ids, num_units, slots, slot_valid,
        heads, shift,
        units, order.shape[-1], capacity, shift_len,
        BLOCK_U=min(_BLOCK, triton.next_power_of_2(units)),
        BLOCK_R=min(_BLOCK, triton.next_power_of_2(max(capacity, 1))),
        num_warps=_NUM_WARPS,
    )
    return unit_ids, num_units, slots, slot_valid
