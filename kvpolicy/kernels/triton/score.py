"""Triton unit scoring (op ``unit_scores``): the built-in selectors' scores, skipping idle sequences.

One program scores ``BLOCK_U`` units of one (sequence, KV head): it loads their ``[BLOCK_U, D]``
key-statistics tile once and combines it with the query group's ``G`` rows (a few hundred
bytes, cached), so the unit table is read once, as the reference's einsum does. A program
whose sequence has ``take[b]`` False writes ``-inf`` for its units and returns without reading
the table: in a replayed decode graph the scoring then costs nothing on the steps where the
sequence keeps its selection (the table read is the whole cost: 36.6 us per layer for the
mean over float32 sums at U = 8,200, D = 128, B = 4, H = 8 on an H200, 134 MB:
docs/bench/session10/whole/prof_every_gpu.txt; the float16 means are half the bytes).

``method="mean"``: ``(sum_g q_g) . key_mean / G`` (``TopBudget``; the table's float16 means, so
the table read is half of the float32 sums');
``method="bound"``: ``max_g sum_d relu(q_gd) key_max_d + min(q_gd, 0) key_min_d`` (``Bound``).
Units that are not ``selectable`` score ``-inf`` (their key rows are not read). Float32
arithmetic throughout; the sums run in a different order than the reference's einsum, so results agree
to rounding (relative to ``sum |q| |k|``), not bitwise; where every product and partial sum
is exact (small integers) they are equal, the division being correctly rounded in both.

No host syncs and the grid comes from shapes alone, so the op can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import implement, triton_runs_on
from ..reference import QUERY_DTYPES
from .pdl import pdl_kernel, wait_for_previous

# elements of key statistics one program loads (one tile for the mean, two for the bound):
# 32 units x D=128 for the mean at 4 warps is 32 floats a thread (64 registers in all, no spills
# per ptxas for sm_90a; 8192 took 168): several 16-byte loads in flight, not measured on a GPU
_TILE_ELEMENTS = 4096
_MAX_BLOCK_U = 128
_NUM_WARPS = 4


@pdl_kernel
@triton.jit
def _score_kernel(
    q_ptr, first_ptr, second_ptr, selectable_ptr, take_ptr, out_ptr,
    H, U,
    q_sb, q_sh, q_sg, q_sd,
    f_sb, f_sh, f_su, f_sd,
    s_sb, s_sh, s_su, s_sd,
    sel_sb, sel_sh, sel_su,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_U: tl.constexpr,
    BOUND: tl.constexpr, HAS_TAKE: tl.constexpr, PDL: tl.constexpr,
):
    # units on axis 0 (up to 2**31 programs), (sequence, head) on axis 1
    wait_for_previous(PDL)
    block = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    units = block * BLOCK_U + tl.arange(0, BLOCK_U)
    in_range = units < U
    out = out_ptr + bh * U + units
    # nested: take_ptr is None when HAS_TAKE is off, so it must not be loaded at all
    if HAS_TAKE:  # noqa: SIM102
        if tl.load(take_ptr + b) == 0:
            tl.store(out, tl.full([BLOCK_U], float("-inf"), dtype=tl.float32), mask=in_range)
            return
    selectable = tl.load(selectable_ptr + b * sel_sb + h * sel_sh + units * sel_su, mask=in_range, other=0) != 0
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tile_mask = selectable[:, None] & d_ok[None, :]
    q_row = q_ptr + b * q_sb + h * q_sh + d * q_sd
    first = first_ptr + b * f_sb + h * f_sh + units[:, None] * f_su + d[None, :] * f_sd
    if BOUND:
        # first: key_min, second: key_max (masked rows of empty units are +-inf: never loaded)
        low = tl.load(first, mask=tile_mask, other=0.0)
        high = tl.load(second_ptr + b * s_sb + h * s_sh + units[:, None] * s_su + d[None, :] * s_sd,
                       mask=tile_mask, other=0.0)
        best = tl.full([BLOCK_U], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(G):
            q = tl.load(q_row + g * q_sg, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            bound = tl.sum(tl.maximum(q, 0.0) * high + tl.minimum(q, 0.0) * low, axis=1)
            best = tl.maximum(best, bound)
        score = best
    else:
        # first: key_mean (float16); (sum_g q_g) . key_mean, then / G as the reference divides
        q_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        for g in tl.static_range(G):
            q_sum += tl.load(q_row + g * q_sg, mask=d_ok, other=0.0).to(tl.float32)
        key_mean = tl.load(first, mask=tile_mask, other=0.0).to(tl.float32)
        summed = tl.sum(key_mean * q_sum[None, :], axis=1)
        # correctly rounded, as torch divides (Triton's ``/`` is approximate on the GPU)
        score = tl.div_rn(summed, tl.full([BLOCK_U], G, tl.float32))
    tl.store(out, tl.where(selectable, score, float("-inf")), mask=in_range)


@implement("triton", "unit_scores", supports=triton_runs_on)
def unit_scores(
    query_group: torch.Tensor,
    key_mean: torch.Tensor | None,
    key_min: torch.Tensor | None,
    key_max: torch.Tensor | None,
    selectable: torch.Tensor,
    method: str,
    take: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unit scores, ``-inf`` where not selectable; see ``reference.unit_scores``.

    Sequences with ``take[b]`` False get ``-inf`` for every unit (their table is not read).
    """
    batch, heads, group, dim = query_group.shape
    units = selectable.shape[-1]
    device = query_group.device
    if method == "mean":
        first, second, bound = key_mean, key_mean, False
        if key_mean is None:
            raise ValueError("triton unit_scores: method 'mean' needs key_mean")
    elif method == "bound":
        first, second, bound = key_min, key_max, True
        if key_min is None or key_max is None:
            raise ValueError("triton unit_scores: method 'bound' needs key_min and key_max")
    else:
        raise ValueError(f"triton unit_scores: unknown method {method!r}; accepted: 'mean', 'bound'")
    for name, tensor in (("first", first), ("second", second)):
        if tuple(tensor.shape) != (batch, heads, units, dim):
            raise ValueError(f"triton unit_scores: key statistics {tuple(tensor.shape)} do not fit "
                             f"query group {tuple(query_group.shape)} and {units} units")
    want = torch.float16 if method == "mean" else torch.float32
    if query_group.dtype not in QUERY_DTYPES or first.dtype != want or second.dtype != want:
        raise ValueError(f"triton unit_scores: the query group must be float32, bfloat16 or float16 (read as "
                         f"float32) and the key statistics {want} for method {method!r}, got {query_group.dtype} "
                         f"and {first.dtype}")
    out = torch.empty(batch, heads, units, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    if take is not None:
        take = take.to(device).reshape(batch).contiguous().view(torch.uint8)
    selectable = selectable.view(torch.uint8)
    block_d = triton.next_power_of_2(dim)
    tiles = 2 if bound else 1
    block_u = max(1, min(_TILE_ELEMENTS // (block_d * tiles), _MAX_BLOCK_U, triton.next_power_of_2(units)))
    grid = (triton.cdiv(units, block_u), batch * heads)
    _score_kernel[grid](
        query_group, first, second, selectable, take, out,
        heads, units,
        *query_group.stride(),
        *first.stride(),
        *second.stride(),
        *selectable.stride(),
        G=group, D=dim, BLOCK_D=block_d, BLOCK_U=block_u, BOUND=bound, HAS_TAKE=take is not None,
        num_warps=_NUM_WARPS,
    )
    return out
