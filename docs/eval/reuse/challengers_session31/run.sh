#!/bin/bash
# Session 31 helper: louiskv's SmolLM2 trigger with every=4 + 8 challengers (e4c8) on the cells where the
# every-step default has numbers: SmolLM2 4K seeds 0-3 (16 samples), then 8K seeds 0-3 minus niah_single
# (niah_single 8K seeds 0-3 done in session 29). Run from a git archive of 3ec2f96 at /tmp/snap31, CPU, one core.
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap31 /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": -0.5'
step=${1:-all}
if [ "$step" = 4k ] || [ "$step" = all ]; then
$PY --model smollm2 --tasks $T --lengths 4096 --budgets 512 --seeds 0,1,2,3 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc31/smol4k_e4c8
fi
if [ "$step" = 8k ] || [ "$step" = all ]; then
$PY --model smollm2 --tasks niah_multikey,niah_multivalue,niah_multiquery --lengths 8192 --budgets 512 --seeds 0,1,2,3 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc31/smol8k_e4c8
fi
# the shipped default (louiskv preset, every step, no challengers, int8 keys) on the same 4K cells, for a same-code baseline
if [ "$step" = default4k ] || [ "$step" = all ]; then
$PY --model smollm2 --tasks $T --lengths 4096 --budgets 512 --seeds 0,1,2,3 --presets louiskv --out /tmp/evc31/smol4k_default
fi
# results copied here: smol4k_e4c8 -> smollm2_4k_seeds0-3_e4c8_results.jsonl, smol4k_default -> smollm2_4k_seeds0-3_default_results.jsonl,
# smol8k_e4c8 -> smollm2_8k_seeds0-3_e4c8_results.jsonl
# compare: python docs/eval/reuse/challengers_session31/compare.py > docs/eval/reuse/challengers_session31/compare.txt
