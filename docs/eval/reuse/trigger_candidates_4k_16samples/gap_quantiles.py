"""Per-layer quantiles of the score_gap trigger's gap over the 4K needle samples of SEEDS (for per-layer margins; a
EVAL.md diagnostic). OMP_NUM_THREADS=1 PYTHONPATH=. python docs/eval/reuse/trigger_candidates_4k_16samples/gap_quantiles.py
4,5 '{"name": "score_gap", "margin": -2.5, "measure": "mass", "leaving": "ignored"}' 0.7,0.75,0.8,0.85,0.9 > gap_quantiles_seeds45.json
python gap_quantiles.py SEEDS 'TRIGGER_JSON' Q1,Q2,... > out.json"""
import json, sys
import torch
import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample
from kvpolicy.models import load_model

seeds = [int(s) for s in sys.argv[1].split(",")]
trigger = json.loads(sys.argv[2])
qs = [float(q) for q in sys.argv[3].split(",")]
model, tok = load_model("smollm2")
gaps = {}
for task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
    for seed in seeds:
        sample = make_sample(task, tok, 4096, seed)
        chat = build_chat(tok, sample)
        shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
        policy = kvpolicy.preset("louiskv", model=model, budget=512, trigger=trigger)
        def observe(state, query):
            if state.decode_steps > 1:
                gaps.setdefault(state.layer_idx, []).append(float(state.trigger_state.gap[0]))
        decoding.decode(model, shared, policy, get_task(task).max_new_tokens, stop_ids={tok.eos_token_id}, observers=[observe])
        print(task, seed, file=sys.stderr)
out = {q: [round(float(torch.quantile(torch.tensor(gaps[l]), q)), 3) for l in sorted(gaps)] for q in qs}
print(json.dumps(out))
