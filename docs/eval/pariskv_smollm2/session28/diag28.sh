#!/bin/bash
cd /tmp
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap28 /work/main/.venv/bin/python -m kvpolicy eval --model smollm2 --device cpu \
  --tasks niah_single --lengths 8192 --budgets 512 --seeds 3 \
  --presets pariskv-half,pariskv-all \
  --variant 'pariskv-half=pariskv:{"selector": {"name": "collision_rerank", "candidate_fraction": 0.5}}' \
  --variant 'pariskv-all=pariskv:{"selector": {"name": "collision_rerank", "candidate_fraction": 1.0}}' \
  --out /tmp/smol8k_single3_diag
