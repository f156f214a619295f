"""UnitBuilder: how KV tokens are grouped into retrievable units.

A prefill builder labels each prompt token of the retrieval zone with a unit id
(``build_labels``); a decode builder decides, as tokens leave the local window one per step,
whether the leaving token opens a new unit (``starts_new_unit``). The framework turns both
into one :class:`~kvpolicy.units.table.UnitTable`, so selectors never care how units were made.

A builder whose units need another structure (ParisKV's per-token codes: ``analytic``) overrides
``build_index`` and ``index_type``; a selector declares the index class it ``reads``, and the
policy checks the two match when it is built. Either way the layer sees one object with the
same three entry points: ``append_leaving_token``, ``reserve`` and the host counters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..policy import Policy


@dataclass
class UnitBuilder:
    """Base class. Subclasses are dataclasses whose fields are their options."""

    registered_name: ClassVar[str] = ""
    #: Can group the prompt at prefill (implements ``build_labels``).
    builds_prompt: ClassVar[bool] = False
    #: Can group generated tokens as they leave the local window (implements ``starts_new_unit``).
    builds_decode: ClassVar[bool] = False

    @classmethod
    def index_type(cls) -> type:
        """The class of the per-layer index ``build_index`` makes (a selector ``reads`` one)."""
        from .table import UnitTable  # table.py builds on this module

        return UnitTable

    def validate(self) -> None:
        """Raise ``ConfigError`` for bad options. Called when the policy is built."""

    def validate_in(self, policy: "Policy") -> None:
        """Raise ``ConfigError`` for options that do not fit the rest of ``policy`` (its budget...)."""

    def build_index(self, zone_keys: torch.Tensor, retrievable: torch.Tensor, ops, layer_idx: int) -> Any:
        """The layer's retrieval index over the prompt's retrieval zone (``zone_keys (B, H, n, D)``,
        ``retrievable (B, n)``: False for padding and sink tokens; zone token ``i`` is slot ``i``).

        ``ops``: the layer's bound kernel ops (``kernels.dispatch.bind``; ``ops.kmeans(...)``).
        The default groups the zone with ``build_labels`` into a :class:`UnitTable`.
        """
        from .table import UnitTable

        batch, heads, zone, _ = zone_keys.shape
        if zone > 0:
            labels, num_units = self.build_labels(zone_keys, retrievable, ops)
        else:
            labels, num_units = torch.zeros(batch, heads, 0, dtype=torch.long, device=zone_keys.device), 0
        slots = torch.arange(zone, device=zone_keys.device)
        return UnitTable.from_prompt(zone_keys, slots, retrievable, labels, num_units, ops)

    def build_labels(self, keys: torch.Tensor, token_valid: torch.Tensor, ops) -> tuple[torch.Tensor, int]:
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

    def cut_rule(self) -> tuple[int, bool] | None:
        """``(max_size, at_boundary)`` when ``starts_new_unit`` is exactly "open a unit when none
        is open, when the open one holds ``max_size`` tokens, or (``at_boundary``) where the
        trigger fired": the decode step then decides it inside one fused kernel. None (the
        default): the step calls ``starts_new_unit``."""
        return None

    def max_decode_units(self, tokens: int) -> int | None:
        """The most decode units ``tokens`` tokens leaving the window can open, from the cut rule
        alone: a rule that never cuts at a boundary opens one per ``max_size`` tokens (pages: one
        per ``size``). None: up to one a token, which is the honest worst case of a rule that cuts
        where the trigger fired (segments: a trigger may fire on every step) and of a builder
        without a rule; the unit table then reads the count it opened from the device when it
        needs room, and reserves one a token before a capture."""
        rule = self.fused_cut_rule()
        if rule is None or rule[1]:
            return None
        return -(-tokens // rule[0])

    def fused_cut_rule(self) -> tuple[int, bool] | None:
        """``cut_rule()`` where it still describes this class: a subclass that overrides
        ``starts_new_unit`` or ``decode_key`` without ``cut_rule`` keeps its own logic."""
        return self.cut_rule() if _cut_rule_describes(type(self)) else None

    def decode_key(self, key: torch.Tensor, table: Any) -> torch.Tensor:
        """The key a leaving token adds to its unit's statistics (sum, min, max): its own,
        ``(batch, kv_heads, head_dim)``, unless a builder scores it by something else."""
        return key


@functools.cache
def _cut_rule_describes(cls: type) -> bool:
    """The class defining ``cut_rule`` also defines ``starts_new_unit``, and ``decode_key`` is the
    base's or that class's own (per class, once: the decode step asks every step)."""
    rule_class = _defining_class(cls, "cut_rule")
    return _defining_class(cls, "starts_new_unit") is rule_class and _defining_class(cls, "decode_key") in (
        rule_class, UnitBuilder)


def _defining_class(cls: type, name: str) -> type | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None
