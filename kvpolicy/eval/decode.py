"""Prefill once, decode under many policies: the evaluation's inner loop.

Prefill is dense for every policy, so the harness runs it once per prompt and hands each
policy the same prompt KV; only the decode differs. ``decode`` also measures attention
recall: at each step and layer, the share of the oracle top-budget attention mass that the
tokens the policy attends to hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..integrations.transformers import PolicyCache, cache_argument_name, last_logits_only, record_last_queries
from ..policy import Policy


@dataclass
class Prefilled:
    input_ids: torch.Tensor  # (1, P)
    attention_mask: torch.Tensor
    last_logits: torch.Tensor  # (1, vocab) float32
    # per layer (1, H, P, D), None where the model has no KV; a sliding-window layer (Gemma 3's
    # local layers) holds only its window's last tokens, as transformers' cache keeps them
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    # per layer (1, Hq, D): the prompt's last post-RoPE query, which a policy that makes its first
    # selection from the prompt (``first_selection="prompt"``) selects from
    last_queries: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Decoded:
    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)  # per step (vocab,) float32, if kept
    reselect_share: float | None = None
    decode_steps: int | None = None  # RunStats.decode_steps: the steps the share counts
    miss_fraction: float | None = None  # RunStats.miss_fraction (and its warm form)
    miss_fraction_warm: float | None = None
    recall_per_layer: dict[int, float] = field(default_factory=dict)

    @property
    def recall(self) -> float | None:
        return sum(self.recall_per_layer.values()) / len(self.recall_per_layer) if self.recall_per_layer else None


def _take_stats(result: Decoded, stats) -> None:
    result.reselect_share, result.decode_steps = stats.reselect_share, stats.decode_steps
    result.miss_fraction, result.miss_fraction_warm = stats.miss_fraction, stats.miss_fraction_warm


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefilled:
    """Dense prefill with transformers' own cache; keeps each layer's KV and last query."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with record_last_queries(model) as last_queries:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **last_logits_only(model),
                    **{cache_argument_name(model): cache})
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    values = [getattr(layer, "values", None) for layer in cache.layers]
    return Prefilled(input_ids, attention_mask, out.logits[:, -1].float(), keys, values, last_queries)


class _RecallMeter:
    """Accumulates, per layer, attended attention mass / oracle top-budget mass.

    Replay-safe: it reads the whole reserved pool (invalid slots masked on the device, not cut
    at a host-side length) and adds into per-layer sums kept on the device, so it gives the
    same figures inside a captured decode step as in an eager one.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.sums: dict[int, torch.Tensor] = {}
        self.states: dict[int, object] = {}

    def __call__(self, state, query: torch.Tensor) -> None:
        store = state.store
        probs = true_attention(store, query)
        batch, kv_heads, group, capacity = probs.shape
        # masked slots hold no mass, so taking them among the top k changes nothing
        oracle = probs.topk(min(self.budget, capacity), dim=-1).values.sum(-1)  # (B, H, G)
        slots, valid = store.attended_slots()
        picked = probs.gather(-1, slots.clamp(max=capacity - 1).unsqueeze(2).expand(-1, -1, group, -1))
        held = (picked * valid.unsqueeze(2)).sum(-1)
        recall = (held / oracle.clamp(min=1e-12)).clamp(max=1.0).mean()
        if state.layer_idx not in self.sums:
            self.sums[state.layer_idx] = torch.zeros((), device=query.device)
            self.states[state.layer_idx] = state
        self.sums[state.layer_idx].add_(recall)

    def per_layer(self) -> dict[int, float]:
        return {layer: float(self.sums[layer]) / self.states[layer].decode_steps for layer in sorted(self.sums)}


def keys_by_slot(store, device: torch.device) -> torch.Tensor:
    """``(B, H, capacity, D)`` float32: the pool's keys in slot order, on ``device`` (the pool
    holds the prompt zone unit by unit, so row ``i`` is not slot ``i`` there)."""
    keys = store.pool.keys.to(device).float()
    batch, kv_heads, capacity, dim = keys.shape
    slot_order = torch.arange(capacity, device=device).expand(batch, kv_heads, capacity)
    rows = store.pool_rows(slot_order)
    return keys.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, dim))


def true_attention(store, query: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """``(B, H, G, N)`` float32: each query head's softmax over the pool's first ``N`` slots (``length``,
    default all), in slot order, at ``query (B, Hq, D)``; invalid slots hold no mass. The full
    attention a policy is measured against."""
    keys = keys_by_slot(store, query.device)
    if length is not None:
        keys = keys[:, :, :length]
    batch, kv_heads, n, dim = keys.shape
    q = query.float().view(batch, kv_heads, -1, dim)
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys) * dim**-0.5
    return torch.softmax(logits.masked_fill(~store.pool.valid[:, None, None, :n], float("-inf")), dim=-1)


def graph_by_default(model, policy: Policy, device: torch.device) -> bool:
    """Whether ``decode`` replays a CUDA graph when not told: on CUDA, unless the policy would
    leave layers to transformers' own cache (``DecodeGraph`` refuses those)."""
    if device.type != "cuda" or policy.is_dense:
        return False
    cache = PolicyCache(policy, model.config, torch.device("cpu"))
    return len(cache.served) == len(cache.layers)


