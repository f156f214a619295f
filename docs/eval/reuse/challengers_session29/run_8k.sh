#!/bin/bash
# every=4 with 8 challengers at SmolLM2 8K (seeds 0-3), then Gemma 3 8K (seeds 0-1, its trigger at margin 0.5)
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snapc /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"'
$PY --model smollm2 --tasks $T --lengths 8192 --budgets 512 --seeds 0,1,2,3 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"margin\": -0.5, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc/smol8k_e4c8
$PY --model gemma3 --tasks $T --lengths 8192 --budgets 512 --seeds 0,1 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"margin\": 0.5, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc/gemma8k_e4c8
