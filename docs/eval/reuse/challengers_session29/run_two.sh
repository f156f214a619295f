#!/bin/bash
# the two samples every=2 lost (session 26): multiquery and multivalue seed 8, with challengers
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snapc /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": -0.5'
for v in "e2c8:2:8" "e4c8:4:8"; do
  IFS=: read name every ch <<< "$v"
  $PY --model smollm2 --tasks niah_multiquery,niah_multivalue --lengths 4096 --budgets 512 --seeds 8 --presets $name \
    --variant "$name=louiskv:{\"trigger\": {$TR, \"every\": $every, \"challengers\": $ch}}" --out /tmp/evc/two_$name
done
