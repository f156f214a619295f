"""Per unit, at the step where louiskv first leaves every-step clusterkv (both teacher-forced on clusterkv's
answer): for the chosen layers and each KV head, the unheld units with the most true attention mass (all
query heads' softmax over the whole context, mean over the group), with what the score_gap trigger estimates
for them (log size + the group-mean score of the unit's mean key), the group-mean logit of their best token
and the key bound (Quest's upper bound); then the two held units with the most mass (a diagnostic for EVAL.md).

    OMP_NUM_THREADS=1 python docs/eval/reuse/trigger_candidates_4k_16samples/unit_mass.py TASK LENGTH SEED LAYERS [LOUISKV_OPTIONS_JSON]
"""
import json, sys
import torch
import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample, score
from kvpolicy.models import load_model
from kvpolicy.kernels import reference
from kvpolicy.kernels.reference_step import held_units_mask

task, length, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layers_want = [int(x) for x in sys.argv[4].split(",")]
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
print("diverge", diverge, repr(tok.decode(c_out.tokens[:diverge+1])))
forced = c_out.tokens[:diverge + 1]
at = diverge - 1
count = {}
def observe(state, query):
    li = state.layer_idx
    count[li] = count.get(li, -1) + 1
    if count[li] != at or li not in layers_want:
        return
    store = state.store
    probs = decoding.true_attention(store, query)
    b, h, cap = probs.shape[0], probs.shape[1], probs.shape[3]
    d = query.shape[-1]
    probs = probs[0]  # (H, G, cap)
    units = state.units
    ts = state.trigger_state
    held = held_units_mask(ts.held, units.capacity)[0]
    group = query.float().view(b, h, -1, d)
    mean = reference.mean_key_scores(group, units.key_mean)[0] * d ** -0.5
    bound = reference.key_bound_scores(group, units.key_min, units.key_max, units.selectable)[0] * d ** -0.5
    slots_att, valid_att = store.attended_slots()
    print(f"layer {li} fired-this-step {int(state.reselect[0])}")
    for head in range(h):
        U = int(units.num_prompt_units)
        rows = []
        for u in range(U):
            sz = int(units.size[0, head, u])
            if sz == 0 or not bool(units.selectable[0, head, u]):
                continue
            st = int(units.start[0, head, u])
            sl = units.order[0, head, st:st + sz]
            sl = sl[sl < cap]
            m = float(probs[head][:, sl].sum(-1).mean())
            mx = float(logits[0, head][:, sl].mean(0).max())
            est = float(mean[head, u]) + float(torch.log(torch.tensor(float(sz))))
            rows.append((m, u, sz, bool(held[head, u]), est, float(bound[head, u]), mx, float(mean[head, u])))
        tot_held = sum(r[0] for r in rows if r[3])
        est_held = float(torch.logsumexp(torch.tensor([r[4] for r in rows if r[3]]), 0)) if any(r[3] for r in rows) else float('nan')
        # exact mean-query lse over held tokens vs estimate
        print(f"  head {head}: true mass held units {tot_held:.3f}; est log held mass {est_held:.2f}")
        rows.sort(reverse=True)
        for r in [r for r in rows if not r[3]][:4]:
            m, u, sz, hd, est, bd, mx, mn = r
            print(f"    unheld u{u:4d} size {sz:3d} true mass {m:.3f} | est logmass {est:6.2f} (gap {est-est_held:6.2f}) mean {mn:6.2f} max-token {mx:6.2f} bound {bd:6.2f}")
        hb = sorted([r for r in rows if r[3]], reverse=True)[:2]
        for r in hb:
            m, u, sz, hd, est, bd, mx, mn = r
            print(f"    held   u{u:4d} size {sz:3d} true mass {m:.3f} | est logmass {est:6.2f} mean {mn:6.2f} max-token {mx:6.2f} bound {bd:6.2f}")
        allb = torch.tensor([r[5] for r in rows]); allmx = torch.tensor([r[6] for r in rows]); allmn = torch.tensor([r[7] for r in rows])
        print(f"    all units: bound-max median {float((allb-allmx).median()):.2f}; max-mean median {float((allmx-allmn).median()):.2f}")
decoding.decode(model, shared, louis, len(forced), forced=forced, observers=[observe])
