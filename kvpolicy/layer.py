"""One layer's policy state and its two entry points: prefill and the decode step.

A decode step is a plan and a run. The plan (``self.plan``, a ``kvpolicy.plan.LayerPlan``) is the
host side: where the pool goes, room in every buffer for the step's token, grown before any
kernel (a captured graph reserved its steps' room up front, so it is a no-op there), and the
host counters. The run (``run_step``) is kernels on fixed buffers, through the ops bound at
prefill (``dispatch.bind``), with no host reads of tensor values anywhere:
    1. the new token goes to the pool and the local ring; the ring pushes out its oldest token
    2. trigger -> ``reselect`` (B,) bool, forced on the first step unless the prefill selected from
       the prompt's last query (``Trigger.decide_and_note``; an always-reselecting trigger's is all
       True from the prefill on, and no launch writes it)
    3. the pushed-out token joins the retrieval index: a decode unit of the unit table (segments
       are cut where the trigger fired), or whatever index the prefill builder made (``analytic``)
    4. selector + budgeted fill -> selection; the store fetches it where ``reselect`` (captured
       as a conditional node: a replayed step where no row re-selects skips it, ``graph_branch``)
    5. where not ``reselect``, the pushed-out token stays attended while the buffer has room (with
       ``admit="evict"``, in place of the lowest-ranked selected row of a full buffer)
    6. sparse attention over sink + retrieved + local: one buffer, one part
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import graph_branch
from .errors import KVPolicyError
from .kernels import dispatch
from .placement import PoolPlacer
from .plan import LayerPlan, SplitPlan
from .store import TieredStore
from .triggers.base import Decision
from .units.index import RetrievalIndex

if TYPE_CHECKING:
    from .policy import Policy


_SIDE_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
# the side stream's CUDA priority (lower is higher; 0 is the default, -1 above it): the
# prompt's units compete with the next layers' prefill kernels for the GPU's blocks, and at normal
# priority much of their work waited until the prefill was done (an 8K prompt's units were ready
# 1.106x full attention's TTFT against 1.089x at -1; H200, session 18, BENCHMARKS.md)
SIDE_STREAM_PRIORITY = -1


def _builds_on_side_stream(device: torch.device) -> bool:
    """Whether a prefill on ``device`` builds the prompt's units on the side stream (on CUDA)."""
    return device.type == "cuda"


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device (and priority) for building prompt units (shared by all layers)."""
    key = (device, SIDE_STREAM_PRIORITY)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY)
    return _SIDE_STREAMS[key]


# each layer's unit cache may take this share of the device memory free when its prompt arrives,
# so 36 layers take at most about 30% of it (1 - 0.99 ** 36)
CACHE_SHARE_OF_FREE = 0.01


def auto_cache_rows(retrieval: int, zone: int, like: torch.Tensor) -> int:
    """``unit_cache_rows=None``'s size for a layer whose pool is in host memory: twice the
    ``retrieval`` rows (the last two selections' worth of misses), at most the prompt's ``zone``
    rows, shrunk to ``CACHE_SHARE_OF_FREE`` of the free device memory; 0 (no cache) when that
    leaves fewer than ``retrieval`` rows. ``like``: a ``(B, H, N, D)`` tensor of the attention
    device's KV dtype."""
    batch, heads, _, dim = like.shape
    rows = min(2 * retrieval, max(zone, retrieval))
    if like.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(like.device)
        row_bytes = 2 * batch * heads * dim * like.element_size()
        rows = min(rows, int(free * CACHE_SHARE_OF_FREE) // row_bytes)
    return rows if rows >= retrieval and retrieval > 0 else 0


class PolicyLayerState:
    """Typed per-layer state: the tiered store, the retrieval index and the trigger's state.

    ``units`` is what the prefill builder's ``build_index`` made: a ``UnitTable`` for the unit
    builders that group tokens, an ``AnalyticIndex`` for ``analytic``. The step only calls the
    index's ``append_leaving_token``, ``reserve`` and host-counter methods, and hands it to
    the selector.
    """

    def __init__(self, policy: "Policy", layer_idx: int, pool_device: torch.device, placer: PoolPlacer | None = None):
        """``pool_device``: where the pool goes; with a ``placer`` (placement "split") the placer
        chooses per layer when the prompt arrives."""
        self.policy = policy
        self.layer_idx = layer_idx
        self.plan = LayerPlan(self, pool_device) if placer is None else SplitPlan(self, placer)
        self.store: TieredStore | None = None
        self.units: RetrievalIndex | None = None  # UnitTable, AnalyticIndex... (units/index.py)
        self.trigger_state: Any = None
        self.boundary: torch.Tensor | None = None  # (B, capacity) bool: trigger fired when slot was made
        self.ops: dispatch.Ops | None = None  # bound at prefill, on the attention device
        self.has_selection: torch.Tensor | None = None  # (B,) bool
        self.reselect: torch.Tensor | None = None  # (B,) bool
        self._reselections: torch.Tensor | None = None  # (B,) long, summed over decode steps
        self.decode_steps = 0
        # (pool_rows_read, rows_fetched) after the first selection (the first decode step's, or the
        # prompt's), which finds an empty buffer: a re-selection's miss fraction counts from there
        # (device copies)
        self.first_fetch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.units_ready: torch.cuda.Event | None = None  # set while the prompt's units build on a side stream
        #: called as ``observer(state, query)`` after selection, before attention (eval's recall)
        self.observers: list = []

    @property
    def seq_length(self) -> int:
        return 0 if self.store is None else self.store.length

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor, num_q_heads: int,
                last_query: torch.Tensor | None = None) -> None:
        """Lay out the prompt's KV and group its retrieval zone into units; with
        ``first_selection="prompt"``, select from ``last_query`` (the prompt's last post-RoPE query,
        ``(B, Hq, D)``), which such a policy needs."""
        policy = self.policy
        batch, heads, prompt, dim = keys.shape
        device = keys.device
        selects_at_prompt = self._selects_at_prompt()
        if selects_at_prompt:
            want = (batch, num_q_heads, dim)
            if last_query is None or tuple(last_query.shape) != want:
                got = "none" if last_query is None else f"{tuple(last_query.shape)}"
                raise KVPolicyError(
                    f"layer {self.layer_idx}: first_selection='prompt' selects from the prompt's last query, so the "
                    f"prefill needs last_query of shape {want} (batch, query heads, head dim); got {got}. Pass it, "
                    "or use first_selection='first_step'"
                )
        self.ops = dispatch.bind(policy.backend, device)
        selects = policy.selector is not None
        # with units, the zone's pool rows are written unit by unit once the units exist
        self.store = TieredStore.from_prefill(
            keys, values, token_valid, policy.sink, policy.local, policy.retrieval_budget,
            self.plan.place_prompt(keys), defer_zone=selects, reselects_every_step=policy.trigger.always_reselects,
        )
        self.plan.settle()
        side = _side_stream(device) if selects and _builds_on_side_stream(device) else None
        if selects:
            zone = self.store.zone_end
            retrievable = token_valid[:, :zone] & ~self.store.sink_slot_mask()
            if side is not None:
                # cluster and lay out the pool on a side stream so the next layers' prefill runs
                # meanwhile; the first decode step waits for it
                side.wait_stream(torch.cuda.current_stream(device))
                for tensor in (keys, values, retrievable):
                    tensor.record_stream(side)
                with torch.cuda.stream(side):
                    self._build_index_and_pool(keys, values, retrievable)
                self.units_ready = torch.cuda.Event()
                self.units_ready.record(side)
            else:
                self._build_index_and_pool(keys, values, retrievable)
        if selects:
            rows = self._cache_rows()
            if rows:
                self.store.set_cache(rows)
        self.boundary = torch.zeros(batch, self.store.pool.valid.shape[1], dtype=torch.bool, device=device)
        always = policy.trigger.always_reselects
        if always:
            # every decode token's slot is a boundary, as note_decision would write it step by step
            self.boundary[:, self.store.length:] = True
        self.trigger_state = policy.trigger.init_state(batch, num_q_heads, dim, device)
        self.has_selection = torch.zeros(batch, dtype=torch.bool, device=device)
        # this step's decision; an always-reselecting trigger's is all True, written once here
        self.reselect = torch.full((batch,), always, dtype=torch.bool, device=device)
        self._reselections = torch.zeros(batch, dtype=torch.long, device=device)
        if self.units_ready is not None:
            # the trigger reads the prompt's units (score_gap gathers the table's sizes at its open
            # unit): attach (and select from the prompt) on the side stream, after the units are
            # written, not on this stream while they are still being built (a read of unwritten
            # memory: an index out of bounds); the same stream as the build's, whatever
            # SIDE_STREAM_PRIORITY says by now
            side.wait_stream(torch.cuda.current_stream(device))
            if selects_at_prompt:
                last_query.record_stream(side)
            with torch.cuda.stream(side):
                self._attach_trigger(last_query if selects_at_prompt else None)
            self.units_ready.record(side)
        else:
            self._attach_trigger(last_query if selects_at_prompt else None)

    def _selects_at_prompt(self) -> bool:
        policy = self.policy
        return policy.selector is not None and not policy.trigger.always_reselects \
            and policy.first_selection == "prompt"

    def _attach_trigger(self, prompt_query: torch.Tensor | None) -> None:
        """Attach the trigger to the prompt's index; given ``prompt_query``, make the first
        selection from it, so that no decode step is forced to select."""
        trigger = self.policy.trigger
        trigger.attach(self.trigger_state, self)
        if prompt_query is None:
            return
        self.reselect.fill_(True)
        self._reselect(prompt_query)
        trigger.prompt_selected(self.trigger_state, prompt_query)
        self.has_selection.fill_(True)
        self.reselect.fill_(False)
        # the selection is made where the first decode token's slot begins: a boundary there, as a
        # selection forced at the first step would write, so a decode unit never joins the prompt's
        # last tokens to the generated ones
        self.boundary[:, self.store.length] = True
        # a re-selection's miss fraction counts from after the selection that found an empty buffer
        self.first_fetch = (self.store.pool_rows_read.clone(), self.store.rows_fetched.clone())

    @property
    def reselections(self) -> torch.Tensor | None:
        """``(B,)`` long: the decode steps at which each sequence re-selected (None before the
        prompt). An always-reselecting trigger's step writes no decision, so its count is every
        step, from the host's step counter (a policy without a selector never re-selects: 0)."""
        if self._reselections is not None and self.policy.trigger.always_reselects and self.policy.selector is not None:
            return torch.full_like(self._reselections, self.decode_steps)
        return self._reselections

    def _cache_rows(self) -> int:
        """The GPU unit cache's rows for this layer (``Policy.unit_cache_rows``)."""
        rows, store = self.policy.unit_cache_rows, self.store
        if rows is not None:
            return rows
        if self.plan.pool_on_device:
            return 0  # the pool is on the attention device already
        return auto_cache_rows(store.retrieval_limit, store.zone_end, store.retrieved.keys)

    def index_bytes(self) -> int:
        """Bytes of the retrieval index's tensors (allocated, reserve included; 0 without one)."""
        if self.units is None:
            return 0
        return sum(t.numel() * t.element_size() for t in vars(self.units).values() if isinstance(t, torch.Tensor))

    def _build_index_and_pool(self, keys: torch.Tensor, values: torch.Tensor, retrievable: torch.Tensor) -> None:
        zone = self.store.zone_end
        self.units = self.policy.prefill_units.build_index(keys[:, :, :zone], retrievable, self.ops, self.layer_idx)
        if not isinstance(self.units, RetrievalIndex):
            raise TypeError(f"{type(self.policy.prefill_units).__name__}.build_index made a {type(self.units).__name__}, "
                            "which lacks RetrievalIndex's methods (kvpolicy/units/index.py)")
        if hasattr(self.units, "decode_builder"):
            # the decode builder's cut rule bounds the units a reserve must make room for
            self.units.decode_builder = self.policy.decode_units
        # a unit table lays the pool out unit by unit; an index of single tokens keeps slot order
        self.store.lay_out_zone(keys, values, self.units.zone_order(), self.ops)

    def wait_for_units(self) -> None:
        """Make the current stream wait for the prompt's units (built on a side stream)."""
        if self.units_ready is not None:
            torch.cuda.current_stream(self.store.pool.valid.device).wait_event(self.units_ready)
            self.units_ready = None

    def decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """``query (B, Hq, D)``, ``key``/``value`` ``(B, H, D)`` -> attention output ``(B, Hq, D)``."""
        self.plan.before_step()
        return self.run_step(query, key, value, scale)

    def run_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """The device side of a step: kernels on fixed buffers, nothing read back (a replay runs this)."""
        policy, store, ops = self.policy, self.store, self.ops
        evicted = store.append(key, value, ops)

        if policy.selector is not None:
            reselect, always = self.reselect, policy.trigger.always_reselects
            if not always:  # an always-reselecting trigger's decision was written at prefill
                policy.trigger.decide_and_note(query, self.trigger_state, ops, self.decision())
            self.units.append_leaving_token(evicted.slot, evicted.key, evicted.valid, self.boundary,
                                            policy.decode_units, ops)
            if always:
                self._reselect(query)  # nothing to skip, and a conditional node costs more than none
            else:
                # in a captured step a conditional node: a step where no row re-selects skips it
                graph_branch.run_if_any(reselect, lambda: self._reselect(query))
            # rows that did not re-select may admit; an always-reselecting trigger's never do: no
            # launch at all (a captured launch that does nothing still costs ~2 us a layer), except
            # that evicting resets ``kept`` to the new selection's fill
            if not always or policy.admit == "evict":
                store.admit(evicted, reselect, ops, evict=policy.admit == "evict")
            if self.first_fetch is None:  # eager: a graph captures a later step
                self.first_fetch = (store.pool_rows_read.clone(), store.rows_fetched.clone())
        self.decode_steps += 1
        for observer in self.observers:
            observer(self, query)

        return ops.sparse_decode_attention(query, store.attention_parts(), scale)

    def decision(self) -> Decision:
        """The tensors this step's decision is written into (``Trigger.decide_and_note``)."""
        return Decision(self.has_selection, self._reselections, self.boundary, self.store.current_slot, self.reselect)

    def _reselect(self, query: torch.Tensor) -> None:
        """Select and fetch for the rows where ``reselect`` (device work only: its results are the
        retrieved buffer's contents, so a graph may skip it when no row re-selects)."""
        policy, store, reselect = self.policy, self.store, self.reselect
        take = None if policy.trigger.always_reselects else reselect
        selection = policy.selector.select(query, self.units, store.retrieval_capacity, self.ops, take=take)
        store.fetch(selection.slots, selection.slot_valid, reselect, self.ops)
        policy.trigger.selected(self.trigger_state, selection, reselect)
