"""Selector: which units fill the retrieval budget, one choice per (sequence, KV head).

A selector only scores units (``score``); the shared budgeted fill (kernel op
``select_budget``) turns scores into a :class:`Selection`. Scoring sees the whole query group
of a KV head at once, so the choice is the same for every query head of the group (GQA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..kernels import dispatch
from ..units.table import UnitTable

if TYPE_CHECKING:
    from ..policy import Policy


@dataclass
class Selection:
    """The chosen units and the token slots they cover, at fixed capacity.

    ``unit_ids``: ``(B, H, U)`` chosen units in score order, then -1 (CSR indices; the row
    pointer is ``num_units``); ``slots``: ``(B, H, R)`` token slots, valid where ``slot_valid``.
    Selectors of single-token units (``collision_rerank``) list the index positions of the
    chosen tokens as ``unit_ids`` (``(B, H, R)``, -1 where ``slot_valid`` is False); its fused
    path lists them by position after the tokens the buffer holds, not in score order.
    """

    unit_ids: torch.Tensor
    num_units: torch.Tensor
    slots: torch.Tensor
    slot_valid: torch.Tensor


@dataclass
class Selector:
    """Base class. Subclasses are dataclasses whose fields are their options."""

    registered_name: ClassVar[str] = ""
    #: The class of per-layer index it reads (``UnitBuilder.index_type``).
    reads: ClassVar[type] = UnitTable
    # the ``unit_scores`` kernel op method that computes ``score`` ("mean", "bound"), set by the
    # class that defines ``score``; None: ``select`` calls ``score`` (plain PyTorch)
    score_method: ClassVar[str | None] = None

    def validate(self) -> None:
        """Raise ``ConfigError`` for bad options. Called when the policy is built."""

    def validate_in(self, policy: "Policy") -> None:
        """Raise ``ConfigError`` for options that do not fit the rest of ``policy``."""

    def score(self, query_group: torch.Tensor, units: UnitTable) -> torch.Tensor:
        """``query_group``: ``(B, H, G, D)`` float32 -> ``(B, H, U)`` scores (any finite values)."""
        raise NotImplementedError

    def select(
        self, query: torch.Tensor, units: UnitTable, capacity: int, ops, take: torch.Tensor | None = None
    ) -> Selection:
        """``query``: ``(B, Hq, D)``; fill ``capacity`` tokens. ``ops``: the layer's bound kernel
        ops (``kernels.dispatch.bind``; a backend name is bound here).

        ``take``: optional ``(B,)`` bool device tensor, the sequences whose selection will be
        used (the decode step's ``reselect``). Fast backends skip the others' scoring and fill;
        their outputs are then unspecified but safe to consume: ``slots`` in
        ``[0, order.shape[-1])``, ``unit_ids`` in ``[-1, U)`` (the Triton ops write an empty
        selection: slots 0, ``slot_valid`` False, ``num_units`` 0, ``unit_ids`` -1).
        """
        ops = dispatch.as_ops(ops, query.device)
        scores = self.unit_scores(query, units, ops, take)
        unit_ids, num_units, slots, slot_valid = ops.select_budget(scores, units.size, units.start, units.order, capacity, take)
        return Selection(unit_ids, num_units, slots, slot_valid)

    def unit_scores(self, query: torch.Tensor, units: UnitTable, ops, take: torch.Tensor | None = None) -> torch.Tensor:
        """``query``: ``(B, Hq, D)`` -> ``(B, H, U)`` float32 scores, ``-inf`` where a unit is not
        selectable: the ``unit_scores`` kernel op where the class declares its method, else ``score``.
        ``ops``: bound kernel ops; ``take`` as in ``select``."""
        batch, q_heads, dim = query.shape
        kv_heads = units.start.shape[1]
        group = query.view(batch, kv_heads, q_heads // kv_heads, dim)
        method = self._unit_score_method()
        if method is not None:
            # the op widens the model's dtype itself (no float32 copy: a launch saved a scoring)
            return ops.unit_scores(
                group, units.key_mean, units.key_min, units.key_max, units.selectable, method, take
            )
        return self.score(group.float(), units).masked_fill(~units.selectable, float("-inf"))

    @classmethod
    def _unit_score_method(cls) -> str | None:
        """``score_method`` if the class that defines the ``score`` in effect declared it: a
        subclass overriding ``score`` alone is scored by its own ``score``."""
        for klass in cls.__mro__:
            if "score" in vars(klass):
                return vars(klass).get("score_method")
        return None
