"""Triton collision voting (op ``collision_count``) and the candidate top-k after it.

The query's ranked centroids become a vote table first (``reference_analytic.vote_table``:
``(B, H, S, 256)`` int32, 16 KiB per head at S=16, one small scatter), so a key costs one
table read per subspace whatever ``rho`` is (63 by default; comparing against every rank
would cost ``S * rho`` compares per key). One program per (sequence, KV head, block of keys)
loads the block's ids of all subspaces at once (``(BLOCK_N, S)`` bytes, contiguous per key),
looks them up in its head's table (L1/L2-resident) and sums over subspaces in registers:
each key's ids are read once and only the int32 votes are written. The candidate top-k
that follows is ``candidates.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import reference_analytic
from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous

# keys per program: the block's ids are BLOCK_N * S bytes (8 KiB at S=16)
_BLOCK_N = 512


@pdl_kernel
@triton.jit
def _collision_kernel(
    table_ptr, keys_ptr, valid_ptr, out_ptr,
    H, N,
    key_sb, key_sh, key_sn, key_ss,
    valid_sb, valid_sh, valid_sn,
    S: tl.constexpr, IDS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    in_n = n < N
    both = in_n[:, None] & (s < S)[None, :]
    ids = tl.load(keys_ptr + b * key_sb + h * key_sh + n[:, None] * key_sn + s[None, :] * key_ss, mask=both, other=0)
    votes = tl.load(table_ptr + bh * S * IDS + s[None, :] * IDS + ids.to(tl.int64), mask=both, other=0)
    total = tl.sum(votes, axis=1)
    valid = tl.load(valid_ptr + b * valid_sb + h * valid_sh + n * valid_sn, mask=in_n, other=0)
    tl.store(out_ptr + bh * N + n, tl.where(valid != 0, total, -1), mask=in_n)


@implement("triton", "collision_count", supports=triton_runs_on)
def collision_count(
    query_centroids: torch.Tensor,
    key_centroids: torch.Tensor,
    valid: torch.Tensor,
    tier_weights: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """Tiered collision votes ``(B, H, N)`` int32; see ``reference_analytic.collision_count``."""
    batch, heads, n, subspaces = key_centroids.shape
    if tuple(query_centroids.shape[:3]) != (batch, heads, subspaces) or tuple(valid.shape) != (batch, heads, n):
        raise ValueError(
            f"triton collision_count: query centroids {tuple(query_centroids.shape)} and valid "
            f"{tuple(valid.shape)} do not fit key centroids {tuple(key_centroids.shape)}"
        )
    table = reference_analytic.vote_table(query_centroids, tier_weights)
    out = torch.empty(batch, heads, n, dtype=torch.int32, device=key_centroids.device)
    if out.numel() == 0:
        return out
    _collision_kernel[(batch * heads, triton.cdiv(n, _BLOCK_N))](
        table, key_centroids, valid, out,
        heads, n,
        *key_centroids.stride(),
        *valid.stride(),
        S=subspaces, IDS=reference_analytic.NUM_IDS, BLOCK_S=triton.next_power_of_2(subspaces), BLOCK_N=_BLOCK_N,
    )
    return out
