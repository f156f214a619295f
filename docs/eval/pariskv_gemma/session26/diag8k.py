"""Session 26: where pariskv (head_max votes, Gemma 3's default) loses the 8K single needle.
An adapted copy of ../diag.py: per served layer and step (teacher-forced with full attention's
answer), the needle value's tokens through each stage -- head_max votes and the candidate count,
the 4-bit rerank of the group's mean query (ranked among the candidates against the room left
after the update buffer), the final selection.

    python diag8k.py TASK LENGTH SEED [MODEL] ['PRESET_OPTIONS_JSON'] [OUT_JSON]
"""
import json
import sys

import torch

import kvpolicy
from kvpolicy import analytic
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample, score
from kvpolicy.kernels import reference_analytic as ra
from kvpolicy.models import load_model

task, length, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model_name = sys.argv[4] if len(sys.argv) > 4 else "gemma3"
options = json.loads(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] else {}
out_json = sys.argv[6] if len(sys.argv) > 6 else None
torch.manual_seed(0)
model, tok = load_model(model_name)
sample = make_sample(task, tok, length, seed)
chat = build_chat(tok, sample)
ids = chat["input_ids"][0].tolist()
shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
steps = get_task(task).max_new_tokens
full = decoding.decode(model, shared, kvpolicy.preset("full"), steps, stop_ids={tok.eos_token_id})
answer = sample.answers[0]
print(f"{task} {length} seed {seed} prompt {len(ids)} tokens; answer {answer}; full says "
      f"{tok.decode(full.tokens, skip_special_tokens=True)!r}")

value_ids = None
for prefix in (" ", ""):
    cand = tok(prefix + answer, add_special_tokens=False)["input_ids"]
    for s in range(len(ids) - len(cand) + 1):
        if ids[s:s + len(cand)] == cand:
            value_ids, start = cand, s
            break
    if value_ids:
        break
span = list(range(start, start + len(value_ids)))
print("needle value tokens", [tok.decode([t]) for t in value_ids], "at", span)
print("forced tokens", [tok.decode([t]) for t in full.tokens])

policy = kvpolicy.preset("pariskv", model=model, **options)
print("selector", policy.selector)
rows = []


