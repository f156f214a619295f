"""The plan half of a layer's decode step: every buffer's growth and the host's counters.

A decode step is a plan and a run (``PolicyLayerState``). The run is kernels on fixed buffers;
the plan is everything the host must do around them, in one object per layer:

    place_prompt / settle   where the layer's pool goes when its prompt arrives (a placement)
    before_step             room for the step's token in every buffer, before any of its kernels
    reserve                 room for ``n`` steps up front: a captured graph never grows a buffer
    counters / restore      the host-side counters a step advances (what a graph replay leaves
    count_replayed_step     behind), for the layer, the store and the retrieval index alike

The buffers are the store's pool and attended tiers, the trigger's boundary row (which slots
were made on a re-selecting step) and the retrieval index (a unit table, ParisKV's analytic
index): each grows only here, on the host, never inside a step.
"""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING

import torch

from .placement import PoolPlacer, pool_bytes
from .store import TieredStore, _allocate_pool

if TYPE_CHECKING:
    from .layer import PolicyLayerState

# the slots a new pool has past its prompt (``TieredStore.from_prefill``'s ``reserve``), read
# from its signature so that a placement counts the pool prefill will make
PREFILL_RESERVE = inspect.signature(TieredStore.from_prefill).parameters["reserve"].default


class LayerPlan:
    """The host side of one layer's steps; the pool stays where the layer was told to put it."""

    def __init__(self, layer: "PolicyLayerState", pool_device: torch.device):
        # weak: the layer owns its plan, and a cycle would leave a finished cache (its KV on the
        # GPU) to the garbage collector instead of freeing it when the last reference goes
        self.layer = weakref.proxy(layer)
        self.pool_device = pool_device

    # ---- placement ---------------------------------------------------------------------------

    def place_prompt(self, keys: torch.Tensor) -> torch.device:
        """Where the pool of the prompt ``keys (B, H, P, D)`` goes."""
        return self.pool_device

    def settle(self) -> None:
        """After prefill made the pool (a placement books the bytes it really took)."""

    @property
    def pool_on_device(self) -> bool | None:
        """True / False once prefilled (pool on the attention device / elsewhere); None before."""
        store = self.layer.store
        return None if store is None else store.pool.device == store.attended.keys.device

    # ---- growth ------------------------------------------------------------------------------

    def before_step(self) -> None:
        """Room for one more token everywhere (a no-op once ``reserve`` made room for it)."""
        layer = self.layer
        layer.wait_for_units()
        store = layer.store
        if store.length >= store.pool.capacity:  # the store is about to double its pool
            self.before_pool_growth(store.length + store.pool.capacity)
        store.make_room()
        self._fit_boundary()
        if layer.units is not None and layer.policy.selector is not None:
            layer.units.make_room()

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more decode steps without growing any buffer (before a capture)."""
        layer = self.layer
        store = layer.store
        if store.length + tokens > store.pool.capacity:
            self.before_pool_growth(store.length + tokens)
        store.reserve(tokens)
        self._fit_boundary()
        if layer.units is not None:
            layer.units.reserve(tokens)

    def before_pool_growth(self, capacity: int) -> None:
        """The pool is about to grow to ``capacity`` slots (a placement may move it first)."""

    def _fit_boundary(self) -> None:
        layer = self.layer
        valid = layer.store.pool.valid
        if layer.boundary.shape[1] < valid.shape[1]:
            # an always-reselecting trigger's decode slots are boundaries before any step writes them
            grown = torch.full_like(valid, layer.policy.trigger.always_reselects)
            grown[:, : layer.boundary.shape[1]] = layer.boundary
            layer.boundary = grown

    # ---- host counters -----------------------------------------------------------------------

    def counters(self) -> dict:
        """The host-side counters a decode step advances."""
        layer = self.layer
        out = {"decode_steps": layer.decode_steps, "length": layer.store.length}
        if layer.units is not None:
            out["units"] = layer.units.host_counters()
        return out

    def restore(self, counters: dict) -> None:
        layer = self.layer
        layer.decode_steps = counters["decode_steps"]
        layer.store.length = counters["length"]
        if layer.units is not None:
            layer.units.set_host_counters(counters["units"])

    def count_replayed_step(self) -> None:
        """Advance the counters as an eager step does, for a step that ran as a graph replay."""
        layer = self.layer
        layer.decode_steps += 1
        layer.store.length += 1
        if layer.units is not None and layer.policy.selector is not None:
            layer.units.count_replayed_token()


class SplitPlan(LayerPlan):
    """Placement "split": the pool's place is chosen when its prompt arrives, by the cache's
    :class:`~kvpolicy.placement.PoolPlacer`, and a pool on the device that would grow past the
    limit moves to pinned host memory first (here, in the plan, never mid-step)."""

    def __init__(self, layer: "PolicyLayerState", placer: PoolPlacer):
        super().__init__(layer, placer.device)
        self.placer = placer
        self._planned = 0

    @property
    def pool_on_device(self) -> bool | None:
        return self.placer.layers.get(self.layer.layer_idx)

    def place_prompt(self, keys: torch.Tensor) -> torch.device:
        batch, heads, prompt, dim = keys.shape
        self._planned = pool_bytes(batch, heads, prompt + PREFILL_RESERVE, dim, keys.element_size())
        self.pool_device = self.placer.place(self.layer.layer_idx, self._planned)
        return self.pool_device

    def settle(self) -> None:
        self.placer.settle(self.layer.layer_idx, self._planned, self._pool_bytes())

    def _pool_bytes(self, capacity: int | None = None) -> int:
        keys = self.layer.store.pool.keys
        batch, heads, have, dim = keys.shape
        return pool_bytes(batch, heads, have if capacity is None else capacity, dim, keys.element_size())

    def before_pool_growth(self, capacity: int) -> None:
        if not self.pool_on_device:
            return  # a host pool grows on the host
        layer = self.layer
        layer.wait_for_units()  # the prompt's units lay the pool out on a side stream: copy it after
        old, new = self._pool_bytes(), self._pool_bytes(capacity)
        if self.placer.grow(layer.layer_idx, old, new):
            return
        pool, host = layer.store.pool, self.placer.host
        layer.store.stop_attending_pool()  # the retrieved rows into the buffer while the pool is still here
        for name in ("keys", "values"):
            rows = getattr(pool, name)
            moved = _allocate_pool(rows, rows.shape[2], host, pool.valid.device)
            moved.copy_(rows)
            setattr(pool, name, moved)
        self.pool_device = host
        self.placer.moved(layer.layer_idx, old)
