"""The typed tiers of one layer's KV: what a ``TieredStore`` holds and what the step's ops take.

    Pool             every token's key and value, where the placement puts it, and which slots
                     hold a real token
    Tier             rows on the attention device: keys, values and their validity per head
    SinkTier         a Tier holding the first tokens of each sequence (and their slots)
    RetrievedBuffer  a Tier of rows fetched from the pool: the slot each row holds, whether it
                     holds exactly that slot's pool row, and how many rows are in use
    RowCache         rows recently fetched from a host pool, kept on the attention device beside
                     the retrieved buffer (not attended), so a re-selection reads them there
    Evicted          the token the local ring pushed out this step
    PoolRows         rows of an attended part that attention reads from the pool, by slot

A kernel op takes the tier it works on, not its tensors one by one, so its signature says what it
touches (``admit_row(buffer, evicted, reselected)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KeyValueRows:
    """Rows of keys and values on the device, ``(B, H, N, D)`` each: what every tier below holds."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def rows(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes of its keys and values."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


@dataclass
class Tier(KeyValueRows):
    """Rows attended on the device, with their validity ``valid (B, H, N)``."""

    valid: torch.Tensor


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
class RowCache(KeyValueRows):
    """The last rows a re-selection read from the pool, kept on the attention device (the GPU
    unit cache): a fetched unit is a run of rows, so a unit that leaves the selection and comes
    back is read here instead of across PCIe.

    ``keys``/``values``: ``(B, H, C, D)``; ``slots (B, H, C)`` long and ``held (B, H, C)`` bool as in
    ``RetrievedBuffer`` (a row is found only where ``held``); ``cursor (B, H)`` long: the row the
    next miss is written to. Rows are replaced first in, first out; ``C`` is at least the retrieved
    buffer's rows, so the misses of one fetch never share a row.
    """

    slots: torch.Tensor
    held: torch.Tensor
    cursor: torch.Tensor

    @classmethod
    def empty(cls, like: torch.Tensor, rows: int) -> "RowCache":
        """A cache of ``rows`` rows per (sequence, head) shaped like ``like (B, H, N, D)``, holding nothing."""
        batch, heads, _, dim = like.shape
        device = like.device
        return cls(
            keys=like.new_zeros(batch, heads, rows, dim),
            values=like.new_zeros(batch, heads, rows, dim),
            slots=torch.full((batch, heads, rows), -1, dtype=torch.long, device=device),
            held=torch.zeros(batch, heads, rows, dtype=torch.bool, device=device),
            cursor=torch.zeros(batch, heads, dtype=torch.long, device=device),
        )


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
class PoolRows:
    """Rows ``[start, start + R)`` of an attention part read from a GPU pool instead of the part:
    row ``start + i`` of head ``(b, h)`` is the pool row holding slot ``slots[b, h, i]`` (through
    ``zone_rows`` for a slot below ``zone_end``, as ``Pool.zone_rows`` says). The part's own
    ``valid`` still says which rows are attended. So a GPU pool's re-selection writes only the
    selection's slots, and attention reads the rows where they already are (where the policy
    re-selects at every step: ``store.ATTEND_POOL_BY_SLOT``)."""

    keys: torch.Tensor  # (B, H, capacity, D), on the attention device
    values: torch.Tensor
    slots: torch.Tensor  # (B, H, R) long
    start: int
    zone_rows: torch.Tensor | None = None  # (B, H, zone) int32, or None: row = slot
    zone_end: int = 0


@dataclass
class Evicted:
    """The token the local ring pushed out this step (``valid`` False while the ring fills)."""

    slot: torch.Tensor  # () long, device; clamped to >= 0
    key: torch.Tensor  # (B, H, D)
    value: torch.Tensor
    valid: torch.Tensor  # (B,)
