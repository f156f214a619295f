#!/bin/bash
# session 29: Gemma 3 270M at 32K (32,704 tokens), budget 512, seed 0, one prompt at a time
# (a 32K prefill takes ~23 minutes on one CPU thread; the presets of one prompt share it).
# Step 1 (timing, already run by t0.sh): niah_single seed 0, pariskv-hs only.
# Then the other three tasks, the gap cell (multiquery) first, with all four columns.
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap29 /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
for task in ${TASKS:-niah_multiquery niah_multivalue niah_multikey}; do
  echo "== $task start $(date -u +%T)"
  $PY --model gemma3 --tasks $task --lengths 32704 --budgets 512 --seeds 0 \
    --presets pariskv-hs,pariskv,oracle,full \
    --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "votes": "head_max", "rerank": "head_softmax"}}' \
    --out /tmp/ev29/gemma32k_s0
  echo "== $task end $(date -u +%T) rc=$?"
done
