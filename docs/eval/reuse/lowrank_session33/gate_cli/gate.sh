#!/bin/bash
# the rank option's needle gate: SmolLM2 4K, budget 512, the 32 samples of EVAL.md's status table
cd /tmp/snap33r
T='{"name": "score_gap", "measure": "mass", "margin": -0.5, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"'
run() {  # label json seeds out
  OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap33r /work/main/.venv/bin/python -m kvpolicy eval --device cpu --model smollm2 \
    --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --lengths 4096 --budgets 512 --seeds $3 \
    --presets $1 --variant "$1=louiskv:{\"trigger\": $T$2}}" --out $4
}
OUT=/tmp/gate33
run r32k16 ', "rank": 32, "rank_top": 16' 0,1,2,3 $OUT/a > $OUT.a.log 2>&1 &
run r32k16 ', "rank": 32, "rank_top": 16' 6,7,8,9 $OUT/b > $OUT.b.log 2>&1 &
wait
run r16k16 ', "rank": 16, "rank_top": 16' 0,1,2,3 $OUT/c > $OUT.c.log 2>&1 &
run r16k16 ', "rank": 16, "rank_top": 16' 6,7,8,9 $OUT/d > $OUT.d.log 2>&1 &
wait
