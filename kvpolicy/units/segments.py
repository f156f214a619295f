from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..registry import register
from .base import UnitBuilder


@register("units", "segments")
@dataclass
class Segments(UnitBuilder):
    """LouisKV's temporal segments of generated KV, cut where the trigger fired.

    Tokens that leave the fixed local window join the open segment; a token produced at a
    step where the trigger fired opens a new one (a semantic boundary). ``max_size`` caps a
    segment when the trigger stays quiet for long, so one unit never swallows the budget.
    """

    max_size: int = 64
    builds_decode = True

    def validate(self) -> None:
        if not isinstance(self.max_size, int) or self.max_size < 1:
            raise ConfigError(f"segments: max_size must be an integer >= 1, got {self.max_size!r}")

    def starts_new_unit(self, boundary, open_size):
        return (open_size == 0) | boundary | (open_size >= self.max_size)

    def cut_rule(self):
        return self.max_size, True
