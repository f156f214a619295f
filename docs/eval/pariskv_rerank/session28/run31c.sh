#!/bin/bash
# wait for run31.sh's B half, then: SmolLM2 8K niah_single seed 3 current pariskv on this snapshot; 4K seeds 2,3
while pgrep -f "run31.sh 2,3" > /dev/null; do sleep 10; done
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap31 /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
TASKS=niah_single,niah_multikey,niah_multivalue,niah_multiquery
$PY --model smollm2 --tasks niah_single --lengths 8192 --budgets 512 --seeds 3 --presets pariskv,pariskv-hs \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "rerank": "head_softmax"}}' \
  --out /tmp/ev31/smol8k_single3_snap
for s in 2 3; do
$PY --model smollm2 --tasks $TASKS --lengths 4096 --budgets 512 --seeds $s \
  --presets pariskv-hs,pariskv,oracle \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "rerank": "head_softmax"}}' \
  --out /tmp/ev31/smol4k_s$s
done
