"""AnalyticIndex: ParisKV's per-token retrieval index of one layer, with its update buffer.

Every retrievable token has a position in the index, at fixed capacity: the prompt's retrieval
zone first (position ``i`` is slot ``i``), then the tokens leaving the local window, one per
decode step, in slot order. Per position it keeps what ``analytic.encode_keys`` computes once,
when the token is added: the sign-pattern centroid id of each subspace, the packed 4-bit code,
the calibration weight and the key's norm. Full-precision keys stay in the store's pool.

Zones (ParisKV: sink, local, retrieval, update buffer). Positions ``[0, indexed)`` are the
retrieval zone: voted on and reranked. Positions ``[indexed, next_position)`` are the update
buffer: encoded already, but not yet voted on; the selector puts them in the selection ahead of
any retrieved token, so they stay attended in full. When a token arrives to a full buffer
(``update_buffer`` tokens), the buffer's tokens join the retrieval zone at once and the arriving
token starts the next buffer: the index is refreshed every ``update_buffer`` tokens, as
ParisKV's code refreshes every 512. The flush is ``indexed = where(full, next_position,
indexed)`` on device counters, so a captured step replays it (no host branch).

Why encode on arrival rather than at the flush: the encoding is per key and data-independent,
so encoding a token when it arrives or with its batch gives the same bits; encoding one key
per step keeps every step the same work, where a batch encode would have to run (predicated)
at every step of a captured graph.

Capacity grows on the host, by a quarter (at least 256 positions), decided from the count of
positions written (``length``), never from tensor values; ``reserve`` makes room before a
graph is captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import analytic
from ..kernels import dispatch
from .table import grow_along


def _spare(capacity: int) -> int:
    return max(256, capacity // 4)


def weight_and_norms(
    batch: int, heads: int, capacity: int, device, zero_from: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` and ``norms`` ``(B, H, capacity)`` float32, interleaved in one buffer (views
    ``[..., 0]`` and ``[..., 1]`` of a ``(B, H, capacity, 2)`` tensor), zeroed from position
    ``zero_from`` on (the positions before it left for the caller to write): the rerank reads
    both for each of its scattered candidates, and interleaved they share a 32-byte sector, so
    a candidate costs one sector for them, not two (about a quarter of the rerank's reads at
    64-byte codes)."""
    pair = torch.empty(batch, heads, capacity, 2, device=device)
    pair[:, :, zero_from:].zero_()
    return pair[..., 0], pair[..., 1]


def _interleaved(weight: torch.Tensor, norms: torch.Tensor) -> bool:
    return (weight.dim() == 3 and weight.stride(-1) == 2 and norms.stride() == weight.stride()
            and norms.data_ptr() == weight.data_ptr() + weight.element_size())


