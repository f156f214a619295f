"""An oracle trigger, for a bound on what any trigger could do (a diagnostic for EVAL.md; CPU, reference only).

Each step it computes the true attention (every query head's softmax over every token of the pool, at this
step's query) and fires where a fresh selection (the selector's own, now) would attend more of it than what
is attended now (the held selection, sink and local window) by more than ``delta`` of the whole mass, in any
KV head (mean over its query heads). It knows what no real trigger can: the keys of every unheld token.

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/eval/reuse/trigger_candidates_4k_16samples/oracle_trigger.py \
        eval --device cpu --tasks ... --presets oracle-0.02 \
        --variant 'oracle-0.02=louiskv:{"trigger": {"name": "mass_oracle", "delta": 0.02, "leaving": "ignored"}}' --out DIR
(the arguments after the script are ``kvpolicy``'s; the trigger is registered first).
"""
import sys
from dataclasses import dataclass

import torch

from kvpolicy.cli import main
from kvpolicy.eval.decode import true_attention
from kvpolicy.registry import register
from kvpolicy.triggers.score_gap import ScoreGap


def _mass(probs: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``probs (B, H, G, cap)``; ``slots``/``valid`` ``(B, H, K)`` -> ``(B, H, G)`` the mass on those slots."""
    cap = probs.shape[-1]
    index = slots.clamp(0, cap - 1).unsqueeze(2).expand(-1, -1, probs.shape[2], -1)
    picked = probs.gather(-1, index) * (valid & (slots < cap)).unsqueeze(2)
    return picked.sum(-1)


@register("trigger", "mass_oracle")
@dataclass
class MassOracle(ScoreGap):
    delta: float = 0.02

    def decide(self, query: torch.Tensor, state) -> torch.Tensor:
        layer = state.layer
        self._follow_leaving_token(state)  # keeps the held list (unused here) as the real trigger does
        store, units = layer.store, layer.units
        probs = true_attention(store, query)
        slots, valid = store.attended_slots()
        now = _mass(probs, slots, valid)
        sel = layer.policy.selector.select(query, units, store.retrieval_capacity, layer.ops)
        retrieved = store.retrieved.slots.shape[-1]
        sink = store.sink.slots.shape[-1]
        fresh_slots = slots.clone()
        fresh_valid = valid.clone()
        width = min(retrieved, sel.slots.shape[-1])
        fresh_slots[..., sink:sink + retrieved] = 0
        fresh_valid[..., sink:sink + retrieved] = False
        fresh_slots[..., sink:sink + width] = sel.slots[..., :width]
        fresh_valid[..., sink:sink + width] = sel.slot_valid[..., :width]
        fresh = _mass(probs, fresh_slots, fresh_valid)
        gap = (fresh - now).mean(-1).amax(-1)  # (B,)
        state.gap.copy_(gap)
        return (gap > self.delta) | ~state.has_selection


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
