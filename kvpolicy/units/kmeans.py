from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..kernels import dispatch
from ..registry import register
from .base import UnitBuilder


@register("units", "kmeans")
@dataclass
class KMeans(UnitBuilder):
    """Semantic clusters of the prompt's keys, per (sequence, KV head) (ClusterKV, LouisKV).

    About ``tokens_per_cluster`` tokens per cluster on average; Lloyd iterations on the
    keys, so a cluster's mean key is its centroid and top_budget scores it directly.
    """

    tokens_per_cluster: int = 16
    iters: int = 8
    builds_prompt = True

    def validate(self) -> None:
        if not isinstance(self.tokens_per_cluster, int) or self.tokens_per_cluster < 1:
            raise ConfigError(
                f"kmeans: tokens_per_cluster must be an integer >= 1, got {self.tokens_per_cluster!r}"
            )
        if not isinstance(self.iters, int) or self.iters < 1:
            raise ConfigError(f"kmeans: iters must be an integer >= 1, got {self.iters!r}")

    def build_labels(self, keys, token_valid, ops):
        n = keys.shape[2]
        num_clusters = max(1, -(-n // self.tokens_per_cluster))
        kmeans = dispatch.as_ops(ops, keys.device).kmeans
        labels, _ = kmeans(keys, token_valid, num_clusters, self.iters)
        return labels, num_clusters