@dataclass
class AnalyticIndex:
    centroids: torch.Tensor  # (B, H, capacity, S) uint8: sign-pattern centroid id per subspace
    codes: torch.Tensor  # (B, H, capacity, D // 2) uint8: packed 4-bit codes
    weight: torch.Tensor  # (B, H, capacity) float32: calibration weight
    norms: torch.Tensor  # (B, H, capacity) float32: |key|
    token_valid: torch.Tensor  # (B, capacity) bool: a real token (not padding, not a sink token)
    slots: torch.Tensor  # (capacity,) long: the slot each position holds (sequences run in lockstep)
    next_position: torch.Tensor  # () long, device: the position the next leaving token takes
    indexed: torch.Tensor  # () long, device: positions [0, indexed) are voted on; the rest is the buffer
    signs: torch.Tensor  # (D,) float32: the layer's SRHT signs
    subspaces: int
    update_buffer: int  # tokens the buffer holds before they join the retrieval zone
    num_prompt_units: int  # host: prompt positions (units are single tokens)
    length: int  # host: positions written (buffer sizes only)

    @property
    def capacity(self) -> int:
        return self.weight.shape[-1]

    @property
    def head_dim(self) -> int:
        return self.signs.shape[0]

    @classmethod
    def from_prompt(
        cls,
        zone_keys: torch.Tensor,
        retrievable: torch.Tensor,
        signs: torch.Tensor,
        subspaces: int,
        update_buffer: int,
        ops=None,
    ) -> "AnalyticIndex":
        """Encode the prompt's retrieval zone (``zone_keys (B, H, n, D)``; ``retrievable (B, n)``).

        Every zone token is in the retrieval zone at once (ParisKV indexes the prompt at prefill);
        the update buffer starts empty. ``ops``: the kernel ops (or a backend name) whose
        ``analytic_encode`` encodes the zone (one launch on the Triton backend); the reference's
        by default.
        """
        batch, heads, n, dim = zone_keys.shape
        device = zone_keys.device
        analytic.check_subspaces(dim, subspaces)
        capacity = n + _spare(n)
        encode = dispatch.as_ops(ops, device).analytic_encode
        # positions [0, n) are written by the encode, straight into the index: only the spare
        # room past them is zeroed (a full-size fill first would be a pass over the whole index)
        centroids = torch.empty(batch, heads, capacity, subspaces, dtype=torch.uint8, device=device)
        codes = torch.empty(batch, heads, capacity, dim // 2, dtype=torch.uint8, device=device)
        centroids[:, :, n:].zero_()
        codes[:, :, n:].zero_()
        weight, norms = weight_and_norms(batch, heads, capacity, device, zero_from=n)
        encode(zone_keys, signs, subspaces, centroids, codes, weight, norms)
        token_valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        token_valid[:, :n] = retrievable
        slots = torch.arange(capacity, device=device)  # position i is slot i; the spare room 0
        slots[n:] = 0
        return cls(
            centroids=centroids,
            codes=codes,
            weight=weight,
            norms=norms,
            token_valid=token_valid,
            slots=slots,
            next_position=torch.full((), n, dtype=torch.long, device=device),  # fills: no host sync
            indexed=torch.full((), n, dtype=torch.long, device=device),
            signs=signs,
            subspaces=subspaces,
            update_buffer=update_buffer,
            num_prompt_units=n,
            length=n,
        )

    def zone_order(self) -> None:
        """None: single tokens have no runs to keep together, so the pool keeps slot order."""
        return None

    # -- host counters (what a graph replay leaves behind) -----------------------------------

    def host_counters(self) -> dict:
        return {"length": self.length}

    def set_host_counters(self, counters: dict) -> None:
        self.length = counters["length"]

    def count_replayed_token(self) -> None:
        self.length += 1

    # -- capacity ------------------------------------------------------------------------------

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more leaving tokens without growing (before a graph is captured)."""
        if self.length + tokens > self.capacity:
            self._grow_positions(self.length + tokens)

    def make_room(self) -> None:
        """Room for one more leaving token (host-side growth, before the step's kernels)."""
        if self.length >= self.capacity:
            self._grow_positions(self.capacity + _spare(self.capacity))

    def _grow_positions(self, new: int) -> None:
        self.centroids = grow_along(self.centroids, 2, new, 0)
        self.codes = grow_along(self.codes, 2, new, 0)
        if _interleaved(self.weight, self.norms):  # keep them in one buffer
            pair = grow_along(torch.stack([self.weight, self.norms], dim=-1), 2, new, 0.0)
            self.weight, self.norms = pair[..., 0], pair[..., 1]
        else:
            self.weight = grow_along(self.weight, 2, new, 0.0)
            self.norms = grow_along(self.norms, 2, new, 0.0)
        self.token_valid = grow_along(self.token_valid, 1, new, False)
        self.slots = grow_along(self.slots, 0, new, 0)

    # -- the decode step -----------------------------------------------------------------------

    def append_leaving_token(
        self,
        slot: torch.Tensor,
        key: torch.Tensor,
        valid: torch.Tensor,
        boundary: torch.Tensor,
        builder=None,
        ops=None,
    ) -> None:
        """A token leaves the local window: flush a full update buffer, then buffer the token.

        ``slot``: a 0-dim device tensor; ``key``: ``(B, H, D)``; ``valid``: ``(B,)`` False for
        padding (and while the local ring is still filling). ``boundary`` and ``builder`` are
        the unit table's and unused here: tokens are units of their own. ``ops``: the bound
        kernel table (its ``analytic_append``: one launch on the Triton backend), or None
        for the reference.
        """
        self.make_room()  # a no-op after the layer's plan step (kept for direct callers)
        # in place throughout (op analytic_append): a captured step must update the tensors it
        # was captured with; the reference where no ops table is given
        append = dispatch.as_ops(ops, key.device).analytic_append
        append(
            self.centroids, self.codes, self.weight, self.norms, self.token_valid, self.slots, self.next_position,
            self.indexed, self.signs, self.subspaces, self.update_buffer, key, valid, slot,
        )
        self.length += 1

    # -- what the selector reads -----------------------------------------------------------------

    def retrieval_mask(self) -> torch.Tensor:
        """``(B, capacity)`` True for the real tokens of the retrieval zone (voted on)."""
        position = torch.arange(self.capacity, device=self.token_valid.device)
        return self.token_valid & (position < self.indexed)

    def buffered(self) -> torch.Tensor:
        """``()`` long, device: tokens in the update buffer."""
        return self.next_position - self.indexed
