"""RetrievalIndex: what the decode step needs of a layer's retrieval index.

A prefill builder's ``build_index`` makes one (``UnitTable`` for builders that group tokens,
``AnalyticIndex`` for ParisKV's ``analytic``); the layer holds it typed as this protocol and
calls nothing else, and the selector whose ``reads`` is its class reads the rest.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RetrievalIndex(Protocol):
    def zone_order(self) -> torch.Tensor | None:
        """The prompt zone's slots in the order the pool lays them out (None: slot order)."""

    def make_room(self) -> None:
        """Room for one more leaving token (host side, the step's plan)."""

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more leaving tokens (before a graph is captured)."""

    def append_leaving_token(self, slot: torch.Tensor, key: torch.Tensor, valid: torch.Tensor,
                             boundary: torch.Tensor, builder, ops) -> None:
        """File the token that left the local window (device side, in place)."""

    def host_counters(self) -> dict:
        """The host-side counters a step advances (a graph replay leaves them behind)."""

    def set_host_counters(self, counters: dict) -> None: ...

    def count_replayed_token(self) -> None:
        """Advance the host counters as ``append_leaving_token`` does, for a replayed step."""
