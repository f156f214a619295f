from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..kernels import dispatch
from ..kernels.reference import KMEANS_INITS, KMEANS_PRECISIONS
from ..registry import register
from .base import UnitBuilder


@register("units", "kmeans")
@dataclass
class KMeans(UnitBuilder):
    """Semantic clusters of the prompt's keys, per (sequence, KV head) (ClusterKV, LouisKV).

    About ``tokens_per_cluster`` tokens per cluster on average; ``iters`` Lloyd iterations on
    the keys, so a cluster's mean key is its centroid and top_budget scores it directly.

    The prompt's units are on the critical path of the first token, and an assignment costs
    ``4 * n * n / tokens_per_cluster * head_dim`` FLOP per KV head (two bf16 dots; one with
    ``precision="bf16"``), so the cost is about ``iters`` times that:

    - ``init``: "spaced" (default) starts from evenly spaced tokens; "pages" from the mean keys
      of runs of ``tokens_per_cluster`` consecutive tokens (what ``pages`` units would be), which
      is already a clustering, so fewer ``iters`` are needed (``iters=0`` is pages exactly).
    - ``precision``: "split" (default) measures distances to the float32 centroid (two bf16
      dots); "bf16" to the centroid rounded to bfloat16 (one dot, half the FLOPs; labels move
      only near ties).
    """

    tokens_per_cluster: int = 16
    iters: int = 8
    init: str = "spaced"
    precision: str = "split"
    builds_prompt = True

    def validate(self) -> None:
        if not isinstance(self.tokens_per_cluster, int) or self.tokens_per_cluster < 1:
            raise ConfigError(
                f"kmeans: tokens_per_cluster must be an integer >= 1, got {self.tokens_per_cluster!r}"
            )
        if self.init not in KMEANS_INITS:
            raise ConfigError(f"kmeans: init must be one of {', '.join(KMEANS_INITS)}, got {self.init!r}")
        if self.precision not in KMEANS_PRECISIONS:
            raise ConfigError(
                f"kmeans: precision must be one of {', '.join(KMEANS_PRECISIONS)}, got {self.precision!r}"
            )
        lowest = 0 if self.init == "pages" else 1
        if not isinstance(self.iters, int) or isinstance(self.iters, bool) or self.iters < lowest:
            raise ConfigError(
                f"kmeans: iters must be an integer >= {lowest} with init={self.init!r}"
                f"{' (0: the pages themselves)' if lowest == 0 else ' (init=pages accepts 0)'}, got {self.iters!r}"
            )

    def build_labels(self, keys, token_valid, ops):
        n = keys.shape[2]
        num_clusters = max(1, -(-n // self.tokens_per_cluster))
        kmeans = dispatch.as_ops(ops, keys.device).kmeans
        # the defaults go unnamed, so a plugin backend's kmeans(keys, valid, clusters, iters) still serves them
        options = {}
        if self.init != "spaced":
            options["init"] = self.init
        if self.precision != "split":
            options["precision"] = self.precision
        labels, _ = kmeans(keys, token_valid, num_clusters, self.iters, **options)
        return labels, num_clusters
