"""ParisKV's per-key encoding in Triton: the ``@triton.jit`` helpers shared by op ``analytic_append``
(one leaving token per (sequence, KV head), ``analytic_append.py``) and op ``analytic_encode`` (the
prompt, ``analytic_encode.py``). No op of its own.

A key, loaded as an ``(HI, LO)`` tile (``key_tile``), is encoded as ``analytic.encode_keys`` does:
l2-normalised, the SRHT signs applied, rotated by the Hadamard signs ``(-1)^popcount(i & j) / sqrt(D)``
as two small products (``H_D = H_HI (x) H_LO``: ``D x (HI + LO)`` terms, 3,072 at D = 128, where the
whole ``D x D`` matrix is 16,384, each a 7-bit parity: a decode program's arithmetic is that launch's
time, so it is kept short); then its centroid id per subspace (bit ``j``: rotated coordinate ``j`` >=
0), its packed 4-bit code (magnitude: the thresholds below ``|x|``, as ``bucketize``; bit 3 the sign;
coordinate ``2i`` in byte ``i``'s low nibble), ``weight = 1 / <k, k_hat>`` (0 where not positive) and
its norm.

The rotation sums in another order than the reference's butterflies (about 1e-7 apart), so a centroid
bit can differ where a rotated coordinate is within that of 0, a magnitude where it is within that of
a threshold, and weight and norm in their last bits; everything else is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

# warps a program of both encode launches. One: a key's encode is a chain of dependent reductions over
# its D coordinates, so more programs resident per SM hide more of its latency (the prompt's encode on
# an H200, 8 KV heads, D=128, bf16: 0.235 ms a layer at 8K against 0.610 with four warps, 0.80 against
# 2.28 at 32K; benchmarks/encode_tuning.py, session 18). Both launches use the same: the warps decide
# the reductions' order, and a decode step's key must get the prompt's bits exactly (both launches read
# this attribute when they run, so setting it moves both)
ENCODE_WARPS = 1


@triton.jit
def key_tile(HI: tl.constexpr, LO: tl.constexpr):
    """``(HI, LO)`` coordinate indices of a key: HI-index * LO + LO-index (D = HI * LO)."""
    hi = tl.arange(0, HI)
    lo = tl.arange(0, LO)
    return hi[:, None] * LO + lo[None, :]


@triton.jit
def load_levels(thresholds_ptr, values_ptr, LEVELS: tl.constexpr):
    """The magnitude thresholds (``inf`` past the last: no level above it) and the levels' values."""
    t = tl.arange(0, LEVELS)
    thresholds = tl.load(thresholds_ptr + t, mask=t < LEVELS - 1, other=float("inf"))
    values = tl.load(values_ptr + t)
    return thresholds, values


@triton.jit
def _hadamard_signs(N: tl.constexpr, LOG_N: tl.constexpr):
    """``(N, N)`` True where the Sylvester Hadamard matrix has +1: ``popcount(i & j)`` even."""
    i = tl.arange(0, N)
    both = i[:, None] & i[None, :]
    parity = tl.zeros([N, N], dtype=tl.int32)
    for bit in tl.static_range(LOG_N):
        parity ^= (both >> bit) & 1
    return parity == 0


@triton.jit
def encode_key_into(
    key, signs, thresholds, values,
    codes_at, code_sd, centroids_at, cen_ss, weight_at, norm_at,
    inv_sqrt_d,
    D: tl.constexpr, HI: tl.constexpr, LOG_HI: tl.constexpr, LO: tl.constexpr, LOG_LO: tl.constexpr,
    S: tl.constexpr, DIMS: tl.constexpr, LEVELS: tl.constexpr,
):
    """Encode one key (``key``: its ``(HI, LO)`` float32 tile; ``signs``: the SRHT signs as the same
    tile; ``thresholds``, ``values``: ``load_levels``'s) and store its code, centroid ids, weight and
    norm at ``codes_at`` (stride ``code_sd``), ``centroids_at`` (stride ``cen_ss``), ``weight_at`` and
    ``norm_at``: the position's first element of each."""
    norm = tl.sqrt(tl.sum(tl.sum(key * key, axis=1), axis=0))
    unit = key / tl.maximum(norm, 1e-12) * signs
    # the rotation: H_D = H_HI (x) H_LO (Sylvester order), so rotating is two small products,
    # over the low index bits then the high ones: D * (LO + HI) terms, not D * D
    by_lo = tl.sum(tl.where(_hadamard_signs(LO, LOG_LO)[None, :, :], unit[:, None, :], -unit[:, None, :]), axis=2)
    rotated = tl.sum(tl.where(_hadamard_signs(HI, LOG_HI)[:, :, None], by_lo[None, :, :], -by_lo[None, :, :]),
                     axis=1) * inv_sqrt_d
    rotated = tl.reshape(rotated, [D])
    # the code: magnitude = thresholds below |x| (bucketize), bit 3 the sign; its value
    t = tl.arange(0, LEVELS)
    magnitude = tl.sum((tl.abs(rotated)[:, None] > thresholds[None, :]).to(tl.int32), axis=1)
    nibble = magnitude | ((rotated < 0).to(tl.int32) << 3)
    # the code's value, values[nibble], picked among the LEVELS loaded up front (values[8 + m] =
    # -values[m]): one of them and zeros summed, so exactly that value
    level = tl.sum(tl.where(magnitude[:, None] == t[None, :], values[None, :], 0.0), axis=1)
    alignment = tl.sum(rotated * tl.where(rotated < 0, -level, level), axis=0)
    weight = tl.where(alignment > 0, 1.0 / tl.maximum(alignment, 1e-30), 0.0)
    # pack coordinate 2i into byte i's low nibble, 2i + 1 into its high one
    low, high = tl.split(tl.reshape(nibble, [D // 2, 2]))
    i = tl.arange(0, D // 2)
    tl.store(codes_at + i * code_sd, (low | (high << 4)).to(tl.uint8))
    # centroid id of subspace s: bit j set where coordinate s * DIMS + j is >= 0
    place = 1 << tl.arange(0, DIMS)
    ids = tl.sum(tl.where(tl.reshape(rotated, [S, DIMS]) >= 0, place[None, :], 0), axis=1)
    s = tl.arange(0, S)
    tl.store(centroids_at + s * cen_ss, ids.to(tl.uint8))
    tl.store(weight_at, weight)
    tl.store(norm_at, norm)


def rotation_factors(dim: int) -> dict:
    """The constexprs of ``encode_key_into``'s rotation for head_dim ``dim`` (a power of two): its
    two factors, the high half of the index bits (the fewer) and the low half."""
    log_d = dim.bit_length() - 1
    log_hi = log_d // 2
    return dict(D=dim, HI=1 << log_hi, LOG_HI=log_hi, LO=dim >> log_hi, LOG_LO=log_d - log_hi)
