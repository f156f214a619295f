from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..registry import register
from .base import UnitBuilder


@register("units", "pages")
@dataclass
class Pages(UnitBuilder):
    """Fixed pages of ``size`` consecutive tokens (Quest: 16, ArkVale: 32).

    Every unit keeps its mean key and its per-dimension min/max, so both the ``top_budget``
    (mean) and ``bound`` (min/max) selectors can score pages.
    """

    size: int = 16
    builds_prompt = True
    builds_decode = True

    def validate(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"pages: size must be an integer >= 1, got {self.size!r}")

    def build_labels(self, keys, token_valid, ops):
        batch, kv_heads, n, _ = keys.shape
        labels = (torch.arange(n, device=keys.device) // self.size).expand(batch, kv_heads, n)
        return labels, -(-n // self.size)

    def starts_new_unit(self, boundary, open_size):
        return (open_size == 0) | (open_size >= self.size)

    def cut_rule(self):
        return self.size, False
