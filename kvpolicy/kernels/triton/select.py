"""Triton budget fill (op ``select_budget``): same contract and results as the reference.

One kernel launch, one program per (sequence, KV head):

0. a program whose sequence has ``take[b]`` False writes an empty selection (slots 0,
   ``slot_valid`` False, ``num_units`` 0, ``unit_ids`` -1) and returns: in a replayed decode
   graph the fill (and, for ``U <= _SORT_LIMIT``, the ranking) costs nothing on the steps where
   the sequence keeps its selection;
1. rank the units: ``U <= _SORT_LIMIT`` (8192; 2048 when no ``take`` is given, as then no row
   can skip the ranking and ``torch.sort`` is faster above that size): in the kernel, ``tl.sort`` of one 64-bit key
   per unit over a power-of-two block (see ``_descending_key``: the score's bits made
   order-preserving and inverted in the high word, the unit index in the low word, so the
   ascending key order is exactly ``torch.sort(descending=True, stable=True)``'s order of the
   selectable units, ties by ascending index). Units that cannot be taken (``-inf``/NaN) get
   one key above every selectable one (their relative order never changes the outputs: they
   cover no tokens), padding the largest key. The ranked unit ids (-1 for the unselectable)
   go to a scratch row. Above ``_SORT_LIMIT`` the ranking is ``torch.sort(stable=True)`` before
   the launch, for every sequence whatever ``take`` says (a size choice: the sorted block is
   held in registers, 64 bits a unit, and 16384 units already spill at 16 warps);
2. zero a per-program scratch row of ``R`` "a unit starts here" flags;
3. walk the ranking in blocks, carrying the running token total and taken count: a block
   prefix sum of the ranked sizes gives each unit's ``[begin, end)`` in the budget; taken
   units (selectable, non-empty, ``begin < R``) are compacted into ``unit_ids`` by a prefix
   sum of the taken flags, their ``start - begin`` goes to a compact scratch row, and a flag
   marks ``begin``;
4. walk the ``R`` output positions in blocks: a prefix sum of the flags numbers the taken unit
   covering each position, so ``slot = order[clamp(p + start - begin)]`` needs no search.

Steps are separated by a block barrier (the scratch is written and read by different threads
of the program). Apart from the in-kernel sort, registers stay bounded by the block sizes
whatever ``U`` and ``R`` are. No host syncs: shapes alone size the grid and the scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from . import score as _score  # noqa: F401  (registers ``unit_scores``, the selection's first stage)

# units / positions per block step and warps per program (H200, U=8192, R=2048, torch.sort
# ranking: the fill took ~30 us of ~110, the stable sort the rest; block size and warps
# barely mattered)
_BLOCK = 2048
_NUM_WARPS = 8
# largest U ranked inside the kernel (a power of two); above it torch.sort ranks every row.
# U is the unit table's capacity, which a decode grows past the prompt's units (a 128K prompt's
# 8,189 units become 8,211 with a 20-step graph's reserve, 16,378 after an eager doubling), and
# the sort runs over the next power of two. Measured on the H200 (benchmarks/select_sort.py,
# batch 4 x 8 heads): a block of 16,384 keys took 522 us against torch.sort's 152 (it spills),
# and a row that keeps its selection saves only ~90 us by skipping it, so the kernel wins there
# only below a 15-20% re-selection rate; at 8,192 the break-even is about a third. LouisKV's rate
# is 11.7% at tau 0.8 but 84-91% at SmolLM2's calibrated 0.95 (EVAL.md)
_SORT_LIMIT = 8192
# without ``take`` every row ranks, so the in-kernel sort only pays where it is faster than
# torch.sort (H200, benchmarks/select_sort.py with take all True, the same work: 8 rows, 31 vs
# 34 us at 2,048 units, 87 vs 42 at 4,096, 228 vs 98 at 8,192); with ``take`` rows that keep their selection skip it (9 us against
# torch.sort's 77 at 8,192), which wins below a re-selection rate of about a third (see above)
_SORT_LIMIT_WITHOUT_TAKE = 2048
# warps for the in-kernel sort of more than 4096 keys. ptxas for sm_90a (offline, CUDA 13.4;
# no GPU timing yet): 8192 keys take 230 registers at 8 warps, 128 at 16, neither spills;
# 16384 keys at 16 warps take 128 registers and spill ~2.4 KB a thread (32 warps: 64 registers,
# the same spills). With one program per (sequence, head) the grid is a few dozen programs, so
# more threads per program is what shortens the sort
_SORT_NUM_WARPS = 16


@triton.jit
def _descending_key(score, index, in_range):
    """int64 keys whose ascending order is a stable descending sort of the selectable scores."""
    # -0.0 and 0.0 compare equal (a comparison sort keeps them in index order): one bit pattern
    canonical = tl.where(score == 0.0, 0.0, score)
    bits = canonical.to(tl.int32, bitcast=True)
    # flip the magnitude bits of negative floats: signed int order is then float order...
    ascending = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # ...and its complement is the reverse order; the unselectable (-inf, NaN) sort after
    # every selectable score, +inf included
    descending = tl.where(score > float("-inf"), ~ascending, 0x7FFFFFFF)
    key = (descending.to(tl.int64) << 32) | index.to(tl.int64)
    return tl.where(in_range, key, 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _rank_row(scores_ptr, ranked_ptr, U, SORT_BLOCK: tl.constexpr):
    """``ranked[k]``: the unit ranked ``k``-th (stable descending score), -1 if unselectable."""
    index = tl.arange(0, SORT_BLOCK)
    in_range = index < U
    score = tl.load(scores_ptr + index, mask=in_range, other=float("-inf"))
    key = tl.sort(_descending_key(score, index, in_range))
    # high word: the unselectable have 0x7FFFFFFF; low word: the unit index
    unit = tl.where((key >> 32).to(tl.int32) < 0x7FFFFFFF, key.to(tl.int32), -1)
    tl.store(ranked_ptr + index, unit, mask=in_range)


@triton.jit
def _fill_kernel(
    scores_ptr, ranked_ptr, ranked_scores_ptr, sizes_ptr, starts_ptr, order_ptr, take_ptr,
    unit_ids_ptr, num_units_ptr, slots_ptr, slot_valid_ptr,
    heads_ptr, shift_ptr,
    U, N, R, SHIFT_LEN, ROWS_PER_SEQUENCE,
    BLOCK_U: tl.constexpr, BLOCK_R: tl.constexpr, SORT_BLOCK: tl.constexpr, HAS_TAKE: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    u_base = bh * U
    r_base = bh * R
    zero = bh * 0  # an int64 scalar, for loop-carried totals

    # 0. a sequence that does not re-select: an empty selection, nothing read
    # (nested: take_ptr is None when HAS_TAKE is off, so it must not be loaded at all)
    if HAS_TAKE:  # noqa: SIM102
        if tl.load(take_ptr + bh // ROWS_PER_SEQUENCE) == 0:
            for r0 in range(0, R, BLOCK_R):
                p = r0 + tl.arange(0, BLOCK_R)
                tl.store(slots_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=slots_ptr.dtype.element_ty), mask=p < R)
                tl.store(slot_valid_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=tl.int1), mask=p < R)
            for u0 in range(0, U, BLOCK_U):
                i = u0 + tl.arange(0, BLOCK_U)
                tl.store(unit_ids_ptr + u_base + i, tl.full([BLOCK_U], -1, dtype=tl.int64), mask=i < U)
            tl.store(num_units_ptr + bh, zero)
            return

    # 1. rank in the kernel: ranked unit ids to the scratch row, -1 for the unselectable
    if SORT_BLOCK > 0:
        _rank_row(scores_ptr + u_base, ranked_ptr + u_base, U, SORT_BLOCK)

    # 2. no unit starts anywhere yet
    for r0 in range(0, R, BLOCK_R):
        p = r0 + tl.arange(0, BLOCK_R)
        tl.store(heads_ptr + r_base + p, tl.zeros([BLOCK_R], dtype=tl.int8), mask=p < R)
    tl.debug_barrier()

    # 3. units in score order
    total = zero  # tokens of all selectable units so far (not capped at R, like the reference)
    count = zero  # units taken so far
    for u0 in range(0, U, BLOCK_U):
        i = u0 + tl.arange(0, BLOCK_U)
        in_range = i < U
        if SORT_BLOCK > 0:
            unit = tl.load(ranked_ptr + u_base + i, mask=in_range, other=-1).to(tl.int64)
            selectable = unit >= 0
        else:
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

    # 4. output positions: the k-th flag at or before p is the taken unit covering p
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
    take: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill a token budget with the best-scoring units; see ``reference.select_budget``.

    Rows of sequences with ``take[b]`` False get an empty selection (slots 0, ``slot_valid``
    False, ``num_units`` 0, ``unit_ids`` -1) without being ranked or filled (the ranking still
    runs for them when ``U > _SORT_LIMIT``). Without ``take`` every row is ranked and filled.
    """
    *lead, units = scores.shape
    device = scores.device
    capacity = int(capacity)
    unit_ids = torch.empty(*lead, units, dtype=torch.long, device=device)
    num_units = torch.empty(*lead, dtype=torch.long, device=device)
    slots = torch.empty(*lead, capacity, dtype=order.dtype, device=device)
    slot_valid = torch.empty(*lead, capacity, dtype=torch.bool, device=device)
    programs = scores.numel() // units if units else 0
    if programs == 0:
        num_units.zero_()
        slots.zero_()
        slot_valid.zero_()
        return unit_ids, num_units, slots, slot_valid
    rows_per_sequence = 1
    if take is not None:
        batch = lead[0] if lead else 1
        if take.numel() != batch:
            raise ValueError(f"triton select_budget: take has {take.numel()} entries for {batch} sequences")
        take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
        rows_per_sequence = programs // batch
    scores = scores.contiguous()
    limit = _SORT_LIMIT if take is not None else min(_SORT_LIMIT, _SORT_LIMIT_WITHOUT_TAKE)
    sort_block = triton.next_power_of_2(units) if units <= limit else 0
    if sort_block:
        # in-kernel ranking: the ranked unit ids (int32) go to a scratch row
        ranked = torch.empty(programs, units, dtype=torch.int32, device=device)
        ranked_scores = scores  # not read
    else:
        ranked_scores, ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    # scratch: per program, R flags and one shift per taken unit (at most min(U, R) of them)
    heads = torch.empty(programs, capacity, dtype=torch.int8, device=device)
    shift_len = max(1, min(units, capacity))
    shift = torch.empty(programs, shift_len, dtype=torch.long, device=device)
    _fill_kernel[(programs,)](
        scores, ranked, ranked_scores, sizes.contiguous(), starts.contiguous(), order.contiguous(), take,
        unit_ids, num_units, slots, slot_valid,
        heads, shift,
        units, order.shape[-1], capacity, shift_len, rows_per_sequence,
        BLOCK_U=min(_BLOCK, triton.next_power_of_2(units)),
        BLOCK_R=min(_BLOCK, triton.next_power_of_2(max(capacity, 1))),
        SORT_BLOCK=sort_block, HAS_TAKE=take is not None,
        num_warps=_SORT_NUM_WARPS if sort_block > 4096 else _NUM_WARPS,
    )
    return unit_ids, num_units, slots, slot_valid
