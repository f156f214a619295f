from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..kernels import dispatch
from ..kernels.reference import KMEANS_INITS, KMEANS_PRECISIONS
from ..registry import register
from .base import UnitBuilder


# KMeans' runs of prompt tokens clustered on their own (see its docstring)
DEFAULT_SEGMENT_TOKENS = 16384


@register("units", "kmeans")
@dataclass
class KMeans(UnitBuilder):
    """Semantic clusters of the prompt's keys, per (sequence, KV head) (ClusterKV, LouisKV).

    About ``tokens_per_cluster`` tokens per cluster on average; ``iters`` Lloyd iterations on
    the keys, so a cluster's mean key is its centroid and top_budget scores it directly.

    The prompt's units are on the critical path of the first token, and an assignment of ``n``
    tokens at once costs ``4 * n * n / tokens_per_cluster * head_dim`` FLOP per KV head (two bf16
    dots; one with ``precision="bf16"``), so the cost is about ``iters`` times that, with ``n`` at
    most ``segment_tokens`` a run (below):

    - ``init``: "spaced" (default) starts from evenly spaced tokens; "pages" from the mean keys
      of runs of ``tokens_per_cluster`` consecutive tokens (what ``pages`` units would be), which
      is already a clustering, so fewer ``iters`` are needed (``iters=0`` is pages exactly).
    - ``precision``: "split" (default) measures distances to the float32 centroid (two bf16
      dots); "bf16" to the centroid rounded to bfloat16 (one dot, half the FLOPs; labels move
      only near ties).
    - ``segment_tokens``: 16384 (default) cuts a longer prompt into equal runs of at most that many
      consecutive tokens and clusters each run on its own (RetroInfer's segmented clustering): a
      cluster then never spans two runs, and the cost grows linearly, ``n * segment_tokens``
      instead of ``n * n``. A prompt no longer than ``segment_tokens`` is clustered exactly as
      with None, which clusters the whole prompt at once whatever its length. 16384 keeps
      every prompt of the embedded models' needle suites up to 16K clustered whole, and brings the
      prompt's units within 10% of full attention's TTFT at 32K and 64K (H200, BENCHMARKS.md session
      18); on Gemma 3 at 32K it was within session 15's noise rule of the whole prompt (EVAL.md).
    """

    tokens_per_cluster: int = 16
    iters: int = 8
    init: str = "spaced"
    precision: str = "split"
    segment_tokens: int | None = DEFAULT_SEGMENT_TOKENS
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
        segment = self.segment_tokens
        if segment is not None and (not isinstance(segment, int) or isinstance(segment, bool)
                                    or segment < self.tokens_per_cluster):
            default = " (its default; pass segment_tokens=None or a larger run)" if segment == DEFAULT_SEGMENT_TOKENS else ""
            raise ConfigError(
                f"kmeans: segment_tokens must be None (the whole prompt) or an integer >= tokens_per_cluster "
                f"({self.tokens_per_cluster}), got {segment!r}{default}"
            )

    def build_labels(self, keys, token_valid, ops):
        n = keys.shape[2]
        kmeans = dispatch.as_ops(ops, keys.device).kmeans
        # the defaults go unnamed, so a plugin backend's kmeans(keys, valid, clusters, iters) still serves them
        options = {}
        if self.init != "spaced":
            options["init"] = self.init
        if self.precision != "split":
            options["precision"] = self.precision
        segments = 1 if self.segment_tokens is None else -(-n // self.segment_tokens)
        if segments <= 1:
            num_clusters = max(1, -(-n // self.tokens_per_cluster))
            labels, _ = kmeans(keys, token_valid, num_clusters, self.iters, **options)
            return labels, num_clusters
        return cluster_by_segment(kmeans, keys, token_valid, segments, self.tokens_per_cluster, self.iters, options)


def cluster_by_segment(kmeans, keys: torch.Tensor, valid: torch.Tensor, segments: int, tokens_per_cluster: int,
                       iters: int, options: dict) -> tuple[torch.Tensor, int]:
    """K-means of ``segments`` equal runs of consecutive tokens, each on its own, in one call of
    ``kmeans`` (the runs become the batch). Run ``r``'s clusters are labels ``[r * C, (r + 1) * C)``
    with ``C = ceil(run / tokens_per_cluster)``; the last run is padded with invalid tokens."""
    batch, heads, n, dim = keys.shape
    run = -(-n // segments)
    pad = run * segments - n
    if pad:
        keys = F.pad(keys, (0, 0, 0, pad))
        valid = F.pad(valid, (0, pad), value=False)
    per_run = max(1, -(-run // tokens_per_cluster))
    run_keys = keys.reshape(batch, heads, segments, run, dim).transpose(1, 2).reshape(batch * segments, heads, run, dim)
    labels, _ = kmeans(run_keys, valid.reshape(batch * segments, run), per_run, iters, **options)
    first_label = torch.arange(segments, device=keys.device) * per_run
    labels = labels.view(batch, segments, heads, run) + first_label[None, :, None, None]
    return labels.transpose(1, 2).reshape(batch, heads, segments * run)[..., :n].contiguous(), segments * per_run
