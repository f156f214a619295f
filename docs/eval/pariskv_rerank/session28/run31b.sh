#!/bin/bash
# same-snapshot baselines: Gemma 3 8K current pariskv (head_max votes, group-mean rerank), seeds $1
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap31 /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
TASKS=niah_single,niah_multikey,niah_multivalue,niah_multiquery
for s in $1; do
$PY --model gemma3 --tasks $TASKS --lengths 8192 --budgets 512 --seeds $s --presets pariskv,pariskv-hs \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "votes": "head_max", "rerank": "head_softmax"}}' \
  --out /tmp/ev31/gemma8k_s$s
done
