#!/bin/sh
# louiskv at its default prompt K-means (spaced/8/split) and two cheaper variants, 8K needles (SEEDS=0,1 by default), budget 512.
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
KM3='{"name": "kmeans", "tokens_per_cluster": 16, "iters": 3, "init": "spaced", "precision": "bf16"}'
PG2='{"name": "kmeans", "tokens_per_cluster": 16, "iters": 2, "init": "pages", "precision": "split"}'
OMP_NUM_THREADS=1 .venv/bin/kvpolicy eval --device cpu --tasks $T --lengths 8192 --budgets 512 --seeds ${SEEDS:-0,1} \
    --presets louiskv,louiskv-spaced3bf16,louiskv-pages2split \
    --variant "louiskv-spaced3bf16=louiskv:{\"prefill_units\": $KM3}" \
    --variant "louiskv-pages2split=louiskv:{\"prefill_units\": $PG2}" \
    --out docs/eval/kmeans_variants/needle_8k
