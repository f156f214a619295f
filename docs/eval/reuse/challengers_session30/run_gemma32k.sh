#!/bin/bash
# challengers on Gemma 3 32K (seed 0, 32,704 prompt tokens as session 16/23's grid), Gemma's trigger at margin 0.5: every=4, challengers=8, one process (snapshot of HEAD 3cf0046 in /tmp/snap30b)
mkdir -p /tmp/evc30b
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": 0.5'
cd /tmp && env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap30b /work/main/.venv/bin/python -m kvpolicy eval --device cpu --model gemma3 \
  --tasks niah_single,niah_multikey --lengths 32704 --budgets 512 --seeds 0 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc30b/gemma32k_e4c8 > /tmp/evc30b/gemma32k_e4c8.log 2>&1
