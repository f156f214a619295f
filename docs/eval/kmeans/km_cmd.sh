#!/bin/bash
# usage: km_cmd.sh LENGTHS SEEDS OUT PRESETS
T=niah_single,niah_multikey,niah_multivalue,niah_multiquery
IGN='{"name": "score_gap", "margin": -2.5, "measure": "mass", "leaving": "ignored"}'
KM='{"name": "kmeans", "tokens_per_cluster": 16, "iters": 3, "init": "spaced", "precision": "bf16"}'
cd "${REPO:-.}"
OMP_NUM_THREADS=1 python -m kvpolicy eval --device cpu --tasks $T \
  --lengths $1 --budgets 512 --seeds $2 --presets $4 \
  --variant "ign-2.5=louiskv:{\"trigger\": $IGN}" \
  --variant "ign-2.5-km3=louiskv:{\"trigger\": $IGN, \"prefill_units\": $KM}" \
  --variant "clusterkv-km3=clusterkv:{\"prefill_units\": $KM}" --out $3
