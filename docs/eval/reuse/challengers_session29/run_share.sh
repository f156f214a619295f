#!/bin/bash
while pgrep -f run_cols.sh > /dev/null; do sleep 10; done
cd /tmp
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": -0.5'
for v in "e2c8:2:8" "e4c16:4:16"; do
  IFS=: read name every ch <<< "$v"
  env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snapc /work/main/.venv/bin/python docs/eval/reuse/challengers_session29/measure_share.py eval --device cpu --model smollm2 \
    --tasks niah_single,niah_multiquery --lengths 4096 --budgets 512 --seeds 6 --presets $name \
    --variant "$name=louiskv:{\"trigger\": {$TR, \"every\": $every, \"challengers\": $ch}}" --out /tmp/evc/share_$name 2>&1 | grep -v "it/s\]" | tail -4
done
