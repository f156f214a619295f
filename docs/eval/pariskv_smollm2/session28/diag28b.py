"""Where pariskv loses SmolLM2's 8K niah_single seed 3 (needle 2155799): per stage, per layer (session 28b).

1. Free decodes: oracle, pariskv, and pariskv with its rerank scored exactly (the 4-bit
   ``rerank_scores`` replaced, in this process only): ``exact-mean`` (the group's mean query . the
   full-precision key, the same ranking as the 4-bit estimate would give with no quantisation error)
   and ``exact-mass`` (each query head's softmax over the zone, summed over the group: the oracle's
   score, but only over pariskv's candidates and within pariskv's sink/local/buffer layout),
   ``exact-headmax`` (the best query head's q.k), and two a 4-bit index could run: ``q4-headmax``
   (each query head's own 4-bit estimate times its norm, the best head's) and ``q4-mass`` (each
   head's softmax of its 4-bit estimates over the candidates, summed over the group).
2. pariskv teacher-forced on the oracle's answer: at each step, each layer and KV head, for the
   needle's digit tokens: in the oracle's top (group attention mass rank < budget), in the candidates,
   rank of the 4-bit score and of the exact mean-query score among the candidates (the cut is
   retrieval budget - update buffer rows), attended by pariskv. Also the step's logit margin.

Run from a snapshot (no library change): OMP_NUM_THREADS=2 PYTHONPATH=SNAPSHOT python diag28b.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch

from kvpolicy import analytic
from kvpolicy.eval import decode as D
from kvpolicy.eval.tasks import build_chat, get_task, make_sample, score
from kvpolicy.kernels import reference_analytic as RA
from kvpolicy.layer import PolicyLayerState
from kvpolicy.models import load_model
from kvpolicy.presets import preset
from kvpolicy.selectors import collision_rerank as CR

TASK, LENGTH, SEED, BUDGET = "niah_single", 8192, 3, 512
torch.manual_seed(0)
model, tok = load_model("smollm2", device="cpu")
sample = make_sample(TASK, tok, LENGTH, SEED)
chat = build_chat(tok, sample)
ids = chat["input_ids"][0].tolist()
needle = sample.answers[0]
pre = D.prefill(model, chat["input_ids"], chat["attention_mask"])
stop = {tok.eos_token_id}
steps = get_task(TASK).max_new_tokens

# the needle's digit tokens: a run of digit tokens whose text is the needle
text = [tok.decode([t]) for t in ids]
needle_pos = None
for i in range(len(ids)):
    j, acc = i, ""
    while j < len(ids) and text[j].strip().isdigit() and len(acc) < len(needle):
        acc += text[j].strip()
        j += 1
    if acc == needle and (i == 0 or not text[i - 1].strip().isdigit()):
        needle_pos = list(range(i, j))
        break
print("needle", needle, "tokens at", needle_pos, [text[p] for p in needle_pos], "prompt", len(ids), flush=True)

# -- the exact rerank: rerank_scores replaced; the layer's keys and query set just before each selection
CTX: dict = {"mode": None}
_orig_scores = RA.rerank_scores
_orig_reselect = PolicyLayerState._reselect


def _reselect(self, query):
    if CTX["mode"] is None:  # only the exact reruns need the keys (the oracle's index has no slots)
        return _orig_reselect(self, query)
    CTX["keys"] = D.keys_by_slot(self.store, query.device)[:, :, self.units.slots.clamp(min=0)]  # (B, H, N, D)
    CTX["valid"] = self.units.token_valid
    CTX["query"] = query
    CTX["index"] = self.units
    return _orig_reselect(self, query)


def _scores(query_rotated, codes, weight, norms, candidates):
    if CTX["mode"] is None:
        return _orig_scores(query_rotated, codes, weight, norms, candidates)
    keys, query = CTX["keys"], CTX["query"].float()
    batch, heads, n, dim = keys.shape
    q = query.view(batch, heads, -1, dim)
    if CTX["mode"].startswith("q4-"):
        # each query head's own 4-bit estimate, scaled by its norm (the estimate is of q.k / |q|)
        index = CTX["index"]
        rotated = analytic.encode_query(q, index.signs, index.subspaces, 1).rotated  # (B, H, G, D) unit
        est = torch.stack([_orig_scores(rotated[:, :, g], codes, weight, norms, candidates)
                           for g in range(q.shape[2])], 2) * q.norm(dim=-1, keepdim=True)  # (B, H, G, C)
        if CTX["mode"] == "q4-headmax":
            return est.max(2).values
        # q4-mass: each head's softmax over the candidates, summed over the group
        return torch.where(candidates >= 0, torch.softmax(est * dim**-0.5, -1).sum(2), float("-inf"))
    if CTX["mode"] == "exact-mean":
        full = torch.einsum("bhnd,bhd->bhn", keys, q.mean(2))
    elif CTX["mode"] == "exact-headmax":
        full = torch.einsum("bhnd,bhgd->bhgn", keys, q).max(2).values
    else:  # exact-mass: the oracle's score
        logits = torch.einsum("bhgd,bhnd->bhgn", q, keys) * dim**-0.5
        logits = logits.masked_fill(~CTX["valid"][:, None, None, :n], float("-inf"))
        full = torch.softmax(logits, -1).sum(2)
    picked = full.gather(2, candidates.clamp(min=0))
    return torch.where(candidates >= 0, picked, float("-inf"))


RA.rerank_scores = _scores
PolicyLayerState._reselect = _reselect


def policy(name, **options):
    p = preset(name, model=model, budget=BUDGET, **options)
    return p


def free(name, mode=None):
    CTX["mode"] = mode
    out = D.decode(model, pre, policy(name), steps, stop_ids=stop)
    CTX["mode"] = None
    answer = tok.decode(out.tokens, skip_special_tokens=True)
    return {"answer": answer, "score": score(TASK, answer, sample.answers)}


report = {"needle": needle, "needle_positions": needle_pos, "prompt_tokens": len(ids), "free": {}}
oracle_out = D.decode(model, pre, policy("oracle"), steps, stop_ids=stop)
oracle_tokens = oracle_out.tokens
oracle_answer = tok.decode(oracle_tokens, skip_special_tokens=True)
report["free"]["oracle"] = {"answer": oracle_answer, "score": score(TASK, oracle_answer, sample.answers)}
for label, mode in (("pariskv", None), ("pariskv exact-mean rerank", "exact-mean"),
                    ("pariskv exact-mass rerank", "exact-mass"), ("pariskv exact-headmax rerank", "exact-headmax"),
                    ("pariskv q4-headmax rerank", "q4-headmax"), ("pariskv q4-mass rerank", "q4-mass")):
    report["free"][label] = free("pariskv", mode)
    print(label, report["free"][label], flush=True)
print("oracle", report["free"]["oracle"], flush=True)

# -- teacher-forced pariskv on the oracle's answer, with per-layer records
records: list = []
needle_t = torch.tensor(needle_pos)


def observer(state, query):
    store, index, sel, ops = state.store, state.units, state.policy.selector, state.ops
    probs = D.true_attention(store, query)  # (B, H, G, S) over slots
    batch, heads, group, slots = probs.shape
    mass = probs.sum(2)[0]  # (H, S): the oracle's score
    mass_rank = torch.stack([(mass[h] > mass[h, needle_t].unsqueeze(-1)).sum(-1) for h in range(heads)])  # (H, P)
    attended_slots, attended_valid = store.attended_slots()
    att = attended_slots[0].masked_fill(~attended_valid[0], -1)
    attended = torch.stack([torch.isin(needle_t, att[h]) for h in range(heads)])  # (H, P)
    # the candidates, as select makes them
    dims = query.shape[-1] // index.subspaces
    tiers = sel.tiers_for(dims)
    group_q = query.view(batch, heads, group, -1)
    rotated, table = ops.query_votes(group_q, index.signs, index.subspaces, CR._votes_on(tiers, query.device),
                                     **({"per_head": True} if sel.votes == "head_max" else {}))
    capacity = store.retrieval_capacity
    cand = ops.collision_candidates(table, index.centroids, index.token_valid, index.indexed,
                                    sel.candidates_for(index.capacity, capacity), index.subspaces * tiers,
                                    *sel.rule_for(capacity))[0]  # (H, C)
    in_cand = torch.stack([torch.isin(needle_t, cand[h]) for h in range(heads)])
    q4 = _orig_scores(rotated, index.codes, index.weight, index.norms, cand[None])[0]  # (H, C)
    keys = D.keys_by_slot(store, query.device)[0][:, index.slots.clamp(min=0)]  # (H, N, D)
    exact = torch.einsum("hnd,hd->hn", keys, group_q[0].float().mean(1))
    exact_c = torch.where(cand >= 0, exact.gather(1, cand.clamp(min=0)), float("-inf"))
    buffered = int(index.buffered().clamp(max=capacity))
    q4_rank, ex_rank = [], []
    for h in range(heads):
        row_q4, row_ex = [], []
        for p in needle_pos:
            hit = (cand[h] == p).nonzero()
            if len(hit) == 0:
                row_q4.append(-1)
                row_ex.append(-1)
                continue
            c = hit[0, 0]
            row_q4.append(int((q4[h] > q4[h, c]).sum()))
            row_ex.append(int((exact_c[h] > exact_c[h, c]).sum()))
        q4_rank.append(row_q4)
        ex_rank.append(row_ex)
    records.append({
        "step": state.decode_steps, "layer": state.layer_idx, "cut": capacity - buffered,
        "mass": mass[:, needle_t].tolist(), "mass_rank": mass_rank.tolist(), "attended": attended.tolist(),
        "candidate": in_cand.tolist(), "q4_rank": q4_rank, "exact_rank": ex_rank,
    })


forced = D.decode(model, pre, policy("pariskv"), len(oracle_tokens), forced=oracle_tokens, keep_logits=True,
                  observers=[observer])
margins = []
for k, logits in enumerate(forced.logits):
    want = oracle_tokens[k]
    top2 = logits.topk(2)
    margins.append({"step": k, "oracle_token": tok.decode([want]), "pariskv_argmax": tok.decode([int(logits.argmax())]),
                    "logit_oracle_token": float(logits[want]), "logit_best_other": float(
                        max(v for i, v in zip(top2.indices.tolist(), top2.values.tolist()) if i != want))})
report["forced_margins"] = margins
report["records"] = records

# a summary per step: (layer, head, digit) triples in the oracle's top-budget but not attended by pariskv, and why
summary = []
for step in sorted({r["step"] for r in records}):
    rows = [r for r in records if r["step"] == step]
    lost = {"not_candidate": 0, "4bit_only": 0, "mean_query": 0, "other": 0}
    total_top, lost_mass, top_mass = 0, 0.0, 0.0
    for r in rows:
        for h in range(len(r["mass"])):
            for i in range(len(needle_pos)):
                if r["mass_rank"][h][i] >= BUDGET - 1:
                    continue
                total_top += 1
                top_mass += r["mass"][h][i]
                if r["attended"][h][i]:
                    continue
                lost_mass += r["mass"][h][i]
                if not r["candidate"][h][i]:
                    lost["not_candidate"] += 1
                elif r["q4_rank"][h][i] >= r["cut"] and r["exact_rank"][h][i] < r["cut"]:
                    lost["4bit_only"] += 1
                elif r["exact_rank"][h][i] >= r["cut"]:
                    lost["mean_query"] += 1
                else:
                    lost["other"] += 1
    summary.append({"step": step, "needle_in_oracle_top": total_top, "lost": lost,
                    "lost_mass_share": lost_mass / max(top_mass, 1e-12)})
report["summary"] = summary
for m, s in zip(margins[1:], summary):
    print(json.dumps(m), json.dumps(s), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
