"""The fused score-gap step's ``challengers`` (``ScoreGap.challengers``; the reference is
``reference_step._challenged``): the pieces the outlier op's launches take on.

A measured step reads the whole unit table and keeps, per query head, the ``C`` unheld units of
largest estimated mass; the steps between measure the gap against those units and the held ones
alone, so they read the keys of only those units. A sequence measures whole when its layer's turn
comes (``every``), when one of its challengers is now held or not selectable, or when it has none.

1. ``check_challengers``, in the follow launch (a program a KV head): after the head's held units
   are marked, whether one of its challengers is marked or not selectable, and whether it lists any
   (a flag a (sequence, KV head)).
2. ``measures_whole``: the sequence's flags and step count say whether this step reads the whole
   table; the blocks launch then keeps each block's ``C`` strongest candidates per query head
   (``block_challengers``), and otherwise scores only the held units (from the held list, a chunk of it
   a program, clearing their marks) and the challengers.
3. ``merge_challengers``, in the row stage (a program a query head's row, run whenever challengers are
   on): on a whole step, the row's ``C`` strongest over the blocks' candidates become its challengers,
   in order of mass (ties: the lower unit id first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MERGE_SPAN = 1024  # candidates the row stage reads at a time while merging (a power of two)


@triton.jit
def check_challengers(chal_ptr, flags_ptr, selectable_ptr, mask_at, b, h, U, ch_sb, ch_sh, sl_sb, sl_sh,
                      GC: tl.constexpr, BLOCK_GC: tl.constexpr):
    """Sequence ``b``'s KV head ``h``: flag 1 where one of its ``GC`` challengers (every query head's) is
    marked held in ``mask_at`` or is not selectable, plus 2 where it lists any. Called after the head's
    marks are stored, by the program that stored them."""
    tl.debug_barrier()  # the marks were stored by other threads of this program
    k = tl.arange(0, BLOCK_GC)
    ids = tl.load(chal_ptr + b * ch_sb + h * ch_sh + k, mask=k < GC, other=-1)
    listed = ids >= 0
    real = listed & (ids < U)
    marked = tl.load(mask_at + ids, mask=real, other=0) != 0
    selectable = tl.load(selectable_ptr + b * sl_sb + h * sl_sh + ids, mask=real, other=0) != 0
    stale = tl.max((listed & (marked | ~selectable)).to(tl.int32), axis=0)
    tl.store(flags_ptr + b * tl.num_programs(0) + h, stale + 2 * tl.max(listed.to(tl.int32), axis=0))


@triton.jit
def measures_whole(flags_ptr, steps_ptr, b, offset, H, EVERY: tl.constexpr, BLOCK_H: tl.constexpr):
    """Whether sequence ``b`` reads the whole table at this step: its layer's turn (``every``), a stale
    challenger in any KV head, or none listed in any."""
    heads = tl.arange(0, BLOCK_H)
    flags = tl.load(flags_ptr + b * H + heads, mask=heads < H, other=0)
    stale = tl.max(flags & 1, axis=0) > 0
    listed = tl.max(flags & 2, axis=0) > 0
    turn = (tl.load(steps_ptr + b) + offset) % EVERY == 0  # score_gap._measures (which imports this file)
    return turn | stale | (listed == 0)


@triton.jit
def block_challengers(values, first, cand_val_at, cand_id_at, real_column, C: tl.constexpr, BLOCK_U: tl.constexpr):
    """A block's ``C`` strongest of ``values [BLOCK_U, BLOCK_G]`` (``-inf``: no candidate) per column,
    stored from ``cand_val_at`` / ``cand_id_at`` (a column's ``C`` in a row; id -1 where none)."""
    rows = tl.arange(0, BLOCK_U)
    for c in tl.static_range(C):
        best = tl.max(values, axis=0)
        arg = tl.argmax(values, axis=0)
        tl.store(cand_val_at + c, best, mask=real_column)
        tl.store(cand_id_at + c, tl.where(best > float("-inf"), first + arg, -1), mask=real_column)
        values = tl.where(rows[:, None] == arg[None, :], float("-inf"), values)


@triton.jit
def merge_challengers(cand_val_ptr, cand_id_ptr, chal_ptr, b, heads, H, N, cv_sb, cv_sr, ch_sb,
                      C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``heads`` of sequence ``b``: each row's ``C`` strongest of its ``N`` block candidates become its
    challengers (row ``r`` at ``chal_ptr + b * ch_sb + r * C``), by mass then lower id; -1 past the last."""
    prev_v = tl.full([BLOCK_H], float("inf"), tl.float32)
    prev_id = tl.full([BLOCK_H], -1, tl.int64)
    none = 2 ** 62
    for c in tl.static_range(C):
        run_v = tl.full([BLOCK_H], float("-inf"), tl.float32)
        run_id = tl.full([BLOCK_H], none, tl.int64)
        for start in range(0, N, BLOCK_N):
            k = start + tl.arange(0, BLOCK_N)
            tile = (heads[:, None] < H) & (k[None, :] < N)
            at = b * cv_sb + heads[:, None] * cv_sr + k[None, :]
            v = tl.load(cand_val_ptr + at, mask=tile, other=float("-inf"))
            i = tl.load(cand_id_ptr + at, mask=tile, other=-1)
            # the ones ranked after the last taken: lower mass, or the same mass and a higher id
            after = (v < prev_v[:, None]) | ((v == prev_v[:, None]) & (i > prev_id[:, None]))
            eligible = (i >= 0) & (v > float("-inf")) & after
            v = tl.where(eligible, v, float("-inf"))
            best = tl.max(v, axis=1)
            best_id = tl.min(tl.where(eligible & (v == best[:, None]), i, none), axis=1)
            better = (best > run_v) | ((best == run_v) & (best_id < run_id))
            run_v = tl.where(better, best, run_v)
            run_id = tl.where(better, best_id, run_id)
        found = run_v > float("-inf")
        tl.store(chal_ptr + b * ch_sb + heads * C + c, tl.where(found, run_id, -1), mask=heads < H)
        prev_v = tl.where(found, run_v, prev_v)
        prev_id = tl.where(found, run_id, prev_id)


def challenger_buffers(trigger, state, batch: int, heads: int, per_head: int, units: int, blocks: int,
                       device: torch.device):
    """The state's ``(B, H, G, C)`` challengers (kept across steps: made, as the reference makes them, where
    missing or of another shape) and ``(B, H)`` int32 flags, and this step's ``(B, H * G, blocks * C)``
    block candidates (mass, unit id)."""
    count = min(trigger.challengers, units)
    ids = state.challengers
    if ids is None or ids.shape[:-1] != (batch, heads, per_head) or ids.device != device:
        ids = torch.full((batch, heads, per_head, count), -1, dtype=torch.long, device=device)
        state.challengers = ids
    if not ids.is_contiguous():
        raise ValueError("triton score_gap_outlier_fire: the challengers must be contiguous")
    flags = getattr(state, "challenger_flags", None)
    if flags is None or flags.shape != (batch, heads) or flags.device != device:
        flags = torch.zeros(batch, heads, dtype=torch.int32, device=device)
        state.challenger_flags = flags
    cand_val = torch.empty(batch, heads * per_head, blocks * ids.shape[-1], dtype=torch.float32, device=device)
    cand_id = torch.empty(cand_val.shape, dtype=torch.long, device=device)
    return ids, flags, cand_val, cand_id


def merge_span(candidates: int) -> int:
    """Candidates the row stage reads at a time while merging."""
    return min(_MERGE_SPAN, triton.next_power_of_2(max(candidates, 1)))
