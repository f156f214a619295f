#!/bin/bash
# $1 = seeds, $2 = out dir
cd /tmp
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap28 /work/main/.venv/bin/python -m kvpolicy eval --model smollm2 --device cpu \
  --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --lengths 8192 --budgets 512 --seeds "$1" \
  --presets pariskv,oracle,pariskv-rule \
  --variant 'pariskv-rule=pariskv:{"selector": {"name": "collision_rerank", "hold_count": false}}' \
  --out "$2"
