"""UnitBuilder: how KV tokens are grouped into retrievable units.

A prefill builder labels each prompt token of the retrieval zone with a unit id
(``build_labels``); a decode builder decides, as tokens leave the local window one per step,
whether the leaving token opens a new unit (``starts_new_unit``). The framework turns both
into one :class:`~kvpolicy.units.table.UnitTable`, so selectors never care how units were made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class UnitBuilder:
    """Base class. Subclasses are dataclasses whose fields are their options."""

    registered_name: ClassVar[str] = ""
    #: Can group the prompt at prefill (implements ``build_labels``).
    builds_prompt: ClassVar[bool] = False
    #: Can group generated tokens as they leave the local window (implements ``starts_new_unit``).
    builds_decode: ClassVar[bool] = False

    def validate(self) -> None:
        """Raise ``ConfigError`` for bad options. Called when the policy is built."""

    def build_labels(self, keys: torch.Tensor, token_valid: torch.Tensor, backend: str) -> tuple[torch.Tensor, int]:
        """Group the prompt's retrieval zone.

        ``keys``: ``(batch, kv_heads, n, head_dim)``; ``token_valid``: ``(batch, n)`` bool
        (False for padding and sink tokens, which must not be grouped).
        Returns ``(labels, num_units)``: ``labels`` is ``(batch, kv_heads, n)`` long in
        ``[0, num_units)``; labels of invalid tokens are ignored.
        """
        raise NotImplementedError

    def starts_new_unit(self, boundary: torch.Tensor, open_size: torch.Tensor) -> torch.Tensor:
        """Whether the token leaving the local window opens a new unit.

        ``boundary``: ``(batch,)`` bool, the trigger fired at the step that produced that token;
        ``open_size``: ``(batch,)`` long, tokens already in the open unit (0 when none is open).
        """
        raise NotImplementedError
