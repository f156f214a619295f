#!/bin/bash
# $1 = smol 8K seeds, $2 = its out dir, $3 = gemma seed, $4 = smol 4K seed
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap31 /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
TASKS=niah_single,niah_multikey,niah_multivalue,niah_multiquery
$PY --model smollm2 --tasks $TASKS --lengths 8192 --budgets 512 --seeds "$1" \
  --presets pariskv-hs,oracle \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "rerank": "head_softmax"}}' \
  --out "$2"
$PY --model gemma3 --tasks $TASKS --lengths 8192 --budgets 512 --seeds "$3" \
  --presets pariskv-hs \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "votes": "head_max", "rerank": "head_softmax"}}' \
  --out /tmp/ev31/gemma8k_s$3
$PY --model smollm2 --tasks $TASKS --lengths 4096 --budgets 512 --seeds "$4" \
  --presets pariskv-hs,pariskv,oracle \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "rerank": "head_softmax"}}' \
  --out /tmp/ev31/smol4k_s$4
