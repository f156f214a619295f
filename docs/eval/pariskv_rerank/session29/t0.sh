#!/bin/bash
cd /tmp
PY="env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap29 /work/main/.venv/bin/python -m kvpolicy eval --device cpu"
/usr/bin/time -v $PY --model gemma3 --tasks niah_single --lengths 32704 --budgets 512 --seeds 0 \
  --presets pariskv-hs \
  --variant 'pariskv-hs=pariskv:{"selector": {"name": "collision_rerank", "votes": "head_max", "rerank": "head_softmax"}}' \
  --out /tmp/ev29/gemma32k_s0
