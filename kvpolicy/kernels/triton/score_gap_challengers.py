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
   table. The blocks launch then does so, and also writes every candidate's mass; otherwise it returns at
   once and ``score_gap_outlier._between_program`` scores only the held units (a chunk of the held list a
   program, clearing their marks) and the challengers (in a launch of its own, or in the blocks launch's
   first programs: ``score_gap_outlier._BETWEEN_LAUNCH``).
3. ``merge_challengers``, in the row stage (a program a query head's row, run whenever challengers are
   on): on a whole step, the row's ``C`` strongest candidates become its challengers, in order of mass
   (ties: the lower unit id first). They lie in the ``C`` blocks of largest best candidate (each block's
   part), so only those blocks' masses are read, once, into registers.

Measured on an H100 (session 30, ``benchmarks/outlier_blocks.py --challengers 8``): keeping each
block's ``C`` strongest in the blocks launch (``C`` argmax passes a block) made a measured step's blocks
kernel 80.3 us a layer against 28.1 without challengers, and scoring the steps between in the blocks
launch itself (its loads masked to the held units and challengers) 29.8: a program a block, most with
nothing to read, kept the launch as long as a whole one. (H200:) the next version, a launch of its own
for the steps between, took 16.4 us there, the held units and then the challengers in one program, and
its merge, 16 passes each reading its candidates again, 31.6 us in the row stage; hence a program for the
challengers, and a merge in registers (session 30's fourth version: on an H100 a measured step 48.0 us a layer
at 1x128K, a step between 23.3, against 35.8 for the trigger without challengers; session 31 wrote the steps
between into the blocks launch with each unit's keys as one tile, not yet timed: ``outlier_blocks.py
--challenger-variants``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...errors import ConfigError


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
def merge_challengers(best_at, mass_at, chal_at, rows_ok, S, U,
                      C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_U: tl.constexpr):
    """Per row (each pointer argument ``[BLOCK_H]``, at the row's start): the ``C`` blocks of largest best
    candidate (``best_at``: the blocks' parts, ``S <= BLOCK_B`` of them), then, among their ``BLOCK_U``
    candidates each (``mass_at``, by unit id), the ``C`` strongest, by mass then lower id, become the
    row's challengers (``chal_at``; -1 past the last). All in registers: a pass a challenger reads none."""
    none = 2 ** 62
    k = tl.arange(0, BLOCK_B)
    best = tl.load(best_at[:, None] + k[None, :], mask=rows_ok[:, None] & (k < S)[None, :], other=float("-inf"))
    # each pool position's unit id: slot c holds the c-th block's units (-1 where fewer blocks have any)
    slots = tl.arange(0, C * BLOCK_U)
    ids = tl.full([BLOCK_H, C * BLOCK_U], -1, tl.int64)
    for c in tl.static_range(C):
        top = tl.max(best, axis=1)
        block = tl.min(tl.where(best == top[:, None], k[None, :], none), axis=1).to(tl.int64)
        found = top > float("-inf")
        start = tl.where(found, block * BLOCK_U, -1)
        ids = tl.where((slots // BLOCK_U == c)[None, :] & found[:, None], start[:, None] + slots[None, :] % BLOCK_U,
                       ids)
        best = tl.where(k[None, :] == block[:, None], float("-inf"), best)
    real = rows_ok[:, None] & (ids >= 0) & (ids < U)
    mass = tl.load(mass_at[:, None] + ids, mask=real, other=float("-inf"))
    ids = tl.where(real, ids, -1)
    for c in tl.static_range(C):
        top = tl.max(mass, axis=1)
        found = top > float("-inf")
        unit = tl.min(tl.where((mass == top[:, None]) & (ids >= 0), ids, none), axis=1)
        tl.store(chal_at + c, tl.where(found, unit, -1), mask=rows_ok)
        mass = tl.where(ids == unit[:, None], float("-inf"), mass)


class Challenge(NamedTuple):
    """The tensors of a step with challengers: the state's ``(B, H, G, C)`` ids and ``(B, H)`` flags, and
    this step's ``(B, H * G, U)`` candidate masses; the launcher fills in the table's blocks of ``block``
    units and the parts a step between writes (a chunk of the held list each, and the challengers')."""
    ids: torch.Tensor
    flags: torch.Tensor
    mass: torch.Tensor
    block: int
    blocks: int = 0
    between_parts: int = 0


# the row stage holds a row's blocks' parts in registers while it takes the next challengers
MAX_BLOCKS = 16384


def challenger_buffers(trigger, state, batch: int, heads: int, per_head: int, units: int, block: int,
                       device: torch.device) -> Challenge:
    """The state's challengers (kept across steps: made, as the reference makes them, where missing or of
    another shape) and flags, and this step's candidate masses, for blocks of ``block`` units."""
    if triton.cdiv(units, block) > MAX_BLOCKS:
        raise ConfigError(f"score_gap trigger: challengers take a unit table of at most {MAX_BLOCKS * block} units "
                          f"(blocks of {block}); this one has {units}. Use challengers=0 for it")
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
    mass = torch.empty(batch, heads * per_head, units, dtype=torch.float32, device=device)
    return Challenge(ids, flags, mass, block)
