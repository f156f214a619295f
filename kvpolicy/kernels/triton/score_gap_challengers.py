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
   table. The blocks launch then does so, and also writes every candidate's mass; otherwise it returns
   at once and ``score_gap_outlier._between_kernel`` scores only the held units (a chunk of the held
   list a program, clearing their marks) and the challengers.
3. ``merge_challengers``, in the row stage (a program a query head's row, run whenever challengers are
   on): on a whole step, the row's ``C`` strongest candidates become its challengers, in order of mass
   (ties: the lower unit id first). They lie in the ``C`` blocks of largest best candidate (each block's
   part), so only those blocks' masses are read.

Measured on an H100 (session 30, ``benchmarks/outlier_blocks.py --challengers 8``): keeping each
block's ``C`` strongest in the blocks launch (``C`` argmax passes a block) made a measured step's blocks
kernel 80.3 us a layer against 28.1 without challengers, and scoring the steps between in the blocks
launch itself (its loads masked to the held units and challengers) 29.8: a program a block, most with
nothing to read, kept the launch as long as a whole one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

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
def _next_in_order(v_at, i_at, n, prev_v, prev_id, rows_ok, POSITIONS: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Per row (``v_at``: ``[BLOCK_H]`` pointers to each row's ``n`` masses), the entry ranked right after
    ``(prev_v, prev_id)`` by mass then lower id (``-inf``, a huge id where none): the id is the entry's
    position where ``POSITIONS``, else read from ``i_at`` (-1: no entry)."""
    none = 2 ** 62
    run_v = tl.full([BLOCK_H], float("-inf"), tl.float32)
    run_id = tl.full([BLOCK_H], none, tl.int64)
    for start in range(0, n, BLOCK_N):
        k = start + tl.arange(0, BLOCK_N)
        tile = rows_ok[:, None] & (k[None, :] < n)
        v = tl.load(v_at[:, None] + k[None, :], mask=tile, other=float("-inf"))
        if POSITIONS:
            i = tl.where(tile, k[None, :].to(tl.int64), -1)
        else:
            i = tl.load(i_at[:, None] + k[None, :], mask=tile, other=-1)
        after = (v < prev_v[:, None]) | ((v == prev_v[:, None]) & (i > prev_id[:, None]))
        eligible = (i >= 0) & (v > float("-inf")) & after
        v = tl.where(eligible, v, float("-inf"))
        best = tl.max(v, axis=1)
        best_id = tl.min(tl.where(eligible & (v == best[:, None]), i, none), axis=1)
        better = (best > run_v) | ((best == run_v) & (best_id < run_id))
        run_v = tl.where(better, best, run_v)
        run_id = tl.where(better, best_id, run_id)
    return run_v, run_id


@triton.jit
def merge_challengers(best_at, mass_at, pool_v_at, pool_i_at, chal_at, rows_ok, S, U,
                      C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_U: tl.constexpr):
    """Per row (each argument ``[BLOCK_H]`` pointers to the row's start): the ``C`` blocks of largest best
    candidate (``best_at``: the blocks' parts, ``S`` of them) have their ``BLOCK_U`` candidate masses
    (``mass_at``, by unit id) copied into the row's pool (``pool_v_at`` / ``pool_i_at``, ``C * BLOCK_U``);
    the pool's ``C`` strongest, by mass then lower id, become the row's challengers (``chal_at``; -1
    past the last)."""
    units = tl.arange(0, BLOCK_U)
    prev_v = tl.full([BLOCK_H], float("inf"), tl.float32)
    prev_id = tl.full([BLOCK_H], -1, tl.int64)
    for c in tl.static_range(C):
        v, block = _next_in_order(best_at, best_at, S, prev_v, prev_id, rows_ok, True, BLOCK_H, BLOCK_S)
        found = v > float("-inf")
        ids = tl.where(found, block, 0)[:, None] * BLOCK_U + units[None, :]
        take = (rows_ok & found)[:, None] & (ids < U)
        tl.store(pool_v_at[:, None] + c * BLOCK_U + units[None, :],
                 tl.load(mass_at[:, None] + ids, mask=take, other=float("-inf")), mask=rows_ok[:, None])
        tl.store(pool_i_at[:, None] + c * BLOCK_U + units[None, :], tl.where(take, ids, -1), mask=rows_ok[:, None])
        prev_v = tl.where(found, v, prev_v)
        prev_id = tl.where(found, block, prev_id)
    tl.debug_barrier()  # the pool was stored by other threads of this program
    prev_v = tl.full([BLOCK_H], float("inf"), tl.float32)
    prev_id = tl.full([BLOCK_H], -1, tl.int64)
    for c in tl.static_range(C):
        v, unit = _next_in_order(pool_v_at, pool_i_at, C * BLOCK_U, prev_v, prev_id, rows_ok, False, BLOCK_H,
                                 BLOCK_U)
        found = v > float("-inf")
        tl.store(chal_at + c, tl.where(found, unit, -1), mask=rows_ok)
        prev_v = tl.where(found, v, prev_v)
        prev_id = tl.where(found, unit, prev_id)


class Challenge(NamedTuple):
    """The tensors of a step with challengers: the state's ``(B, H, G, C)`` ids and ``(B, H)`` flags, and
    this step's ``(B, H * G, U)`` candidate masses and ``(B, H * G, C * block)`` pool (masses, ids); the
    launcher fills in the table's blocks and the held list's chunks."""
    ids: torch.Tensor
    flags: torch.Tensor
    mass: torch.Tensor
    pool_mass: torch.Tensor
    pool_ids: torch.Tensor
    block: int
    blocks: int = 0
    chunks: int = 0


def challenger_buffers(trigger, state, batch: int, heads: int, per_head: int, units: int, block: int,
                       device: torch.device) -> Challenge:
    """The state's challengers (kept across steps: made, as the reference makes them, where missing or of
    another shape) and flags, and this step's candidate masses and pool, for blocks of ``block`` units."""
    count = min(trigger.challengers, units)
    ids = state.challengers
    if ids is None or ids.shape[:-1] != (batch, heads, per_head) or ids.device != device:
        ids = torch.full((batch, heads, per_head, count), -1, dtype=torch.long, device=device)
        state.challengers = ids
    if not ids.is_contiguous():
        raise ValueError("triton score_gap_outlier_fire: the challengers must be contiguous")
    flags = state.challenger_flags
    if flags is None or flags.shape != (batch, heads) or flags.device != device:
        flags = torch.zeros(batch, heads, dtype=torch.int32, device=device)
        state.challenger_flags = flags
    rows = heads * per_head
    mass = torch.empty(batch, rows, units, dtype=torch.float32, device=device)
    pool_mass = torch.empty(batch, rows, ids.shape[-1] * block, dtype=torch.float32, device=device)
    pool_ids = torch.empty(pool_mass.shape, dtype=torch.long, device=device)
    return Challenge(ids, flags, mass, pool_mass, pool_ids, block)
