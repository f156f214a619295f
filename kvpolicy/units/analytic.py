from __future__ import annotations

from dataclasses import dataclass

from .. import analytic
from ..errors import ConfigError
from ..registry import register
from .analytic_index import AnalyticIndex
from .base import UnitBuilder

# ParisKV's code: the oldest local tokens join the index 512 at a time. At kvpolicy's default
# budget (512 tokens attended in all) that would leave nothing to retrieve, so the default is
# the local window's size, 64, capped where the budget is small (see validate_in / the preset).
DEFAULT_UPDATE_BUFFER = 64


def subspaces_for(head_dim: int, subspaces: int | None) -> int:
    """``subspaces``, or the default for ``head_dim``: ParisKV's 16 subspaces while they are at most
    8 dims wide (head_dim <= 128: 8 dims and 256 centroids each at 128, 4 dims and 16 centroids at
    64), else subspaces of 8 dims (32 for head_dim 256).

    Keeping 16 subspaces at head_dim 64 rather than 8 of 8 dims was measured on SmolLM2
    (4K needles, budget 512): attention recall 0.94-0.95 against 0.92-0.93 at the same candidate
    count (EVAL.md); more subspaces give the integer vote a finer scale.
    """
    if subspaces is not None:
        return subspaces
    return min(head_dim, max(analytic.DEFAULT_SUBSPACES, head_dim // analytic.MAX_SUBSPACE_DIMS))


@register("units", "analytic")
@dataclass
class Analytic(UnitBuilder):
    """ParisKV's data-independent index: every token is a unit, encoded once when it is added.

    Keys are l2-normalised and rotated by one SRHT (seed ``seed + layer index``, fixed per
    layer; the selector rotates queries with the same signs), then split into ``subspaces``
    (default ``subspaces_for``: 16, as ParisKV, up to head_dim 128; 8 dims each beyond). Per subspace a key gets its sign-pattern
    centroid id; per coordinate a 4-bit code (1 sign + 3 magnitude bits); per key a calibration
    weight and its norm (``kvpolicy.analytic``). The prompt's retrieval zone is encoded at
    prefill; tokens leaving the local window wait in an update buffer of ``update_buffer``
    tokens, attended in full, and join the index together when it is full (ParisKV: 512).

    Use it as both ``prefill_units`` and ``decode_units`` (one index takes both), with the
    ``collision_rerank`` selector.
    """

    subspaces: int | None = None
    update_buffer: int = DEFAULT_UPDATE_BUFFER
    seed: int = 0
    builds_prompt = True
    builds_decode = True

    @classmethod
    def index_type(cls) -> type:
        return AnalyticIndex

    def validate(self) -> None:
        if self.subspaces is not None and (
            not isinstance(self.subspaces, int) or isinstance(self.subspaces, bool) or self.subspaces < 1
        ):
            raise ConfigError(
                f"analytic: subspaces must be None (16 up to head_dim 128, head_dim // 8 beyond) or an integer >= 1 "
                f"dividing head_dim into groups of at most {analytic.MAX_SUBSPACE_DIMS} dims, got {self.subspaces!r}"
            )
        if not isinstance(self.update_buffer, int) or isinstance(self.update_buffer, bool) or self.update_buffer < 1:
            raise ConfigError(f"analytic: update_buffer must be an integer >= 1 (tokens), got {self.update_buffer!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"analytic: seed must be an integer, got {self.seed!r}")

    def validate_in(self, policy) -> None:
        room = policy.retrieval_budget
        if self.update_buffer >= room:
            raise ConfigError(
                f"analytic: update_buffer {self.update_buffer} must be smaller than the retrieval budget "
                f"(budget - sink - local = {policy.budget} - {policy.sink} - {policy.local} = {room}): buffered "
                f"tokens are attended within it; accepted: 1..{room - 1}"
            )

    def build_index(self, zone_keys, retrievable, ops, layer_idx) -> AnalyticIndex:
        head_dim = zone_keys.shape[-1]
        subspaces = subspaces_for(head_dim, self.subspaces)
        analytic.check_subspaces(head_dim, subspaces)
        signs = analytic.srht_signs(head_dim, self.seed + layer_idx, zone_keys.device)
        return AnalyticIndex.from_prompt(zone_keys, retrievable, signs, subspaces, self.update_buffer, ops)

    def starts_new_unit(self, boundary, open_size):
        raise NotImplementedError("analytic units are single tokens filed by AnalyticIndex")
