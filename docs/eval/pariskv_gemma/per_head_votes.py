"""pariskv with each query head voting on its own and a key keeping its best head's votes
(monkeypatched reference ops; an experiment, not the library's path), against the preset.

    python docs/eval/pariskv_gemma/per_head_votes.py MODEL LENGTH SEED TASK[,TASK...] [mean|per-head]

One mode a process: the ops are bound (and cached) at the first policy's prefill.
"""
import sys

import torch

import kvpolicy
from kvpolicy import analytic
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample, score
from kvpolicy.kernels import reference_analytic as ra
from kvpolicy.models import load_model

original = (ra.query_votes, ra.collision_candidates)


def query_votes(query_group, signs, subspaces, tier_weights):
    weights = torch.as_tensor(tier_weights, dtype=torch.int32, device=query_group.device)
    rotated = analytic.encode_query(query_group.float().mean(2), signs, subspaces, weights.shape[0]).rotated
    heads = analytic.encode_query(query_group.float(), signs, subspaces, weights.shape[0])  # (B, H, G, S, rho)
    return rotated, ra.vote_table(heads.centroids, weights)  # (B, H, G, S, 256)


def collision_candidates(table, key_centroids, token_valid, indexed, width, max_votes, floor, fraction, bands=()):
    batch, heads, n, _ = key_centroids.shape
    position = torch.arange(n, device=key_centroids.device)
    voted = (token_valid & (position < indexed))[:, None, :].expand(batch, heads, n)
    per_head = torch.stack([ra.table_votes(table[:, :, g], key_centroids) for g in range(table.shape[2])])
    votes = torch.where(voted, per_head.max(0).values, -1)
    best = ra.candidate_topk(votes, width)
    keep = ra.candidate_count(voted.sum(-1), floor, fraction, bands)
    best = torch.where(torch.arange(width, device=best.device) < keep[..., None], best, -1)
    ordered = torch.where(best >= 0, best, n).sort(-1).values
    return torch.where(ordered < n, ordered, -1)


name, length, seed, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
mode = sys.argv[5] if len(sys.argv) > 5 else "per-head"
label = {"mean": "mean-query votes", "per-head": "per-head max votes"}[mode]
if mode == "per-head":
    from kvpolicy.kernels import dispatch  # its reference table holds the functions themselves
    table = dispatch._IMPLEMENTATIONS["reference"]
    for op, fn in (("query_votes", query_votes), ("collision_candidates", collision_candidates)):
        table[op] = dispatch.Implementation(fn, lambda device: True)
model, tok = load_model(name)
for task in tasks:
    sample = make_sample(task, tok, length, seed)
    chat = build_chat(tok, sample)
    shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
    steps = get_task(task).max_new_tokens
    if True:
        out = decoding.decode(model, shared, kvpolicy.preset("pariskv"), steps, stop_ids={tok.eos_token_id},
                              measure_recall=True)
        text = tok.decode(out.tokens, skip_special_tokens=True)
        print(f"{name} {task} {length} seed {seed} {label}: {text[:20]!r} score {score(task, text, sample.answers)} "
              f"recall {out.recall:.3f} per layer { {k: round(v, 3) for k, v in out.recall_per_layer.items()} }",
              flush=True)
