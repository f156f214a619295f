#!/bin/bash
# louiskv's SmolLM2 trigger with every + challengers on the 16 held-out 4K samples (seeds 6-9), as session 26's every columns
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snapc /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": -0.5'
for v in "e2c8:2:8" "e4c16:4:16" "e4c8:4:8"; do
  IFS=: read name every ch <<< "$v"
  $PY --model smollm2 --tasks $T --lengths 4096 --budgets 512 --seeds 6,7,8,9 --presets $name \
    --variant "$name=louiskv:{\"trigger\": {$TR, \"every\": $every, \"challengers\": $ch}}" --out /tmp/evc/col_$name
done
