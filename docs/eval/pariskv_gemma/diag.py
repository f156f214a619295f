"""Where pariskv loses the needle on Gemma 3 270M: per served layer and step (teacher-forced with
full attention's answer), the needle value's tokens through each stage of the selection.

    python docs/eval/pariskv_gemma/diag.py TASK LENGTH SEED [MODEL] ['PRESET_OPTIONS_JSON']
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
options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
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

# the needle value's token positions: the answer's digits as the prompt tokenizes them
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

policy = kvpolicy.preset("pariskv", **options)
rows = []


def observe(state, query):
    index = state.units
    keys = decoding.keys_by_slot(state.store, query.device)  # (1, 1, N, D)
    b, h, n, d = keys.shape
    q = query.float().view(b, h, -1, d)
    valid = state.store.pool.valid[:, :n]
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys) * d**-0.5
    probs = torch.softmax(logits.masked_fill(~valid[:, None, None], float("-inf")), -1)[0, 0]  # (G, N)
    mass = probs.sum(0)
    mean_logit = (q.mean(2)[0, 0] @ keys[0, 0].T).masked_fill(~valid[0], float("-inf"))
    slots, ok = state.store.attended_slots()
    chosen = set(slots[0, 0][ok[0, 0]].tolist())
    # the selection's stages, by position (= slot for the prompt zone)
    dims = d // index.subspaces
    tiers = state.policy.selector.tiers_for(dims)
    rotated, table = ra.query_votes(q, index.signs, index.subspaces, analytic.tier_weights(tiers))
    votes = ra.table_votes(table.int(), index.centroids)[0, 0]
    voted = index.retrieval_mask()[0]
    votes = torch.where(voted, votes, -1)
    sel = state.policy.selector
    retrieval = state.policy.retrieval_budget
    keep = int(ra.candidate_count(voted.sum().view(1), sel.floor_for(retrieval), sel.candidate_fraction,
                                  analytic.CANDIDATE_BANDS)[0])
    cand = ra.candidate_topk(votes.view(1, 1, -1), keep)[0, 0]
    cand_set = set(cand[cand >= 0].tolist())
    all_pos = torch.arange(index.capacity).view(1, 1, -1)
    est = ra.rerank_scores(rotated, index.codes, index.weight, index.norms, all_pos)[0, 0]
    est = torch.where(voted, est, float("-inf"))
    cap = index.capacity

    def rank(score, p):
        return int((score > score[p]).sum())

    per = []
    for p in span:
        per.append(dict(
            pos=p, sel=p in chosen, cand=p in cand_set, mass=round(float(mass[p]), 3),
            head_max=round(float(probs[:, p].max()), 3),
            r_mass=rank(mass, p), r_mean=rank(mean_logit, p),
            r_votes=rank(votes.float(), p) if p < cap else None, r_est=rank(est, p) if p < cap else None,
            votes=int(votes[p]) if p < cap else None))
    # the candidates' share of the attention mass of the oracle's top retrieval-budget zone tokens
    # positions of the prompt zone are its slots (the buffer is never voted on within these steps)
    in_zone = torch.zeros(n, dtype=torch.bool)
    m = min(n, cap)
    in_zone[:m] = voted[:m]
    zone_mass = torch.where(in_zone, mass, 0.0)
    top = zone_mass.topk(retrieval).indices
    in_cand = torch.tensor([int(t) in cand_set for t in top.tolist()])
    cover = float(zone_mass[top][in_cand].sum() / zone_mass[top].sum().clamp(min=1e-12))
    rows.append(dict(layer=state.layer_idx, step=state.decode_steps - 1, keep=keep, zone=int(voted.sum()),
                     retrieval=retrieval, needle=per, cover=cover))


out = decoding.decode(model, shared, policy, steps, forced=full.tokens, observers=[observe], measure_recall=True)
free = decoding.decode(model, shared, policy, steps, stop_ids={tok.eos_token_id})
print("pariskv free-running says", repr(tok.decode(free.tokens, skip_special_tokens=True)),
      "score", score(task, tok.decode(free.tokens, skip_special_tokens=True), sample.answers))
print("recall per layer (forced)", {k: round(v, 3) for k, v in out.recall_per_layer.items()})
for r in rows:
    marks = "".join("S" if x["sel"] else ("c" if x["cand"] else "-") for x in r["needle"])
    hot = max(r["needle"], key=lambda x: x["head_max"])
    print(f"L{r['layer']:2d} step {r['step']:2d} keep {r['keep']} of {r['zone']} | {marks} | hottest digit @{hot['pos']}"
          f" headmax {hot['head_max']} mass {hot['mass']} rank mass {hot['r_mass']} meanlogit {hot['r_mean']}"
          f" votes {hot['votes']} (rank {hot['r_votes']}) est rank {hot['r_est']} sel {hot['sel']}")

for layer in sorted({r["layer"] for r in rows}):
    mine = [r for r in rows if r["layer"] == layer]
    hot = [max(r["needle"], key=lambda x: x["head_max"]) for r in mine[1:8]]  # the digits' steps
    print(f"layer {layer}: candidates hold {sum(r['cover'] for r in mine) / len(mine):.3f} of the oracle top-R zone mass;"
          f" needle digit steps 1-7: vote ranks {[h['r_votes'] for h in hot]}, est ranks {[h['r_est'] for h in hot]},"
          f" selected {''.join('S' if h['sel'] else '-' for h in hot)}")
