"""Prefill once, decode under many policies: the evaluation's inner loop.

Prefill is dense for every policy, so the harness runs it once per prompt and hands each
policy the same prompt KV; only the decode differs. ``decode`` also measures attention
recall: at each step and layer, the share of the oracle top-budget attention mass that the
tokens the policy attends to hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..integrations.transformers import PolicyCache, cache_argument_name
from ..policy import Policy


@dataclass
class Prefilled:
    input_ids: torch.Tensor  # (1, P)
    attention_mask: torch.Tensor
    last_logits: torch.Tensor  # (1, vocab) float32
    keys: list[torch.Tensor | None]  # per layer (1, H, P, D), None where the model has no KV
    values: list[torch.Tensor | None]


@dataclass
class Decoded:
    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)  # per step (vocab,) float32, if kept
    reselect_share: float | None = None
    recall_per_layer: dict[int, float] = field(default_factory=dict)

    @property
    def recall(self) -> float | None:
        return sum(self.recall_per_layer.values()) / len(self.recall_per_layer) if self.recall_per_layer else None


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefilled:
    """Dense prefill with transformers' own cache; keeps each layer's KV."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                **{cache_argument_name(model): cache})
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    values = [getattr(layer, "values", None) for layer in cache.layers]
    return Prefilled(input_ids, attention_mask, out.logits[:, -1].float(), keys, values)


class _RecallMeter:
    """Accumulates, per layer, attended attention mass / oracle top-budget mass."""

    def __init__(self, budget: int):
        self.budget = budget
        self.sums: dict[int, torch.Tensor] = {}  # kept on the device: no host sync per layer and step
        self.counts: dict[int, int] = {}

    def __call__(self, state, query: torch.Tensor) -> None:
        store = state.store
        length = store.length
        keys = store.pool_keys[:, :, :length].to(query.device).float()  # (B, H, n, D)
        batch, kv_heads, _, dim = keys.shape
        q = query.float().view(batch, kv_heads, -1, dim)
        logits = torch.einsum("bhgd,bhnd->bhgn", q, keys) * dim**-0.5
        logits = logits.masked_fill(~store.slot_valid[:, None, None, :length], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        oracle = probs.topk(min(self.budget, length), dim=-1).values.sum(-1)  # (B, H, G)
        slots, valid = store.attended_slots()
        picked = probs.gather(-1, slots.clamp(max=length - 1).unsqueeze(2).expand(-1, -1, q.shape[2], -1))
        held = (picked * valid.unsqueeze(2)).sum(-1)
        recall = (held / oracle.clamp(min=1e-12)).clamp(max=1.0).mean()
        self.sums[state.layer_idx] = self.sums.get(state.layer_idx, 0.0) + recall
        self.counts[state.layer_idx] = self.counts.get(state.layer_idx, 0) + 1

    def per_layer(self) -> dict[int, float]:
        return {layer: float(self.sums[layer]) / self.counts[layer] for layer in sorted(self.sums)}


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
            layer.state.prefill(k, v, valid.to(k.device), num_q_heads)
        else:
            layer.update(k, v)
    return cache


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
) -> Decoded:
    """Greedy decode under ``policy`` from a shared dense prefill (batch 1).

    ``forced``: feed these tokens instead of the argmax (teacher forcing); the logits are
    still the policy's. Stops at ``stop_ids`` unless forced.
    """
    config = model.config.get_text_config(decoder=True)
    result = Decoded(tokens=[])
    meter = _RecallMeter(policy.budget) if measure_recall and not policy.is_dense else None
    with policy.apply(model) as session:
        cache = _cache_from_prefill(session, prefilled, config.num_attention_heads)
        if meter is not None:
            for state in cache.policy_layers():
                state.observers.append(meter)
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
            result.reselect_share = session.stats().reselect_share
    if meter is not None:
        result.recall_per_layer = meter.per_layer()
    return result
