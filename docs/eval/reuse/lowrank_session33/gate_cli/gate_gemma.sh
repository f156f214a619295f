#!/bin/bash
# the rank option on Gemma 3 at 8K, budget 512, seeds 0-1 (the status table's Gemma 8K cells)
cd /tmp/snap33r
T='{"name": "score_gap", "measure": "mass", "margin": 0.5, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"'
run() {
  OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap33r /work/main/.venv/bin/python -m kvpolicy eval --device cpu --model gemma3 \
    --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --lengths 8192 --budgets 512 --seeds $2 \
    --presets $1 --variant "$1=louiskv:{\"trigger\": $T, \"rank\": 32, \"rank_top\": 16}}" --out $3
}
run g8r32k16 0 /tmp/gate33/g0 > /tmp/gate33.g0.log 2>&1 &
run g8r32k16 1 /tmp/gate33/g1 > /tmp/gate33.g1.log 2>&1 &
wait
