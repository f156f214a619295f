"""The README demo (`kvpolicy run --preset louiskv --compare full`'s prompt: 4K tokens, 32 new) under
louiskv with each setting given as JSON: its answer, re-selection share and miss fraction (re-selected
rows the retrieved buffer did not hold; "warm": after each layer's first selection). A JSON with a
"name" is a trigger; any other is the preset's options (``{}``: the preset's default).

    OMP_NUM_THREADS=1 python docs/eval/reuse/demo_share.py '{"name": "score_gap", "margin": -3.0, "measure": "mass"}' ...
    OMP_NUM_THREADS=1 python docs/eval/reuse/demo_share.py '{}' '{"admit": "evict"}'
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
    given = json.loads(spec)
    options = {"trigger": given} if "name" in given else given
    policy = kvpolicy.preset("louiskv", model=model, **options)
    with policy.apply(model) as session, torch.inference_mode():
        out = model.generate(demo.input_ids, attention_mask=demo.attention_mask, max_new_tokens=32, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        stats = session.stats()
    text = tok.decode(out[0, demo.num_tokens:], skip_special_tokens=True)
    print(json.dumps({"options": options, "trigger": policy.to_dict()["trigger"], "admit": policy.admit,
                      "share": round(stats.reselect_share, 4), "miss_fraction": round(stats.miss_fraction, 4),
                      "miss_fraction_warm": round(stats.miss_fraction_warm, 4),
                      "correct": answer_is_correct(text, demo), "answer": text}), flush=True)
