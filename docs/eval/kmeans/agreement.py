"""Teacher-forced agreement with full attention for louiskv's and clusterkv's K-means settings
(EVAL.md, "Fewer K-means iterations for the prompt's units").

    OMP_NUM_THREADS=1 python docs/eval/kmeans/agreement.py OUT.json [FIRST LAST] [LENGTH] [STEPS]

Samples FIRST..LAST-1 (default 0..16) are made as ``kvpolicy calibrate`` makes them (task ``i mod 8``,
seed ``1000 + i``: disjoint from the eval's seeds), LENGTH tokens (default 4096). Full attention writes
STEPS tokens (default 32); each column is teacher-forced along them. Per column and token: top-1
agreement with full attention's next-token choice and KL(full || policy), step 0 (the shared prefill's
logits) left out, as the calibration does. The per-token lists are written, so columns can be paired.
"""
import json
import sys

import torch

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import TASKS, build_chat, make_sample
from kvpolicy.models import load_model

out = sys.argv[1]
first, last = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (0, 16)
length = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 32
KM3 = {"name": "kmeans", "tokens_per_cluster": 16, "iters": 3, "init": "spaced", "precision": "bf16"}
KM8 = {"name": "kmeans", "tokens_per_cluster": 16, "iters": 8, "init": "spaced", "precision": "split"}
model, tok = load_model("smollm2")
columns = {
    "louiskv": kvpolicy.preset("louiskv", model=model, budget=512, prefill_units=KM8),
    "louiskv-km3": kvpolicy.preset("louiskv", model=model, budget=512, prefill_units=KM3),
    "clusterkv": kvpolicy.preset("clusterkv", budget=512, prefill_units=KM8),
    "clusterkv-km3": kvpolicy.preset("clusterkv", budget=512, prefill_units=KM3),
}
result = {"length": length, "steps": steps, "budget": 512, "samples": [],
          "columns": {name: policy.to_dict() for name, policy in columns.items()}}
names = list(TASKS)
for i in range(first, last):
    sample = make_sample(names[i % len(names)], tok, length, seed=1000 + i)
    chat = build_chat(tok, sample)
    shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
    reference = decoding.decode(model, shared, kvpolicy.preset("full"), steps, keep_logits=True)
    full = torch.stack(reference.logits[1:]).float().log_softmax(-1)
    row = {"sample": i, "task": sample.task, "columns": {}}
    for name, policy in columns.items():
        forced = decoding.decode(model, shared, policy, steps, forced=reference.tokens, keep_logits=True)
        ours = torch.stack(forced.logits[1:]).float().log_softmax(-1)
        row["columns"][name] = {
            "agree": (full.argmax(-1) == ours.argmax(-1)).int().tolist(),
            "kl": (full.exp() * (full - ours)).sum(-1).tolist(),
            "reselect_share": forced.reselect_share,
        }
    result["samples"].append(row)
    summary = {n: round(sum(c["agree"]) / len(c["agree"]), 3) for n, c in row["columns"].items()}
    print(f"sample {i} ({sample.task}): top-1 {summary}", flush=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
