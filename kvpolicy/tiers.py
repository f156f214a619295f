"""The typed tiers of one layer's KV: what a ``TieredStore`` holds and what the step's ops take.

    Pool             every token's key and value, where the placement puts it, and which slots
                     hold a real token
    Tier             rows on the attention device: keys, values and their validity per head
    SinkTier         a Tier holding the first tokens of each sequence (and their slots)
    RetrievedBuffer  a Tier of rows fetched from the pool: the slot each row holds, whether it
                     holds exactly that slot's pool row, and how many rows are in use
    Evicted          the token the local ring pushed out this step

A kernel op takes the tier it works on, not its tensors one by one, so its signature says what it
touches (``admit_row(buffer, evicted, mask)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tier:
    """Rows attended on the device. ``keys``/``values``: ``(B, H, N, D)``; ``valid (B, H, N)``."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor

    @property
    def rows(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes of its keys and values."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


@dataclass
class SinkTier(Tier):
    """The first tokens of each sequence. ``slots (B, N)`` long: the slot of each row (the same
    for every head), -1 where the prompt has fewer valid tokens than rows."""

    slots: torch.Tensor


@dataclass
class RetrievedBuffer(Tier):
    """Rows fetched from the pool, reused until the trigger fires again.

    ``slots (B, H, R)`` long: the slot each row holds; ``held (B, H, R)`` bool: the row holds
    exactly its slot's pool row (not before it is first filled), so a re-selection may copy it on
    the device instead of reading the pool again; ``fill (B, H)`` long: rows ``[:fill]`` are in use.
    """

    slots: torch.Tensor
    held: torch.Tensor
    fill: torch.Tensor


@dataclass
class Pool:
    """Every token of the sequences, one slot each.

    ``keys``/``values``: ``(B, H, capacity, D)`` in pinned host memory or on a GPU, by
    placement; ``valid (B, capacity)`` bool on the attention device: the slot holds a real token
    (not padding, not yet unwritten); ``zone_rows (B, H, zone)`` int32: the pool row of each slot
    of the prompt's retrieval zone once it is laid out unit by unit (None: row = slot).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    zone_rows: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


@dataclass
class Evicted:
    """The token the local ring pushed out this step (``valid`` False while the ring fills)."""

    slot: torch.Tensor  # () long, device; clamped to >= 0
    key: torch.Tensor  # (B, H, D)
    value: torch.Tensor
    valid: torch.Tensor  # (B,)