def observe(state, query):
    index = state.units
    keys = decoding.keys_by_slot(state.store, query.device)  # (1, 1, N, D)
    b, h, n, d = keys.shape
    q = query.float().view(b, h, -1, d)
    G = q.shape[2]
    valid = state.store.pool.valid[:, :n]
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys) * d**-0.5
    probs = torch.softmax(logits.masked_fill(~valid[:, None, None], float("-inf")), -1)[0, 0]  # (G, N)
    mass = probs.sum(0)
    slots, ok = state.store.attended_slots()
    chosen = set(slots[0, 0][ok[0, 0]].tolist())
    sel = state.policy.selector
    dims = d // index.subspaces
    tiers = sel.tiers_for(dims)
    w = analytic.tier_weights(tiers)
    rotated, table_h = ra.query_votes(q, index.signs, index.subspaces, w, per_head=True)
    _, table_m = ra.query_votes(q, index.signs, index.subspaces, w)
    per_head_votes = torch.stack([ra.table_votes(table_h[:, :, g].int(), index.centroids)[0, 0] for g in range(G)])
    voted = index.retrieval_mask()[0]
    vmax = torch.where(voted, per_head_votes.max(0).values, -1)
    vmean = torch.where(voted, ra.table_votes(table_m.int(), index.centroids)[0, 0], -1)
    used = vmax if sel.votes == "head_max" else vmean
    retrieval = state.policy.retrieval_budget
    keep = int(ra.candidate_count(voted.sum().view(1), sel.floor_for(retrieval), sel.candidate_fraction,
                                  analytic.CANDIDATE_BANDS)[0])
    cand = ra.candidate_topk(used.view(1, 1, -1), keep)[0, 0]
    cand = cand[cand >= 0]
    cand_mask = torch.zeros_like(voted)
    cand_mask[cand] = True
    cap = index.capacity
    all_pos = torch.arange(cap).view(1, 1, -1)
    est = ra.rerank_scores(rotated, index.codes, index.weight, index.norms, all_pos)[0, 0]
    est = torch.where(voted, est, float("-inf"))
    est_c = torch.where(cand_mask, est, float("-inf"))
    # per-head 4-bit estimates (a counterfactual rerank: each head's own q, max over heads)
    rot_h = analytic.encode_query(q, index.signs, index.subspaces, len(w)).rotated  # (1,1,G,D)
    est_h = torch.stack([ra.rerank_scores(rot_h[:, :, g], index.codes, index.weight, index.norms, all_pos)[0, 0]
                         for g in range(G)])
    buffered = int(index.buffered())
    room = retrieval - min(buffered, retrieval)
    mean_logit = (q.mean(2)[0, 0] @ keys[0, 0].T).masked_fill(~valid[0], float("-inf"))

    def rank(score, p):
        return int((score > score[p]).sum())

    per = []
    for p in span:
        hh = int(probs[:, p].argmax())
        per.append(dict(
            pos=p, sel=p in chosen, cand=bool(cand_mask[p]) if p < cap else None, head=hh,
            head_max=round(float(probs[:, p].max()), 3), mass=round(float(mass[p]), 3),
            r_mass=rank(mass, p), r_mean=rank(mean_logit, p), r_headlogit=rank(logits[0, 0, hh], p),
            r_vmax=rank(vmax.float(), p), r_vmean=rank(vmean.float(), p),
            r_vhead=rank(torch.where(voted, per_head_votes[hh], -1).float(), p),
            r_est=rank(est, p), r_est_c=rank(est_c, p) if cand_mask[p] else None,
            r_est_head=rank(torch.where(voted, est_h[hh], float("-inf")), p),
            r_est_hmax=rank(torch.where(voted, est_h.max(0).values, float("-inf")), p)))
    in_zone = torch.zeros(n, dtype=torch.bool)
    m = min(n, cap)
    in_zone[:m] = voted[:m]
    zone_mass = torch.where(in_zone, mass, 0.0)
    top = zone_mass.topk(retrieval).indices
    cover = float(zone_mass[top][cand_mask[top]].sum() / zone_mass[top].sum().clamp(min=1e-12))
    rows.append(dict(layer=state.layer_idx, step=state.decode_steps - 1, keep=keep, zone=int(voted.sum()),
                     retrieval=retrieval, room=room, needle=per, cover=cover))


out = decoding.decode(model, shared, policy, steps, forced=full.tokens, observers=[observe], measure_recall=True)
free = decoding.decode(model, shared, policy, steps, stop_ids={tok.eos_token_id})
text = tok.decode(free.tokens, skip_special_tokens=True)
print("pariskv free-running says", repr(text[:60]), "score", score(task, text, sample.answers))
print("recall per layer (forced)", {k: round(v, 3) for k, v in out.recall_per_layer.items()})
for r in rows:
    if r["step"] > 10:
        continue
    marks = "".join("S" if x["sel"] else ("c" if x["cand"] else "-") for x in r["needle"])
    hot = max(r["needle"], key=lambda x: x["head_max"])
    print(f"L{r['layer']:2d} st{r['step']:2d} keep {r['keep']}/{r['zone']} room {r['room']} | {marks} | @{hot['pos']} h{hot['head']}"
          f" p {hot['head_max']} rk mass {hot['r_mass']} meanlogit {hot['r_mean']} headlogit {hot['r_headlogit']}"
          f" | votes max {hot['r_vmax']} mean {hot['r_vmean']} ownhead {hot['r_vhead']}"
          f" | est(mean q) {hot['r_est']} in cand {hot['r_est_c']} est(head) {hot['r_est_head']} est(hmax) {hot['r_est_hmax']}"
          f" | sel {hot['sel']} cover {r['cover']:.2f}")
if out_json:
    json.dump(dict(task=task, length=length, seed=seed, options=options, free=text, rows=rows), open(out_json, "w"))
