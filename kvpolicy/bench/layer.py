"""One decode layer at a given shape: where the time of a step goes.

A layer's KV is synthetic (random keys and values), laid out by the policy's own prefill
into the tiered store, then each part of a decode step is timed on its own:

    trigger     the re-selection decision
    selection   scoring the units and filling the budget
    transfer    fetching the selected rows from the pool (pinned CPU over PCIe, or GPU)
    attention   sparse attention over sink + retrieved + local

A re-selecting step pays all four; a reusing step pays trigger and attention, plus the
selection and fetch kernels launched for rows that keep their selection (they read the
decision on the device and exit early, except a ranking done by torch.sort, which runs for
every row). Amortised at re-selection rate ``r``: ``reuse + r * (re-selecting - reuse)``.
The unit table first gets the room a decode of ``decode_steps`` tokens reserves: its capacity,
not the prompt's unit count, is what the selection ranks.
Full attention over the same KV held on the GPU is timed beside it.

On a GPU each part is captured as a CUDA graph of its own and its replay is timed (``replay``):
close to the device time a graph-replayed decode step spends on it (each part's graph launch
adds a few microseconds that one whole-step graph pays once). Timed eagerly instead, a part of many small
kernels measures the host's launch rate, not the GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..kernels import dispatch
from ..layer import PolicyLayerState
from ..policy import Policy
from ..presets import preset
from ..units.base import UnitBuilder
from ..units.table import UnitTable
from .timing import time_ms, time_replay_ms


@dataclass
class RandomGroups(UnitBuilder):
    """Units of ``tokens_per_unit`` tokens drawn at random from the prompt: the sizes and the
    scattered layout of K-means clusters without running K-means at 512K tokens."""

    tokens_per_unit: int = 16
    seed: int = 0
    builds_prompt = True

    def build_labels(self, keys, token_valid, backend):
        batch, heads, n, _ = keys.shape
        num_units = max(1, -(-n // self.tokens_per_unit))
        generator = torch.Generator(device=keys.device).manual_seed(self.seed)
        shuffled = torch.rand(batch, heads, n, generator=generator, device=keys.device).argsort(dim=-1)
        labels = torch.empty_like(shuffled)
        labels.scatter_(-1, shuffled, torch.arange(n, device=keys.device).expand_as(shuffled) // self.tokens_per_unit)
        return labels, num_units


@dataclass
class LayerShape:
    batch: int
    context: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


@dataclass
class LayerTimes:
    preset: str
    placement: str
    backend: str
    batch: int
    context: int
    budget: int
    trigger_ms: float
    selection_ms: float
    transfer_ms: float
    reuse_transfer_ms: float  # the fetch launched with no sequence re-selecting
    reuse_selection_ms: float  # the selection launched with no sequence re-selecting (0: the trigger always re-selects)
    attention_ms: float
    full_sdpa_ms: float | None  # full attention over the same KV on the GPU (None if it did not fit)
    transfer_bytes: int
    timing: str = "eager"  # "replay": each part timed as a CUDA-graph replay; "eager": launched from Python
    units: int = 0  # units the selection ranks per (sequence, KV head): the index's capacity after the reserve

    @property
    def reselect_ms(self) -> float:
        return self.trigger_ms + self.selection_ms + self.transfer_ms + self.attention_ms

    @property
    def reuse_ms(self) -> float:
        return self.trigger_ms + self.reuse_selection_ms + self.reuse_transfer_ms + self.attention_ms

    def amortised_ms(self, rate: float) -> float:
        """Mean step time when a share ``rate`` of steps re-select."""
        return self.reuse_ms + rate * (
            self.selection_ms + self.transfer_ms - self.reuse_selection_ms - self.reuse_transfer_ms
        )

    def as_dict(self, rate: float) -> dict:
        out = asdict(self)
        out.update(reselect_ms=self.reselect_ms, reuse_ms=self.reuse_ms, rate=rate, amortised_ms=self.amortised_ms(rate))
        return out


def layer_policy(name: str, budget: int, placement: str, backend: str, random_units: bool) -> Policy:
    """The preset at ``budget``; with ``random_units``, prompt units of a unit table are random groups
    (K-means' sizes and scatter without its cost). Presets with their own index (pariskv's
    ``analytic``) keep it: encoding costs one pass over the keys, nothing to stand in for."""
    policy = preset(name, budget=budget, placement=placement, backend=backend)
    if random_units and issubclass(policy.prefill_units.index_type(), UnitTable):
        policy.prefill_units = RandomGroups()
    return policy


@torch.inference_mode()
def time_layer(
    policy: Policy,
    shape: LayerShape,
    device: torch.device,
    *,
    repeats: int = 30,
    with_full: bool = True,
    seed: int = 0,
    replay: bool = False,
    decode_steps: int = 1024,
) -> LayerTimes:
    """Each part timed on its own; ``replay``: as a CUDA-graph replay (device time, as a replayed
    decode step runs it; CUDA only), else eagerly (including the host's launch gaps).
    ``decode_steps``: room reserved for that many generated tokens, as a decode graph of that
    length reserves it: the unit table grows past the prompt's units, and its capacity is what
    the selection ranks."""
    timer = time_replay_ms if replay else time_ms
    torch.manual_seed(seed)
    b, h, n, d = shape.batch, shape.kv_heads, shape.context, shape.head_dim
    keys = torch.randn(b, h, n, d, dtype=shape.dtype, device=device)
    values = torch.randn(b, h, n, d, dtype=shape.dtype, device=device)
    valid = torch.ones(b, n, dtype=torch.bool, device=device)
    query = torch.randn(b, shape.q_heads, d, dtype=shape.dtype, device=device)
    scale = d**-0.5

    full_ms = None
    if with_full:
        q4 = query.unsqueeze(2)
        def full_attention(k=keys, v=values):
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        full_ms = timer(full_attention, device, repeats)

    pool_device = torch.device("cpu") if policy.placement == "cpu" else device
    state = PolicyLayerState(policy, 0, pool_device)
    state.prefill(keys, values, valid, shape.q_heads, last_query=query)
    del keys, values
    if device.type == "cuda":
        torch.cuda.empty_cache()
    state.wait_for_units()
    state.plan.reserve(decode_steps)
    store, units = state.store, state.units
    capacity = store.retrieval_capacity
    backend = policy.backend
    every = torch.ones(b, dtype=torch.bool, device=device)
    none = torch.zeros(b, dtype=torch.bool, device=device)

    # through the bound ops, as the decode step calls it (a fused trigger's kernels, not its reference,
    # and the decision's note); an always-reselecting trigger's step launches nothing for it
    trigger_ms = 0.0 if policy.trigger.always_reselects else timer(
        lambda: policy.trigger.decide_and_note(query, state.trigger_state, state.ops, state.decision()), device, repeats)
    # as the decode step calls it on a re-selecting step (a take mask unless the trigger always re-selects)
    take = None if policy.trigger.always_reselects else every
    selection_ms = timer(lambda: policy.selector.select(query, units, capacity, backend, take=take), device, repeats)
    selection = policy.selector.select(query, units, capacity, backend, take=take)
    # a reusing step still launches the selection: its kernels exit early for rows that keep
    # their selection, but a ranking done by torch.sort (above the in-kernel limit) runs anyway
    reuse_selection_ms = 0.0 if take is None else timer(
        lambda: policy.selector.select(query, units, capacity, backend, take=none), device, repeats
    )

    def cold_fetch():
        # the store keeps rows it already holds; forget them so every repeat moves the whole selection
        store.forget_resident()
        store.fetch(selection.slots, selection.slot_valid, every, backend)

    transfer_ms = timer(cold_fetch, device, repeats)
    reuse_transfer_ms = timer(lambda: store.fetch(selection.slots, selection.slot_valid, none, backend), device, repeats)
    attention = dispatch.get("sparse_decode_attention", backend, device)
    parts = store.attention_parts()
    attention_ms = timer(lambda: attention(query, parts, scale), device, repeats)
    row = d * store.pool.keys.element_size()
    return LayerTimes(
        preset=policy.name, placement=policy.placement, backend=backend, batch=b, context=n, budget=policy.budget,
        trigger_ms=trigger_ms, selection_ms=selection_ms, transfer_ms=transfer_ms,
        reuse_transfer_ms=reuse_transfer_ms, reuse_selection_ms=reuse_selection_ms, attention_ms=attention_ms,
        full_sdpa_ms=full_ms,
        # a pool attended by slot moves no row at a re-selection (its transfer is the commit alone)
        transfer_bytes=0 if store.attends_pool_by_slot else 2 * b * h * capacity * row,
        timing="replay" if replay else "eager", units=units.capacity,
    )
