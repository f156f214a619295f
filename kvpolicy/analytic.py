"""ParisKV's encoding math: a shared rotation, sign-pattern centroids and 4-bit key codes.

Everything here is data-independent: the rotation is a fixed SRHT (random signs, then a
normalised Walsh–Hadamard transform), centroids are the sign patterns of each subspace, and the
code levels come from the prior a rotation induces on a unit vector's coordinates. So keys
written during decode are encoded exactly like the prompt's, and nothing ever goes stale.

    book = AnalyticCodebook(head_dim=128)                  # 16 subspaces of 8 dims
    signs = book.signs(keys.device)
    ids, codes, weight, norms = book.encode_keys(keys, signs)      # keys (B, H, N, 128)
    q_rot, q_ids, tiers = book.encode_query(query, signs)          # query (B, H, 128), 63 ranks
    # estimate of q·k / |q|: norms * weight * <q_rot, dequantize(codes)>

Layouts:

- centroid id of a subspace: bit ``j`` is 1 where the subspace's ``j``-th rotated coordinate
  is >= 0; the centroid itself is ``(2 * bits - 1) / sqrt(dims)``, a unit vector.
- 4-bit code of a coordinate: bit 3 is the sign (1 = negative), bits 0-2 index the magnitude
  levels (``magnitude_levels``). Coordinate ``2i`` sits in the low nibble of byte ``i``,
  coordinate ``2i + 1`` in the high nibble.

ParisKV's pipeline, file by file (the ``pariskv`` preset composes the first three):

- ``kvpolicy/presets.py`` (``_pariskv``): the preset: zones, update buffer, every-step trigger.
- ``kvpolicy/units/analytic.py``: ``Analytic``, the builder (subspaces, update_buffer, seed).
- ``kvpolicy/units/analytic_index.py``: ``AnalyticIndex``, per-token ids, codes, weight and norm;
  the update buffer and its flush on device counters.
- ``kvpolicy/selectors/collision_rerank.py``: ``CollisionRerank``, the group-mean query, votes,
  candidates by zone length (``CANDIDATE_BANDS`` below), the rerank, the buffer first.
- ``kvpolicy/analytic.py`` (this file): the encoding (rotation, centroids, 4-bit codes, tiers) and
  ParisKV's length rule.
- ``kvpolicy/kernels/reference_analytic.py``: the reference of every op below.
- ``kvpolicy/kernels/triton/query_votes.py``: op ``query_votes``, the rotated query and its vote
  table in one launch.
- ``kvpolicy/kernels/triton/collision_candidates.py``: op ``collision_candidates``, votes, count
  and candidate set in three launches (collision_candidates' default pipeline; two in a call too
  small for the GPU), each centroid id read once.
- ``kvpolicy/kernels/triton/rerank_select.py``: op ``rerank_select``, the candidates' 4-bit
  estimates, their exact top-k (a radix select on the scores' bits) and the selection's rows
  (the update buffer's first, then the chosen tokens by position) in five launches and a memset.
- ``kvpolicy/kernels/triton/head_softmax.py``: ``rerank="head_softmax"``'s scores for ``rerank``
  and ``rerank_select`` (each query head's softmax over the candidates, summed; the codes read
  once for the group's heads), in two launches that replace the score pass (the heads' logit
  queries come from ``query_votes(logit_queries=True)``'s launch).
- ``kvpolicy/kernels/triton/analytic_append.py``: op ``analytic_append``, a leaving token
  encoded and written into the index, the flush and the counter, in one launch.
- ``kvpolicy/kernels/triton/analytic_encode.py``: op ``analytic_encode``, the prompt's keys encoded
  into a fresh index in one launch (``AnalyticIndex.from_prompt``); both encode a key with
  ``analytic_encoding.py``'s shared Triton helper, so prompt and decode keys get the same bits.
- ``kvpolicy/kernels/triton/collision.py``, ``candidates.py``, ``rerank.py``: ops
  ``collision_count``, ``candidate_topk`` and ``rerank`` (estimates, then ``torch.topk``), the
  composed path the selector takes where the fused ops are not bound.
- ``kvpolicy/kernels/triton/gather.py``: op ``gather_rows_into``, the selected rows from the pool
  (shared with every preset, like ``store.py`` and ``layer.py``).
- ``kvpolicy/kernels/triton/gather_single.py``: ``gather_single_rows_into``, the same gather with
  its schedule a choice (rows a program, warps, spread, sort), timed against gather.py on pinned
  pools of 4 KB and huge pages by ``benchmarks/pinned_gather.py``; not on the fetch path yet.
- ``kvpolicy/units/nearest_centroid.py``: the stale-centroid baseline ParisKV is compared with.

Tests: ``tests/test_analytic.py`` (encoding, reference ops), ``tests/kernels/triton/test_analytic_ops.py``
(each Triton op against its reference; the prompt's encode in ``test_analytic_encode.py``), ``tests/units/test_analytic_index.py`` (index, selections, config),
``tests/selectors/test_collision_rerank.py`` (length rule, fused path against the composed one). Speed:
``benchmarks/pariskv_select.py`` (selection per layer, the pinned gather), ``benchmarks/candidate_topk.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import ConfigError

# bits of a code: one sign bit and this many magnitude bits
MAGNITUDE_BITS = 3
# centroid ids are stored as uint8, so a subspace has at most 8 dims (256 centroids)
MAX_SUBSPACE_DIMS = 8
DEFAULT_SUBSPACES = 16
# tier t holds the query's centroids of ranks 2^t - 1 .. 2^(t+1) - 2 (1, 2, 4, ... of them):
# the top 2^t centroids are roughly all sign flips of the t smallest query coordinates, so
# each tier is "one more weak coordinate disagrees". 6 tiers rank 63 of the 256 centroids.
DEFAULT_TIERS = 6
DEFAULT_RHO = (1 << DEFAULT_TIERS) - 1

# ParisKV's length rule (amy-77/ParisKV, cache_hub/polar_cache.py, ``_get_adaptive_ratios``),
# by the retrieval zone's length n: the share of it kept as candidates, and the collision ratio
# beside it (the share of the zone its 6 tiers' clusters cover; not used here, see below):
#     n < 5,000: 0.5 and 0.5;  < 10,000: 0.25 and 0.3;  < 30,000: 0.2 and 0.25;  from 30,000: 0.1 and 0.2
# (the variants polar_cache_adaptivek_varlen.py and polar_cache_atten_value_indices_adaptive_k.py
# keep 0.05 from 30,000). The selector's candidate_fraction is the share from 30,000 on
# (DEFAULT_CANDIDATE_FRACTION); CANDIDATE_BANDS lift it below. ParisKV's tiers are cut by key
# counts (the query's best clusters until they hold collision_ratio x (5, 15, 30, 50, 75, 100)%
# of the zone's keys, counted per cluster); kvpolicy's tiers are fixed ranks (1, 2, 4... of the
# best centroids, tier_weights), which need no per-cluster counts, so the collision ratio has
# no counterpart here. ParisKV also attends everything while the context is under
# max(2,000, sink + local + 2 x top-k): collision_rerank selects every token of a zone that fits
# its retrieval budget (through its floor of at least one budget of candidates).
CANDIDATE_BANDS = ((5_000, 0.5), (10_000, 0.25), (30_000, 0.2))
COLLISION_RATIOS = ((5_000, 0.5), (10_000, 0.3), (30_000, 0.25), (None, 0.2))
DEFAULT_CANDIDATE_FRACTION = 0.1

_LLOYD_GRID = 1 << 16
_LLOYD_ITERS = 300


# -- validation ------------------------------------------------------------------------------


def check_head_dim(head_dim: int) -> None:
    """The Walsh–Hadamard transform needs a power-of-two head_dim."""
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim & (head_dim - 1):
        raise ConfigError(
            f"analytic: head_dim must be a power of two >= 2 (e.g. 64, 128, 256), got {head_dim!r}"
        )


def accepted_subspaces(head_dim: int) -> list[int]:
    """Subspace counts that split ``head_dim`` into groups of at most 8 dims."""
    return [s for s in range(1, head_dim + 1) if head_dim % s == 0 and head_dim // s <= MAX_SUBSPACE_DIMS]


def check_subspaces(head_dim: int, subspaces: int) -> int:
    """Validate and return the dims per subspace."""
    check_head_dim(head_dim)
    if not isinstance(subspaces, int) or subspaces not in accepted_subspaces(head_dim):
        accepted = ", ".join(map(str, accepted_subspaces(head_dim)))
        raise ConfigError(
            f"analytic: subspaces must divide head_dim {head_dim} into groups of at most "
            f"{MAX_SUBSPACE_DIMS} dims (uint8 centroid ids); accepted: {accepted}; got {subspaces!r}"
        )
    return head_dim // subspaces


def check_rho(dims: int, rho: int) -> None:
    """A query can rank at most all ``2**dims`` centroids of a subspace."""
    if not isinstance(rho, int) or not 1 <= rho <= 1 << dims:
        raise ConfigError(
            f"analytic: rho must be an integer in 1..{1 << dims} (the {1 << dims} sign-pattern "
            f"centroids of a {dims}-dim subspace), got {rho!r}"
        )


def tier_of_rank(rho: int) -> list[int]:
    """The tier of each of ``rho`` ranks: ``floor(log2(rank + 1))``, so tiers hold 1, 2, 4... ranks."""
    return [(rank + 1).bit_length() - 1 for rank in range(rho)]


def tier_weights(tiers: int = DEFAULT_TIERS) -> tuple[int, ...]:
    """Votes per rank for ``collision_count``: ``tiers - tier`` for the ``2**tiers - 1`` ranks.

    ``tier_weights(3) == (3, 2, 2, 1, 1, 1, 1)``: a key on the query's best centroid of a
    subspace gets 3 votes there, on one of the next two 2 votes, and so on.
    """
    if not isinstance(tiers, int) or not 1 <= tiers <= MAX_SUBSPACE_DIMS:
        raise ConfigError(f"analytic: tiers must be an integer in 1..{MAX_SUBSPACE_DIMS}, got {tiers!r}")
    return tuple(tiers - tier for tier in tier_of_rank((1 << tiers) - 1))


# -- rotation --------------------------------------------------------------------------------


def srht_signs(head_dim: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's fixed ±1 signs, ``(head_dim,)`` float32; the same for a seed everywhere.

    Drawn on a CPU generator so every device (and every run) gets the same rotation. Cached per
    (head_dim, seed, device) and never written: the copy to a GPU waits for the stream, once per
    layer of every prefill without the cache (36 of a prefill's 40 host syncs, session 9).
    """
    check_head_dim(head_dim)
    return _signs_on(head_dim, seed, torch.device(device))


