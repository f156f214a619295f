"""Is the token that carries an unheld unit's mass that unit's outlier key?

louiskv (default trigger unless LOUISKV_OPTIONS_JSON) is teacher-forced on every-step clusterkv's answer
up to the step where the two first differ. At every step where a layer kept its selection (did not
re-select), for each KV head and each of its query heads, every unheld prompt unit whose unattended tokens
carry at least THRESHOLD of that query head's true attention mass (softmax over the whole context) is listed with:
the unit's size, its share of the head's mass, the share of the unit's mass on its top token, and that
token's rank within its unit (1 = first) by distance from the unit's mean key, by key norm and by distance with
each dimension scaled by the unit's standard deviation in it. Then a
tally of the ranks. (A diagnostic for EVAL.md, "Unit summaries that keep their outlier keys".)

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/eval/reuse/outlier_keys_4k_16samples/outlier_rank.py TASK LENGTH SEED [THRESHOLD] [LOUISKV_OPTIONS_JSON]
"""
import collections
import json
import sys

import torch

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, make_sample, get_task
from kvpolicy.kernels.reference_step import held_units_mask
from kvpolicy.models import load_model

task, length, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
threshold = float(sys.argv[4]) if len(sys.argv) > 4 else 0.10
options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
model, tok = load_model("smollm2")
sample = make_sample(task, tok, length, seed)
chat = build_chat(tok, sample)
shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
steps = get_task(task).max_new_tokens
stop = {tok.eos_token_id}
cluster = kvpolicy.preset("clusterkv", budget=512)
louis = kvpolicy.preset("louiskv", model=model, budget=512, **options)
c_out = decoding.decode(model, shared, cluster, steps, stop_ids=stop)
l_out = decoding.decode(model, shared, louis, steps, stop_ids=stop)
diverge = next((i for i, (a, b) in enumerate(zip(c_out.tokens, l_out.tokens)) if a != b), None)
print(f"{task} seed {seed}: louiskv leaves clusterkv at step {diverge}: "
      f"{tok.decode(c_out.tokens[:diverge + 1])!r} vs {tok.decode(l_out.tokens[:diverge + 1])!r}")
print(f"unheld prompt units with >= {threshold:.0%} of one query head's true mass, at steps where the layer kept "
      f"its selection (steps 0..{diverge}; rank 1 = the unit's most outlying / largest-norm key)")
forced = c_out.tokens[:diverge + 1]
step_of = {}
ranks_dist, ranks_norm, ranks_scaled, top_share = collections.Counter(), collections.Counter(), collections.Counter(), []
rows = []


def observe(state, query):
    li = state.layer_idx
    step = step_of[li] = step_of.get(li, -1) + 1
    if bool(state.reselect[0]) or state.trigger_state.held is None:
        return
    probs = decoding.true_attention(state.store, query)[0]  # (H, G, N)
    keys = decoding.keys_by_slot(state.store, query.device)[0]  # (H, N, D)
    units = state.units
    held = held_units_mask(state.trigger_state.held, units.capacity)[0]
    n = probs.shape[-1]
    # tokens attended anyway (sink, retrieved rows, local window) carry no missing mass
    slots_on, valid_on = state.store.attended_slots()
    attended = torch.zeros(probs.shape[0], n + 1, dtype=torch.bool, device=probs.device)
    attended.scatter_(1, torch.where(valid_on[0], slots_on[0], n).clamp(max=n), True)
    probs = probs.masked_fill(attended[:, None, :n], 0.0)
    for head in range(probs.shape[0]):
        for u in range(units.num_prompt_units):
            size = int(units.size[0, head, u])
            if size < 2 or bool(held[head, u]):
                continue
            start = int(units.start[0, head, u])
            slots = units.order[0, head, start:start + size]
            slots = slots[slots < n]
            per_token = probs[head][:, slots]  # (G, size)
            mass = per_token.sum(-1)
            for g in torch.nonzero(mass >= threshold).flatten().tolist():
                k = keys[head, slots]
                mean = k.mean(0)
                top = int(per_token[g].argmax())
                # rank 1: farthest from the mean / largest norm
                dist_rank = int((k - mean).norm(dim=-1).argsort(descending=True).tolist().index(top)) + 1
                norm_rank = int(k.norm(dim=-1).argsort(descending=True).tolist().index(top)) + 1
                # distance with each dimension scaled by the unit's spread in it
                scaled = ((k - mean) / k.std(0).clamp(min=1e-3)).norm(dim=-1)
                scaled_rank = int(scaled.argsort(descending=True).tolist().index(top)) + 1
                share = float(per_token[g, top] / mass[g])
                ranks_dist[dist_rank] += 1
                ranks_norm[norm_rank] += 1
                ranks_scaled[scaled_rank] += 1
                top_share.append(share)
                rows.append(f"step {step:2d} layer {li:2d} kv {head} q {g}: unit {u:3d} size {size:2d} "
                            f"mass {float(mass[g]):.3f} top token {share:.0%} of it; rank by distance "
                            f"{dist_rank}, by norm {norm_rank}, by scaled distance {scaled_rank}")


decoding.decode(model, shared, louis, len(forced), forced=forced, observers=[observe])
print("\n".join(rows))
total = sum(ranks_dist.values())
print(f"\n{total} (unit, query head, layer, step) cases")
if total:
    for name, ranks in (("distance from mean", ranks_dist), ("key norm", ranks_norm),
                        ("scaled distance", ranks_scaled)):
        within = {m: sum(c for r, c in ranks.items() if r <= m) / total for m in (1, 2, 4)}
        print(f"rank by {name}: " + ", ".join(f"{r}: {c}" for r, c in sorted(ranks.items()))
              + f" | top 1 {within[1]:.0%}, top 2 {within[2]:.0%}, top 4 {within[4]:.0%}")
    top_share.sort()
    print(f"top token's share of the unit's mass: median {top_share[len(top_share) // 2]:.0%}, "
          f"min {top_share[0]:.0%}")
