from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..registry import register
from .base import Trigger

# the all-True decision per (batch, device), filled once: a decode step's decision then costs no
# launch (a fill a layer and step otherwise). Read only (note_decision reads it)
_ALL_ROWS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _all_rows(batch: int, device: torch.device) -> torch.Tensor | None:
    """The cached all-True ``(batch,)``; None where it is not cached yet and the stream is being
    captured (a tensor filled inside a capture holds no values until a replay)."""
    rows = _ALL_ROWS.get((batch, device))
    if rows is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        # made outside inference mode whoever asks first: a cached inference tensor could not
        # serve a caller outside it
        with torch.inference_mode(False):
            rows = _ALL_ROWS[(batch, device)] = torch.ones(batch, dtype=torch.bool, device=device)
    return rows


@register("trigger", "every_step")
@dataclass
class EveryStep(Trigger):
    """Re-select at every decode step (Quest, ArkVale, ClusterKV)."""

    always_reselects: ClassVar[bool] = True

    def decide(self, query: torch.Tensor, state: None) -> torch.Tensor:
        return torch.ones(query.shape[0], dtype=torch.bool, device=query.device)

    def decide_fast(self, query: torch.Tensor, state: None, ops) -> torch.Tensor:
        """``decide``'s all-True, one cached tensor per (batch, device): not to be written."""
        rows = _all_rows(query.shape[0], query.device)
        return self.decide(query, state) if rows is None else rows