@functools.cache
def _signs_on(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    # made outside inference mode whoever asks first (as collision_rerank's vote weights): a
    # cached inference tensor cannot serve a caller outside it
    with torch.inference_mode(False):
        generator = torch.Generator().manual_seed(seed)
        bits = torch.randint(0, 2, (head_dim,), generator=generator)
        return (bits * 2 - 1).to(torch.float32).to(device)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised (orthogonal) Walsh–Hadamard transform along the last dim, Sylvester order."""
    *lead, dim = x.shape
    half = 1
    while half < dim:
        pairs = x.reshape(*lead, dim // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
        half *= 2
    return x.reshape(*lead, dim) / math.sqrt(dim)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``H · diag(signs) · x / |x|`` along the last dim, float32 (zero vectors stay zero).

    Orthogonal, so norms (1 after the l2 normalisation) and inner products are preserved; it
    spreads a vector's energy evenly over the coordinates, which is what makes the fixed
    sign-pattern centroids and code levels fit any key distribution.
    """
    check_head_dim(x.shape[-1])
    unit = torch.nn.functional.normalize(x.float(), dim=-1)
    return _fwht(unit * signs)


# -- code levels -----------------------------------------------------------------------------


@functools.cache
def _lloyd_levels(head_dim: int) -> tuple[float, ...]:
    """Lloyd–Max levels of ``|x|`` for ``x`` a coordinate of a uniform unit vector in R^D.

    ``(x + 1) / 2 ~ Beta((D-1)/2, (D-1)/2)``, i.e. ``x`` has density ∝ ``(1 - x^2)^((D-3)/2)``
    on [-1, 1]; ``|x|`` the same on [0, 1]. Integrated on a fine midpoint grid in float64.
    """
    grid = (torch.arange(_LLOYD_GRID, dtype=torch.float64) + 0.5) / _LLOYD_GRID
    density = (1 - grid.square()).pow((head_dim - 3) / 2)
    cdf = torch.cumsum(density, 0)
    cdf = cdf / cdf[-1]
    count = 1 << MAGNITUDE_BITS
    # start from the cell medians of equal-mass cells: converges in a few hundred rounds
    levels = grid[torch.searchsorted(cdf, (torch.arange(count, dtype=torch.float64) + 0.5) / count)]
    for _ in range(_LLOYD_ITERS):
        cell = torch.bucketize(grid, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(count, dtype=torch.float64).scatter_add_(0, cell, density)
        moment = torch.zeros(count, dtype=torch.float64).scatter_add_(0, cell, density * grid)
        levels = torch.where(mass > 0, moment / mass.clamp(min=1e-300), levels)
    return tuple(levels.tolist())


@functools.cache
def _levels_on(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    levels = torch.tensor(_lloyd_levels(head_dim), dtype=torch.float32)
    signed = torch.cat([levels, -levels])
    return levels.to(device), ((levels[1:] + levels[:-1]) / 2).to(device), signed.to(device)


def magnitude_levels(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 8 magnitude levels ``(8,)`` float32, ascending; cached per (head_dim, device).

    Cached on the device so a captured decode step never copies them from the host.
    """
    check_head_dim(head_dim)
    return _levels_on(head_dim, torch.device(device))[0]


def nibble_values(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The value of each 4-bit code ``(16,)`` float32: ``magnitude_levels`` for codes 0-7, their
    negations for 8-15 (the sign bit set), exactly ``dequantize``'s; cached per (head_dim, device),
    made with the levels (so a captured step never builds it)."""
    check_head_dim(head_dim)
    return _levels_on(head_dim, torch.device(device))[2]


def _thresholds(head_dim: int, device: torch.device) -> torch.Tensor:
    return _levels_on(head_dim, device)[1]


# -- keys ------------------------------------------------------------------------------------


def centroid_ids(rotated: torch.Tensor, subspaces: int) -> torch.Tensor:
    """Sign-pattern centroid id per subspace, ``(..., S)`` uint8, of rotated vectors ``(..., D)``."""
    dims = check_subspaces(rotated.shape[-1], subspaces)
    bits = (rotated >= 0).reshape(*rotated.shape[:-1], subspaces, dims)
    place = 1 << torch.arange(dims, device=rotated.device)
    return (bits * place).sum(-1).to(torch.uint8)


def quantize(rotated: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes ``(..., D // 2)`` uint8 of rotated unit vectors ``(..., D)``."""
    check_head_dim(rotated.shape[-1])
    magnitude = torch.bucketize(rotated.abs(), _thresholds(rotated.shape[-1], rotated.device))
    code = magnitude | ((rotated < 0).long() << MAGNITUDE_BITS)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)


def dequantize(codes: torch.Tensor) -> torch.Tensor:
    """Rotated vectors ``(..., D)`` float32 back from packed codes ``(..., D // 2)``."""
    dim = 2 * codes.shape[-1]
    nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(*codes.shape[:-1], dim).long()
    levels = magnitude_levels(dim, codes.device)
    magnitude = levels[nibbles & ((1 << MAGNITUDE_BITS) - 1)]
    return torch.where((nibbles >> MAGNITUDE_BITS).bool(), -magnitude, magnitude)


class EncodedKeys(NamedTuple):
    centroids: torch.Tensor  # (..., S) uint8
    codes: torch.Tensor  # (..., D // 2) uint8
    weight: torch.Tensor  # (...) float32
    norms: torch.Tensor  # (...) float32


def encode_keys(keys: torch.Tensor, signs: torch.Tensor, subspaces: int = DEFAULT_SUBSPACES) -> EncodedKeys:
    """Encode keys ``(..., D)`` (any float dtype) once, at write time.

    Returns ``(centroids (..., S) uint8, codes (..., D // 2) uint8, weight (...) float32,
    norms (...) float32)``. With ``k`` the rotated unit key and ``k_hat = dequantize(codes)``,
    ``weight = 1 / <k, k_hat>``, so ``q·key ≈ |q| * norms * weight * <q_rot, k_hat>``.

    Why this scale and not the least-squares one (``<k, k_hat> / <k_hat, k_hat>``): writing
    ``k_hat / |k_hat| = cos·k + e`` with ``e ⊥ k``, ``<q, k_hat> / <k, k_hat> = <q, k> +
    <q, e> / cos``, and the rotation makes ``<q, e>`` zero-mean, so the estimate is unbiased
    (and exact for ``q = k``). Least squares shrinks every key by its own ``cos^2``, a
    per-key bias that reorders keys. A zero key gets weight 0 (its estimate is 0).
    """
    check_subspaces(keys.shape[-1], subspaces)
    norms = keys.float().norm(dim=-1)
    rotated = rotate(keys, signs)
    codes = quantize(rotated)
    alignment = (rotated * dequantize(codes)).sum(-1)
    weight = torch.where(alignment > 0, 1 / alignment.clamp(min=1e-30), 0.0)
    return EncodedKeys(centroid_ids(rotated, subspaces), codes, weight, norms)


# -- queries ---------------------------------------------------------------------------------


@functools.cache
def sign_patterns(dims: int, device: torch.device | None = None) -> torch.Tensor:
    """All ``2**dims`` centroids of a subspace, ``(2**dims, dims)`` float32; row ``c`` is centroid id ``c``."""
    bits = (torch.arange(1 << dims)[:, None] >> torch.arange(dims)) & 1
    return ((bits * 2 - 1) / math.sqrt(dims)).to(torch.float32).to(device or "cpu")


class EncodedQuery(NamedTuple):
    rotated: torch.Tensor  # (..., D) float32, unit norm
    centroids: torch.Tensor  # (..., S, rho) long, best first
    tiers: torch.Tensor  # (rho,) long, the tier of each rank


def encode_query(
    query: torch.Tensor, signs: torch.Tensor, subspaces: int = DEFAULT_SUBSPACES, rho: int = DEFAULT_RHO
) -> EncodedQuery:
    """Rotate a query ``(..., D)`` and rank each subspace's centroids by ``q_sub · centroid``.

    Returns ``(rotated (..., D) float32 unit, centroids (..., S, rho) long ids best first,
    tiers (rho,) long)``, the tier of each rank (``tier_of_rank``; the same for every query,
    returned on the query's device for callers that weight votes per tier). Exact score ties
    (a zero query coordinate) rank the lower id first (a stable sort), so the output is
    deterministic.
    """
    dims = check_subspaces(query.shape[-1], subspaces)
    check_rho(dims, rho)
    rotated = rotate(query, signs)
    parts = rotated.reshape(*rotated.shape[:-1], subspaces, dims)
    scores = parts @ sign_patterns(dims, rotated.device).T  # (..., S, 2**dims)
    ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :rho]
    return EncodedQuery(rotated, ids, _tiers_on(rho, rotated.device))


def head_logit_queries(query_group: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Each query head rotated and scaled so that a key's 4-bit estimate with it is an attention
    logit: ``rotate(q) * |q| * D**-0.5``, ``(..., D)`` float32 (``rerank="head_softmax"``).

    The 4-bit estimate with a unit rotated query is ``q·k / |q|``; times ``|q|`` it is ``q·k``, and
    ``D**-0.5`` is the softmax scale kvpolicy's oracle and score estimates use.
    """
    query = query_group.float()
    return rotate(query, signs) * (query.norm(dim=-1, keepdim=True) * query.shape[-1] ** -0.5)


@functools.cache
def _tiers_on(rho: int, device: torch.device) -> torch.Tensor:
    # cached on the device: a captured decode step must not copy from the host
    return torch.tensor(tier_of_rank(rho), device=device)


# -- the whole configuration -----------------------------------------------------------------


@dataclass(frozen=True)
class AnalyticCodebook:
    """One validated ParisKV encoding: head_dim, subspaces and the rotation's seed.

    ``AnalyticCodebook(128)`` is the published setting: 16 subspaces of 8 dims, 256
    sign-pattern centroids each. Validation happens here, when a policy is built.
    """

    head_dim: int
    subspaces: int = DEFAULT_SUBSPACES
    seed: int = 0

    def __post_init__(self) -> None:
        check_subspaces(self.head_dim, self.subspaces)

    @property
    def dims(self) -> int:
        return self.head_dim // self.subspaces

    @property
    def num_centroids(self) -> int:
        return 1 << self.dims

    def signs(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return srht_signs(self.head_dim, self.seed, device)

    def encode_keys(self, keys: torch.Tensor, signs: torch.Tensor) -> EncodedKeys:
        return encode_keys(keys, signs, self.subspaces)

    def encode_query(self, query: torch.Tensor, signs: torch.Tensor, rho: int = DEFAULT_RHO) -> EncodedQuery:
        return encode_query(query, signs, self.subspaces, rho)
