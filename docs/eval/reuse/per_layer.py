"""Re-selection share per layer for one needle sample under a trigger (a diagnostic for EVAL.md).

    python docs/eval/reuse/per_layer.py TASK LENGTH SEED 'TRIGGER_JSON' [BUDGET]
"""
import json
import sys

import torch

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample, score
from kvpolicy.models import load_model

task, length, seed, trigger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
budget = int(sys.argv[5]) if len(sys.argv) > 5 else 512
model, tokenizer = load_model("smollm2")
sample = make_sample(task, tokenizer, length, seed)
chat = build_chat(tokenizer, sample)
shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
policy = kvpolicy.preset("louiskv", model=model, budget=budget, trigger=trigger)
fires, gaps = {}, {}


def observe(state, query):
    fires.setdefault(state.layer_idx, []).append(int(state.reselect[0]))
    gap = getattr(state.trigger_state, "gap", None)
    if gap is not None:
        gaps.setdefault(state.layer_idx, []).append(round(float(gap[0]), 2))


out = decoding.decode(model, shared, policy, get_task(task).max_new_tokens, stop_ids={tokenizer.eos_token_id},
                      observers=[observe])
text = tokenizer.decode(out.tokens, skip_special_tokens=True)
print(f"{task} {length} seed {seed}: {text!r} score {score(task, text, sample.answers)} answers {sample.answers} "
      f"share {out.reselect_share:.3f}")
print("tokens:", [tokenizer.decode([t]) for t in out.tokens])
for layer in sorted(fires):
    print(f"layer {layer:2d} fired {''.join(map(str, fires[layer]))}  gaps {gaps.get(layer, '')}")
