#!/bin/bash
# challengers on Gemma 3 8K (seeds 0-1), Gemma's trigger at margin 0.5: every=4 and every=2 with 8, one process each
cd /tmp
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": 0.5'
for v in "e4c8:4:8" "e2c8:2:8"; do
  IFS=: read name every ch <<< "$v"
  env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snapc /work/main/.venv/bin/python -m kvpolicy eval --device cpu --model gemma3 \
    --tasks $T --lengths 8192 --budgets 512 --seeds 0,1 --presets $name \
    --variant "$name=louiskv:{\"trigger\": {$TR, \"every\": $every, \"challengers\": $ch}}" --out /tmp/evc/gemma8k_$name > /tmp/evc/gemma8k_$name.log 2>&1 &
done
wait
