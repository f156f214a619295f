#!/bin/bash
# session 28b: niah_single seed 3 (needle 2155799), SmolLM2 at 8K, budget 512; a git archive snapshot in /tmp/snap28b
cd /tmp
run() { OMP_NUM_THREADS=2 PYTHONPATH=/tmp/snap28b /work/main/.venv/bin/python -m kvpolicy eval --model smollm2 --device cpu \
  --tasks niah_single --lengths 8192 --seeds 3 "$@"; }
run --budgets 512 --presets pariskv,oracle,oracle-layout,pariskv-headmax,pariskv-s0l1 \
  --variant 'oracle-layout=oracle:{"sink": 4, "local": 64}' \
  --variant 'pariskv-headmax=pariskv:{"selector": {"name": "collision_rerank", "votes": "head_max"}}' \
  --variant 'pariskv-s0l1=pariskv:{"sink": 0, "local": 1}' --out /tmp/s28b_layout          # -> diag28b_layout/
run --budgets 1024 --presets pariskv,pariskv-all,oracle \
  --variant 'pariskv-all=pariskv:{"selector": {"name": "collision_rerank", "candidate_fraction": 1.0}}' \
  --out /tmp/s28b_b1024                                                                   # -> diag28b_budget1024/
# the rerank scored exactly / per head, and the per-layer stages (-> diag28b.json, trimmed to records with needle mass > 0.05)
OMP_NUM_THREADS=2 PYTHONPATH=/tmp/snap28b /work/main/.venv/bin/python /work/main/docs/eval/pariskv_smollm2/session28/diag28b.py /tmp/diag28b.json
