from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import UnitBuilder


@register("units", "nearest_centroid")
@dataclass
class NearestCentroid(UnitBuilder):
    """Generated tokens join the prompt's nearest cluster, whose centroid is never updated.

    The decode half of "centroids learned on the prompt": each token leaving the local window
    is scored by the prompt centroid nearest its key (squared L2, as K-means assigns), so
    when the generated keys drift from the prompt's, the centroids go stale. With
    ``prefill_units="kmeans"`` and ``top_budget`` it is ClusterKV's selection with frozen
    clusters: the baseline of ``kvpolicy drift`` (ClusterKV itself pages its decode tokens).

    A token is filed as a unit of its own whose key statistics are its centroid's, so
    ``top_budget`` gives it exactly its cluster's score (they are selected together).
    """

    builds_decode = True

    def starts_new_unit(self, boundary, open_size):
        return torch.ones_like(boundary)

    def decode_key(self, key: torch.Tensor, table) -> torch.Tensor:
        prompt = table.num_prompt_units
        size = table.size[:, :, :prompt]
        centroids = table.key_sum[:, :, :prompt] / size.clamp(min=1).unsqueeze(-1)  # (B, H, P, D)
        usable = table.selectable[:, :, :prompt]
        k = key.float()
        distance = centroids.square().sum(-1) - 2 * torch.einsum("bhd,bhpd->bhp", k, centroids)
        nearest = distance.masked_fill(~usable, float("inf")).argmin(-1)  # (B, H)
        chosen = centroids.gather(2, nearest[..., None, None].expand(*nearest.shape, 1, k.shape[-1]))[:, :, 0]
        # a prompt without a real token leaves no centroid: score the token by its own key
        return torch.where(usable.any(-1, keepdim=True), chosen, k)
