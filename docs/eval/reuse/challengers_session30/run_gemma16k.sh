#!/bin/bash
# challengers on Gemma 3 16K (seeds 0-1), Gemma's trigger at margin 0.5: every=4, challengers=8, one process (snapshot of HEAD b119df0 in /tmp/snap30)
mkdir -p /tmp/evc30
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": 0.5'
cd /tmp && env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap30 /work/main/.venv/bin/python -m kvpolicy eval --device cpu --model gemma3 \
  --tasks $T --lengths 16384 --budgets 512 --seeds 0,1 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc30/gemma16k_e4c8 > /tmp/evc30/gemma16k_e4c8.log 2>&1
