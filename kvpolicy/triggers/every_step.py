from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..registry import register
from .base import Trigger


@register("trigger", "every_step")
@dataclass
class EveryStep(Trigger):
    """Re-select at every decode step (Quest, ArkVale, ClusterKV). A decode step never asks it: its
    layer's decision is all True from the prefill on (``always_reselects``), written by no launch."""

    always_reselects: ClassVar[bool] = True

    def decide(self, query: torch.Tensor, state: None) -> torch.Tensor:
        return torch.ones(query.shape[0], dtype=torch.bool, device=query.device)

