"""The README demo (`kvpolicy run --preset louiskv --compare full`'s prompt: 4K tokens, 32 new) under
louiskv with each trigger given as JSON: its answer and re-selection share.

    OMP_NUM_THREADS=1 python docs/eval/reuse/demo_share.py '{"name": "score_gap", "margin": -3.0, "measure": "mass"}' ...
"""
import json
import sys

import torch

import kvpolicy
from kvpolicy.demo import answer_is_correct, needle_prompt
from kvpolicy.models import load_model

model, tok = load_model("smollm2")
demo = needle_prompt(tok, target_tokens=4096)
for spec in sys.argv[1:]:
    trigger = json.loads(spec)
    policy = kvpolicy.preset("louiskv", model=model, trigger=trigger)
    with policy.apply(model) as session, torch.inference_mode():
        out = model.generate(demo.input_ids, attention_mask=demo.attention_mask, max_new_tokens=32, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        share = session.stats().reselect_share
    text = tok.decode(out[0, demo.num_tokens:], skip_special_tokens=True)
    print(json.dumps({"trigger": trigger, "share": round(share, 4), "correct": answer_is_correct(text, demo),
                      "answer": text}), flush=True)
