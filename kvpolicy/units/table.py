"""UnitTable: every retrievable unit of one layer, prompt and generated, in one structure.

Each unit is a contiguous range ``[start, start + size)`` of ``order``, a per-(sequence, KV
head) list of token slots (CSR without the explicit indptr, since decode units are appended
out of order with prompt ones). Each unit keeps the sum, min and max of its keys, which is
all the built-in selectors read.

Memory grows with units, not tokens. Per (sequence, KV head), a unit costs ``unit_bytes(D)`` =
``14 D + 17`` bytes (``key_sum``, ``key_min``, ``key_max``: D float32 each; ``key_mean``: D
float16, what the mean score reads; ``start``, ``size``: int64; ``selectable``: bool), and a token 8 bytes (its slot in ``order``, int64). The decode
part of both grows on the host by doubling, from a bound on the decode units known without
reading the device where the decode builder's cut rule gives one (``UnitBuilder.
max_decode_units``: pages of ``size`` open one unit per ``size`` tokens), else from the count
the device holds, read when the bound reaches the capacity (a builder that cuts where the
trigger fired, as segments do, may open a unit per token: a trigger can fire on every step, so
that is its honest worst case, and it is what ``reserve`` makes room for before a capture).
Allocated decode units stay under ``2 x`` the rule's bound, or under ``3 x`` the units opened
(plus 16 either way); order positions under ``2 x`` the tokens the decode appended (plus 16).
On a GPU the read is a host sync in the eager decode's plan, at most once per half capacity of
tokens; a captured step never makes it (``reserve`` made its room). Until the first decode
token is filed the table does not know its decode builder (the layer does not pass it), so a
``reserve`` made before it assumes one unit a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import dispatch, reference
from .base import UnitBuilder


def unit_bytes(dim: int) -> int:
    """Bytes one unit of a ``dim``-wide table takes per (sequence, KV head): ``key_sum``,
    ``key_min``, ``key_max`` (float32), ``key_mean`` (float16), ``start``, ``size`` (int64) and
    ``selectable`` (bool)."""
    return 3 * 4 * dim + 2 * dim + 2 * 8 + 1


#: bytes of ``order`` per token per (sequence, KV head): the token's slot (int64)
TOKEN_BYTES = 8


def grow_along(tensor: torch.Tensor, dim: int, new_size: int, fill) -> torch.Tensor:
    """``tensor`` padded with ``fill`` to ``new_size`` along ``dim`` (host-side growth of an index)."""
    shape = list(tensor.shape)
    shape[dim] = new_size - tensor.shape[dim]
    pad = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=dim)


@dataclass
class UnitTable:
    order: torch.Tensor  # (B, H, order_capacity) long: token slots, units are ranges of it
    start: torch.Tensor  # (B, H, unit_capacity) long: first position in ``order``
    size: torch.Tensor  # (B, H, unit_capacity) long: tokens in the unit
    key_sum: torch.Tensor  # (B, H, unit_capacity, D) float32
    key_min: torch.Tensor  # (B, H, unit_capacity, D) float32
    key_max: torch.Tensor  # (B, H, unit_capacity, D) float32
    key_mean: torch.Tensor  # (B, H, unit_capacity, D) float16: reference.half_mean(key_sum, size), scored
    selectable: torch.Tensor  # (B, H, unit_capacity) bool: holds at least one valid token
    open_unit: torch.Tensor  # (B,) long: the decode unit taking leaving tokens, -1 if none
    decode_units: torch.Tensor  # (B,) long: decode units opened so far
    num_prompt_units: int  # host: units [0, num_prompt_units) come from the prompt
    order_len: int  # host: positions of ``order`` in use (buffer sizes only)
    order_next: torch.Tensor  # () long, device: the position of ``order`` the next token takes
    decode_tokens: int  # host: tokens appended at decode (an upper bound on decode units)
    # host: ``decode_units.max()`` as last read from the device, and ``decode_tokens`` then
    units_seen: int = 0
    units_seen_at: int = 0
    # the decode builder, learnt from ``append_leaving_token`` (or given to ``make_room`` and
    # ``reserve``): its cut rule bounds the decode units without reading the device
    decode_builder: UnitBuilder | None = None

    @property
    def capacity(self) -> int:
        return self.start.shape[-1]

    def zone_order(self) -> torch.Tensor:
        """``(B, H, >= zone)``: the prompt zone's slots unit by unit, the order the pool lays them out in."""
        return self.order

    def mean_keys(self) -> torch.Tensor:
        return self.key_sum / self.size.clamp(min=1).unsqueeze(-1)

    @classmethod
    def from_prompt(
        cls,
        keys: torch.Tensor,
        slots: torch.Tensor,
        token_valid: torch.Tensor,
        labels: torch.Tensor,
        num_units: int,
        ops=None,
    ) -> "UnitTable":
        """Build the table from a prefill builder's labels.

        ``keys``: ``(B, H, n, D)`` the zone's keys; ``slots``: ``(n,)`` their slots;
        ``token_valid``: ``(B, n)``; ``labels``: ``(B, H, n)`` in ``[0, num_units)``.
        Invalid tokens go to one extra, never-selectable unit so every slot has a place.
        ``ops``: the kernel ops (or a backend name) that sum the units' keys; the reference's
        by default.
        """
        batch, heads, n, dim = keys.shape
        device = keys.device
        dead = num_units
        labels = torch.where(token_valid[:, None, :], labels, torch.full_like(labels, dead))
        # int32 keys: half the radix passes of a long sort, the same stable order
        perm = torch.sort(labels.to(torch.int32), dim=-1, stable=True).indices
        # spare room so decode tokens can be appended without growing at once
        order = grow_along(slots.to(device)[perm], 2, n + 16, 0)
        # no decode unit yet: the first step's plan (``make_room``) makes room for 16
        units = num_units + 1
        size = torch.zeros(batch, heads, units, dtype=torch.long, device=device)
        size.scatter_add_(2, labels, torch.ones_like(labels))
        start = torch.cumsum(size, dim=-1) - size
        key_sum, key_min, key_max = dispatch.as_ops(ops, device).unit_stats(keys, labels, perm, start, size)
        selectable = size > 0
        selectable[:, :, dead] = False
        return cls(
            order=order,
            start=start,
            size=size,
            key_sum=key_sum,
            key_min=key_min,
            key_max=key_max,
            key_mean=reference.half_mean(key_sum, size),
            selectable=selectable,
            open_unit=torch.full((batch,), -1, dtype=torch.long, device=device),
            decode_units=torch.zeros(batch, dtype=torch.long, device=device),
            num_prompt_units=units,
            order_len=n,
            order_next=torch.full((), n, dtype=torch.long, device=device),  # a fill: torch.tensor would sync
            decode_tokens=0,
        )

    def host_counters(self) -> dict:
        """The host-side counters ``append_leaving_token`` advances (a graph replay leaves them behind)."""
        return {"order_len": self.order_len, "decode_tokens": self.decode_tokens,
                "units_seen": self.units_seen, "units_seen_at": self.units_seen_at}

    def set_host_counters(self, counters: dict) -> None:
        self.order_len, self.decode_tokens = counters["order_len"], counters["decode_tokens"]
        self.units_seen = counters.get("units_seen", 0)
        self.units_seen_at = counters.get("units_seen_at", 0)

    def count_replayed_token(self) -> None:
        """Advance the host counters as ``append_leaving_token`` does, for a replayed step."""
        self.order_len += 1
        self.decode_tokens += 1

    def decode_units_bound(self, tokens: int, builder: UnitBuilder | None = None) -> int:
        """The most decode units a sequence can have opened once ``tokens`` tokens have been
        appended, from host counts alone: the builder's rule (``max_decode_units``) where it gives
        one, and the count last read from the device plus one a token since."""
        rule = self._builder(builder)
        rule = rule.max_decode_units(tokens) if rule is not None else None
        bound = self.units_seen + max(tokens - self.units_seen_at, 0)
        return bound if rule is None else min(bound, rule)

    def _builder(self, builder: UnitBuilder | None) -> UnitBuilder | None:
        return builder if builder is not None else self.decode_builder

    def _counted_by_device(self, builder: UnitBuilder | None) -> bool:
        """Whether the bound on decode units is the device's count (no rule bounds them)."""
        builder = self._builder(builder)
        return builder is None or builder.max_decode_units(1) is None

    def _read_units(self) -> bool:
        """Read the decode units opened from the device (a host sync: only from ``make_room`` or
        ``reserve``, which run before a step's kernels or a capture, never inside one). False
        when the host count is already current."""
        if self.units_seen_at == self.decode_tokens:
            return False
        self.units_seen = int(self.decode_units.max()) if self.decode_units.numel() else 0
        self.units_seen_at = self.decode_tokens
        return True

    def reserve(self, tokens: int, builder: UnitBuilder | None = None) -> None:
        """Room for ``tokens`` more leaving tokens without growing: order positions, and the units
        they can open by the decode builder's rule (one a token for a rule that cuts at trigger
        boundaries, or before the builder is known)."""
        if self.order_len + tokens > self.order.shape[-1]:
            self.order = grow_along(self.order, 2, self.order_len + tokens, 0)
        end = self.decode_tokens + tokens
        if self.num_prompt_units + self.decode_units_bound(end, builder) > self.capacity and \
                self._counted_by_device(builder):
            self._read_units()
        self._grow_units(self.num_prompt_units + self.decode_units_bound(end, builder))

    def make_room(self, builder: UnitBuilder | None = None) -> None:
        """Room for one more token and the unit it may open (host side; the layer's plan step
        calls it before the step's kernels, so nothing grows inside the step). Order positions
        and, by the rule's bound, decode units double. Where the bound is the device's count plus
        a unit a token, the count is read first; the decode part then grows only if the units
        opened fill more than half of it, to three times them, so it holds 2-3x the units opened
        and the next read is at least as many tokens away as there are units."""
        prompt_order = self.order_len - self.decode_tokens
        if self.order_len >= self.order.shape[-1]:
            self.order = grow_along(self.order, 2, prompt_order + max(16, 2 * (self.order.shape[-1] - prompt_order)), 0)
        prompt, room = self.num_prompt_units, self.capacity - self.num_prompt_units
        need = self.decode_units_bound(self.decode_tokens + 1, builder)
        if need <= room:
            return
        if self._counted_by_device(builder) and self._read_units():
            need = self.decode_units_bound(self.decode_tokens + 1, builder)
            if 2 * need <= room:
                return
            grown = 3 * need
        else:
            grown = 2 * room
        self._grow_units(prompt + max(16, need, grown))

    def _grow_units(self, new: int) -> None:
        if new > self.capacity:
            self.start = grow_along(self.start, 2, new, 0)
            self.size = grow_along(self.size, 2, new, 0)
            self.key_sum = grow_along(self.key_sum, 2, new, 0.0)
            self.key_min = grow_along(self.key_min, 2, new, float("inf"))
            self.key_max = grow_along(self.key_max, 2, new, float("-inf"))
            self.key_mean = grow_along(self.key_mean, 2, new, 0.0)
            self.selectable = grow_along(self.selectable, 2, new, False)

    def append_leaving_token(
        self,
        slot: torch.Tensor,
        key: torch.Tensor,
        valid: torch.Tensor,
        boundary: torch.Tensor,
        builder: UnitBuilder,
        ops,
    ) -> None:
        """A token leaves the local window: file it under the open decode unit or a new one.

        ``slot``: its slot, a 0-dim device tensor (the same for every sequence: they decode
        in lockstep);
        ``key``: ``(B, H, D)``; ``valid``: ``(B,)`` False for padding; ``boundary``:
        ``(B, capacity)`` bool, True at the slots made at a step where the trigger fired (the
        decode step's), or ``(B,)``, already the flag of this token.
        Tokens leave in slot order, so a sequence's (left) padding leaves before its first real
        token and a unit's tokens stay one contiguous range of ``order``. The table's tensors
        are updated in place by kernel ops: one launch (``append_leaving_by_rule``) for a
        builder with a ``cut_rule``, else the builder's own ``starts_new_unit`` and
        ``decode_key`` and then ``append_to_unit``.
        """
        self.decode_builder = builder  # its cut rule bounds the units of the steps to come
        self.make_room(builder)  # a no-op after the layer's plan step (kept for direct callers)
        ops = dispatch.as_ops(ops, key.device)
        rule = builder.fused_cut_rule() if boundary.dim() == 2 else None
        if rule is not None:
            max_size, at_boundary = rule
            ops.append_leaving_by_rule(self, slot, key, valid, boundary, max_size, at_boundary)
        else:
            batch, heads, _ = key.shape
            fired = boundary.index_select(1, slot.view(1))[:, 0] if boundary.dim() == 2 else boundary
            has_open = self.open_unit >= 0
            index = self.open_unit.clamp(min=0).view(batch, 1, 1).expand(batch, heads, 1)
            open_size = torch.where(has_open, self.size.gather(2, index)[:, 0, 0], 0)
            cut = builder.starts_new_unit(fired, open_size) & valid
            # in place throughout: a captured step must update the tensors it was captured with
            ops.append_to_unit(
                self.order, self.start, self.size, self.key_sum, self.key_min, self.key_max, self.key_mean,
                self.selectable,
                self.open_unit, self.decode_units, self.order_next, slot, builder.decode_key(key, self), valid, cut,
                self.num_prompt_units,
            )
        self.order_next.add_(1)
        self.order_len += 1
        self.decode_tokens += 1
