"""How pariskv's defaults for head_dim 64 were chosen (EVAL.md, "ParisKV on SmolLM2").

Attention recall (the eval harness's: share of the oracle top-budget attention mass held by the
attended tokens) over 16 greedy decode steps after 4K-token prompts, budget 512, for 8 subspaces
of 8 dims (256 centroids, 6 tiers) against 16 subspaces of 4 dims (16 centroids, 4 tiers), at
candidate floors of 1x, 2x and 4x the retrieval budget. Run from the repository root:

    PYTHONPATH=. OMP_NUM_THREADS=1 python docs/eval/pariskv_subspaces.py
"""

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, make_sample
from kvpolicy.models import load_model


def units(subspaces):
    spec = {"name": "analytic", "subspaces": subspaces, "update_buffer": 64}
    return {"prefill_units": spec, "decode_units": spec}


variants = {}
for subspaces in (8, 16):
    for floor in (1, 2, 4):
        variants[f"{subspaces} subspaces, floor {floor}x"] = {
            **units(subspaces), "selector": {"name": "collision_rerank", "min_candidates": floor}}
variants["16 subspaces, 3 tiers, floor 2x"] = {
    **units(16), "selector": {"name": "collision_rerank", "min_candidates": 2, "tiers": 3}}

model, tokenizer = load_model(device="cpu")
for task, seed in [("niah_single", 0), ("niah_multikey", 1), ("qa", 0)]:
    chat = build_chat(tokenizer, make_sample(task, tokenizer, 4096, seed))
    prefilled = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
    for label, options in variants.items():
        out = decoding.decode(model, prefilled, kvpolicy.preset("pariskv", budget=512, **options), 16,
                              measure_recall=True)
        print(f"{task} seed {seed}: {label}: recall {out.recall:.4f}", flush=True)
    out = decoding.decode(model, prefilled, kvpolicy.preset("clusterkv", budget=512), 16, measure_recall=True)
    print(f"{task} seed {seed}: clusterkv: recall {out.recall:.4f}", flush=True)
