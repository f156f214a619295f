#!/bin/bash
# Session 31: the key-box bound's pruning power for the outlier score-gap trigger (SmolLM2 4K, budget 512,
# the louiskv preset's default trigger, reference kernels, CPU). Run from a git archive of 3d4c1cd with this
# script copied into it (/tmp/snapb).
for task in niah_single niah_multiquery; do
  OMP_NUM_THREADS=2 PYTHONPATH=/tmp/snapb python /tmp/snapb/measure_bounds.py eval --device cpu --model smollm2 \
    --tasks $task --lengths 4096 --budgets 512 --seeds 0 --presets louiskv --out /tmp/bounds_$task \
    | tail -7 > docs/eval/reuse/bounds_session31/${task}_seed0.txt
done
