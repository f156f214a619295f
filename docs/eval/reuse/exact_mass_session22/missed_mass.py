"""Where does the mass that louiskv misses sit, at the steps where the oracle would re-select and the
score_gap trigger does not? (A diagnostic for EVAL.md, session 22; CPU, reference only.)

louiskv with the given score_gap trigger (default: the exact mass estimate, ``outliers`` 128, each query
head, margin -0.5) is teacher-forced on every-step clusterkv's answer. At each (step, layer) it logs the
trigger's gap and decision beside the oracle's gap (``oracle_trigger.py``'s: the true mass a fresh
selection would attend over what is attended now, mean over a KV head's query heads, the largest KV head).
Where the oracle's gap is over ``delta`` and the trigger kept its selection, it lists the unattended units
with the most true mass (mean over the query heads): prompt or decode unit, held or not, opened since the
selection (``leaving="ignored"`` excludes those), and the trigger's estimated log mass of each against the
held units'.

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/eval/reuse/exact_mass_session22/missed_mass.py TASK LENGTH SEED [DELTA] [TRIGGER_JSON]
"""
import json
import sys

import torch

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample
from kvpolicy.kernels.reference_step import held_units_mask, outlier_log_mass
from kvpolicy.models import load_model
from kvpolicy.registry import register
from kvpolicy.triggers.score_gap import ScoreGap

task, length, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
delta = float(sys.argv[4]) if len(sys.argv) > 4 else 0.03
trigger = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {
    "margin": -0.5, "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 128, "group": "each"}
log = []


def _mass(probs, slots, valid):
    cap = probs.shape[-1]
    index = slots.clamp(0, cap - 1).unsqueeze(2).expand(-1, -1, probs.shape[2], -1)
    return (probs.gather(-1, index) * (valid & (slots < cap)).unsqueeze(2)).sum(-1)


@register("trigger", "score_gap_logged")
class Logged(ScoreGap):
    def decide(self, query, state):
        layer = state.layer
        store, units = layer.store, layer.units
        slots, valid = store.attended_slots()  # before the trigger's own follow-up: this step's attended set
        probs = decoding.true_attention(store, query)  # (B, H, G, N)
        now = _mass(probs, slots, valid)
        sel = layer.policy.selector.select(query, units, store.retrieval_capacity, layer.ops)
        sink, retrieved = store.sink.slots.shape[-1], store.retrieved.slots.shape[-1]
        fresh_slots, fresh_valid = slots.clone(), valid.clone()
        width = min(retrieved, sel.slots.shape[-1])
        fresh_slots[..., sink:sink + retrieved] = 0
        fresh_valid[..., sink:sink + retrieved] = False
        fresh_slots[..., sink:sink + width] = sel.slots[..., :width]
        fresh_valid[..., sink:sink + width] = sel.slot_valid[..., :width]
        oracle = float((_mass(probs, fresh_slots, fresh_valid) - now).mean(-1).amax(-1)[0])
        fire = super().decide(query, state)
        row = {"layer": layer.layer_idx, "gap": float(state.gap[0]), "fire": bool(fire[0]), "oracle": oracle}
        if oracle > delta and not row["fire"] and state.held is not None:
            attended = torch.zeros(probs.shape[-1], dtype=torch.bool)
            for h in range(probs.shape[1]):
                pass
            n = probs.shape[-1]
            est = outlier_log_mass(state.outliers, units, query, query.shape[-1] ** -0.5, True)[0]  # (H, G, U)
            held = held_units_mask(state.held, units.capacity)[0]  # (H, U)
            first_new = units.num_prompt_units + int(state.units_at_selection[0])
            worst = []
            for h in range(probs.shape[1]):
                att = torch.zeros(n, dtype=torch.bool)
                s, v = slots[0, h], valid[0, h]
                att[s[v & (s < n)]] = True
                held_log = torch.logsumexp(est[h][:, held[h]], dim=-1)  # (G,)
                for u in range(units.size.shape[-1]):
                    size = int(units.size[0, h, u])
                    if size <= 0:
                        continue
                    start = int(units.start[0, h, u])
                    us = units.order[0, h, start:start + size]
                    us = us[(us >= 0) & (us < n)]
                    miss = us[~att[us]]
                    if len(miss) == 0:
                        continue
                    m = probs[0, h, :, miss].sum(-1)  # (G,)
                    if float(m.max()) < 0.02:
                        continue
                    worst.append({"kv": h, "unit": u, "prompt": u < units.num_prompt_units, "held": bool(held[h, u]),
                                  "opened": u >= first_new, "size": size, "missed_tokens": len(miss),
                                  "mass_per_q": [round(float(x), 3) for x in m],
                                  "est_gap_per_q": [round(float(x), 2) for x in (est[h, :, u] - held_log)]})
            worst.sort(key=lambda w: -max(w["mass_per_q"]))
            row["missed"] = worst[:6]
            row["unattended_per_kv"] = [round(float(1 - now[0, h].mean()), 3) for h in range(probs.shape[1])]
        log.append(row)
        return fire


model, tok = load_model("smollm2")
sample = make_sample(task, tok, length, seed)
chat = build_chat(tok, sample)
shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
steps = get_task(task).max_new_tokens
cluster = kvpolicy.preset("clusterkv", budget=512)
c_out = decoding.decode(model, shared, cluster, steps, stop_ids={tok.eos_token_id})
policy = kvpolicy.preset("louiskv", budget=512, trigger={"name": "score_gap_logged", **trigger})
l_out = decoding.decode(model, shared, policy, steps, stop_ids={tok.eos_token_id})
diverge = next((i for i, (a, b) in enumerate(zip(c_out.tokens, l_out.tokens)) if a != b), None)
print(f"{task} {length} seed {seed}: clusterkv {tok.decode(c_out.tokens)!r}")
print(f"louiskv (free-running) {tok.decode(l_out.tokens)!r}; leaves clusterkv at step {diverge}")
log.clear()
forced = decoding.decode(model, shared, policy, min(len(c_out.tokens), (diverge or 0) + 2), forced=c_out.tokens,
                         keep_logits=True)
layers = len({r["layer"] for r in log})
for i, r in enumerate(log):
    step = i // layers
    text = f"step {step:2d} layer {r['layer']:2d} fire {int(r['fire'])} gap {r['gap']:+7.2f} oracle {r['oracle']:+.3f}"
    if "missed" in r:
        text += f"  unattended/kv {r['unattended_per_kv']}"
        print(text)
        for w in r["missed"]:
            print("      ", w)
    elif r["oracle"] > delta or (r["fire"] and step > 0):
        print(text)