def _cache_from_prefill(session, prefilled: Prefilled, num_q_heads: int):
    cache = session.new_cache()
    valid = prefilled.attention_mask.bool()
    for idx, layer in enumerate(cache.layers):
        k, v = prefilled.keys[idx], prefilled.values[idx]
        if k is None:
            continue
        if isinstance(cache, PolicyCache) and idx in cache.served:
            layer.is_initialized = True
            layer.device = k.device
            layer.state.prefill(k, v, valid.to(k.device), num_q_heads, last_query=prefilled.last_queries.get(idx))
        else:
            layer.update(k, v)
            if hasattr(layer, "cumulative_length"):
                # a sliding-window layer was handed only its window: its length is still the prompt's
                # (the model reads its decode positions and masks from it, layer 0 being one in Gemma 3)
                layer.cumulative_length = prefilled.input_ids.shape[-1]
    return cache


def _observe(cache, meter, observers) -> None:
    """Attach the recall meter and any other observers to every served layer."""
    if not isinstance(cache, PolicyCache):
        return
    for state in cache.policy_layers():
        state.observers.extend(o for o in (meter, *observers) if o is not None)


def _graph_decode(model, prefilled, policy, max_new_tokens, forced, keep_logits, meter, stop_ids, emulate,
                  observers=()) -> Decoded:
    """``decode`` through DecodeGraph: fixed-length steps, tokens read back once at the end."""
    from ..graph import DecodeGraph

    config = model.config.get_text_config(decoder=True)
    result = Decoded(tokens=[])
    device = prefilled.input_ids.device
    forced_ids = torch.tensor(forced, device=device) if forced is not None else None
    with policy.apply(model) as session:
        cache = _cache_from_prefill(session, prefilled, config.num_attention_heads)
        _observe(cache, meter, observers)
        runner = DecodeGraph(model, cache, prefilled.attention_mask.sum(-1), max(max_new_tokens - 1, 1), emulate=emulate)
        logits = prefilled.last_logits[0]
        tokens, kept = [], []
        for step in range(max_new_tokens):
            token = forced_ids[step] if forced_ids is not None else logits.argmax()
            tokens.append(token)
            if keep_logits:
                kept.append(logits.clone())  # the runner reuses its logits buffer
            if step == max_new_tokens - 1:
                break
            logits = runner.step(token.view(1))[0]
        result.tokens = torch.stack(tokens).tolist()  # the only read of token values
        result.logits = kept
        if forced is None and stop_ids:
            # every step ran; keep what an eager decode would have kept (up to the first stop)
            for i, token in enumerate(result.tokens):
                if token in stop_ids:
                    result.tokens = result.tokens[: i + 1]
                    result.logits = result.logits[: i + 1]
                    break
        if max_new_tokens > 1:
            _take_stats(result, session.stats())
    if meter is not None:
        result.recall_per_layer = meter.per_layer()
    return result


@torch.inference_mode()
def decode(
    model,
    prefilled: Prefilled,
    policy: Policy,
    max_new_tokens: int,
    *,
    forced: list[int] | None = None,
    keep_logits: bool = False,
    measure_recall: bool = False,
    stop_ids: set[int] | None = None,
    graph: bool | None = None,
    observers: Sequence[Callable] = (),
) -> Decoded:
    """Greedy decode under ``policy`` from a shared dense prefill (batch 1).

    ``forced``: feed these tokens instead of the argmax (teacher forcing); the logits are
    still the policy's. Stops at ``stop_ids`` unless forced. ``graph``: replay the decode step
    as a CUDA graph (default: on CUDA, for retrieval policies serving every layer: a hybrid
    model's sliding-window layers keep transformers' cache, which a graph cannot replay, so
    Gemma 3 decodes eagerly); ``"emulate"`` runs the same
    protocol on any device (tests). With a graph every step runs and the tokens are cut at the
    first stop token afterwards (the same tokens as eager decoding; the re-selection share and
    recall then also count the steps after the stop token). ``observers``: more callables run
    as ``observer(layer_state, query)`` in every served layer at every step (``kvpolicy drift``).
    """
    device = prefilled.input_ids.device
    if graph is None:
        graph = graph_by_default(model, policy, device)
    if graph and not policy.is_dense:
        meter = _RecallMeter(policy.budget) if measure_recall else None
        return _graph_decode(model, prefilled, policy, max_new_tokens, forced, keep_logits, meter, stop_ids,
                             emulate=graph == "emulate", observers=observers)
    config = model.config.get_text_config(decoder=True)
    result = Decoded(tokens=[])
    meter = _RecallMeter(policy.budget) if measure_recall and not policy.is_dense else None
    with policy.apply(model) as session:
        cache = _cache_from_prefill(session, prefilled, config.num_attention_heads)
        _observe(cache, meter, observers)
        mask = prefilled.attention_mask
        logits = prefilled.last_logits[0]
        device = prefilled.input_ids.device
        for step in range(max_new_tokens):
            token = forced[step] if forced is not None else int(logits.argmax())
            result.tokens.append(token)
            if keep_logits:
                result.logits.append(logits)
            if forced is None and stop_ids and token in stop_ids:
                break
            if step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
            out = model(input_ids=torch.tensor([[token]], device=device), attention_mask=mask, use_cache=True,
                        **{cache_argument_name(model): cache})
            logits = out.logits[0, -1].float()
        if isinstance(cache, PolicyCache) and cache.policy_layers()[0].decode_steps:
            _take_stats(result, session.stats())
    if meter is not None:
        result.recall_per_layer = meter.per_layer()
    return result
