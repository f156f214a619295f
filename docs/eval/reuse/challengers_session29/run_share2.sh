#!/bin/bash
while pgrep -f run_share.sh > /dev/null; do sleep 5; done
cd /tmp
TR='"name": "score_gap", "measure": "mass", "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each", "margin": -0.5'
env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snapc /work/main/.venv/bin/python docs/eval/reuse/challengers_session29/measure_share.py eval --device cpu --model smollm2 \
  --tasks niah_single,niah_multiquery --lengths 4096 --budgets 512 --seeds 6 --presets e4c8 \
  --variant "e4c8=louiskv:{\"trigger\": {$TR, \"every\": 4, \"challengers\": 8}}" --out /tmp/evc/share_e4c8 2>&1 | grep -v "it/s\]" | tail -4
