"""Trigger: decides, per sequence, whether a layer re-selects its retrieved KV at this step.

The decision is a bool tensor on the attention device. Nothing here may read tensor values
on the host (no ``.item()``, no Python branch on a tensor), so the decode step can be
captured as a CUDA graph and a step that does not re-select moves no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch


class Decision(NamedTuple):
    """Where a layer's decode step writes its decision (``note_decision``'s outputs):
    ``reselect = fire | ~has_selection`` (the first step selects unless the prompt did), also or-ed
    into ``boundary[:, slot]``; then ``has_selection`` is True and ``reselections`` counts it."""

    has_selection: torch.Tensor  # (B,) bool
    reselections: torch.Tensor  # (B,) long
    # (B, capacity) bool: whether the trigger fired when the slot's token came (or, at the first
    # decode slot, the prompt selected)
    boundary: torch.Tensor
    slot: torch.Tensor  # () long: this step's token's slot
    reselect: torch.Tensor  # (B,) bool: this step's decision


@dataclass
class Trigger:
    """Base class. Subclasses are dataclasses whose fields are their options.

    ``init_state`` makes the per-layer state (any object; tensors it holds live on
    ``device``); ``decide`` returns a ``(batch,)`` bool tensor: True = re-select now.
    The framework forces a selection on the first decode step, so triggers need not.
    """

    registered_name: ClassVar[str] = ""
    # True for a trigger whose decision is always "re-select": the step then never calls it (the
    # layer's decision is all True from the prefill on) and the selector gets no ``take`` mask, so
    # its kernels pick what is fastest when every row ranks. Subclasses inherit it: one whose
    # ``decide`` can say False must set it back to False
    always_reselects: ClassVar[bool] = False

    def validate(self) -> None:
        """Raise ``ConfigError`` for bad options. Called when the policy is built."""

    def init_state(self, batch: int, num_q_heads: int, head_dim: int, device: torch.device) -> Any:
        return None

    def attach(self, state: Any, layer: Any) -> None:
        """Called once by the layer's prefill, after ``init_state`` and the prompt's index: a
        trigger that reads its layer (its unit table, selector, store) keeps ``layer`` here."""

    def selected(self, state: Any, selection: Any, reselect: torch.Tensor) -> None:
        """Called after each re-selection's fetch with the selector's ``Selection`` (its
        ``unit_ids``) and ``reselect (B,)``, the rows that took it: a trigger that compares against
        what is held reads it here instead of recomputing it. Device work only (it runs inside
        the captured step, in the re-selection's conditional node)."""

    def prompt_selected(self, state: Any, query: torch.Tensor) -> None:
        """Called once, after ``selected``, where the policy made its first selection at the end of
        the prefill from the prompt's last query ``(batch, num_q_heads, head_dim)``
        (``first_selection="prompt"``): a trigger that compares queries or counts steps from a
        selection starts from this one."""

    def decide(self, query: torch.Tensor, state: Any) -> torch.Tensor:
        """``query``: ``(batch, num_q_heads, head_dim)``, this step's post-RoPE query."""
        raise NotImplementedError

    def decide_fast(self, query: torch.Tensor, state: Any, ops) -> torch.Tensor:
        """``decide`` through the bound kernel ops (``dispatch.bind``) where the trigger has a
        fused op; the default is ``decide`` itself, so a plugin need not know about ops."""
        return self.decide(query, state)

    def decide_and_note(self, query: torch.Tensor, state: Any, ops, decision: Decision) -> None:
        """The step's decision written into ``decision``: ``decide_fast``, then one ``note_decision``
        launch. A trigger with a fused op writes it in the launch that decides (``Interval``)."""
        fire = self.decide_fast(query, state, ops)
        ops.note_decision(fire, *decision)
