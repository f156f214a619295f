"""The share of (layer, step) pairs whose score_gap gap exceeds each of MARGINS, pooled over the layers, on the
4K needle samples of SEEDS, decoding with TRIGGER_JSON (to place a margin before running a column; the gaps
are those of TRIGGER_JSON's own re-selections, so a share at another margin is an estimate).

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/eval/reuse/outlier_keys_4k_16samples/gap_share.py SEEDS 'TRIGGER_JSON' M1,M2,...
"""
import json
import sys

import torch

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample
from kvpolicy.models import load_model

seeds = [int(s) for s in sys.argv[1].split(",")]
trigger = json.loads(sys.argv[2])
margins = [float(m) for m in sys.argv[3].split(",")]
model, tok = load_model("smollm2")
gaps = []
for task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
    for seed in seeds:
        sample = make_sample(task, tok, 4096, seed)
        chat = build_chat(tok, sample)
        shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
        policy = kvpolicy.preset("louiskv", model=model, budget=512, trigger=trigger)

        def observe(state, query):
            if state.decode_steps > 1:  # the first step always selects
                gaps.append(float(state.trigger_state.gap[0]))

        decoding.decode(model, shared, policy, get_task(task).max_new_tokens, stop_ids={tok.eos_token_id},
                        observers=[observe])
gaps = torch.tensor(gaps)
print(f"{len(gaps)} pairs; " + ", ".join(f"gap > {m}: {float((gaps > m).float().mean()):.1%}" for m in margins))
