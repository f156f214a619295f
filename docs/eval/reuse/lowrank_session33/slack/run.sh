#!/bin/bash
# Session 33, slack-threshold scheme (open loop) on SmolLM2-135M 4K needles, budget 512, louiskv preset, CPU.
# From a git archive of the lead's HEAD with this folder's script copied in:
#   mkdir -p /tmp/snap33s && git -C /work/main archive HEAD | tar x -C /tmp/snap33s
#   cp docs/eval/reuse/lowrank_session33/slack/measure_slack.py /tmp/snap33s/
# The script executes the snapshot's docs/eval/reuse/lowrank_session33/measure_lowrank.py (its definitions).
#   ./run.sh            # 8 runs (4 tasks x seeds 0 1), 2 at a time, longest first
OUT=${OUT:-/tmp/lr33s}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p $OUT
one() {  # task seed
  local tag=$1_seed$2
  cd /tmp/snap33s && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap33s KVPOLICY_SLACK_OUT=$OUT/$tag.json \
    KVPOLICY_LR33_RANKS=8,16,32 $PY measure_slack.py eval --device cpu --model smollm2 --tasks $1 \
    --lengths 4096 --budgets 512 --seeds $2 --presets louiskv --out $OUT/eval_$tag > $OUT/$tag.log 2>&1
}
export -f one; export OUT PY
for t in ${TASKS:-niah_multiquery niah_multivalue niah_single niah_multikey}; do for s in ${SEEDS:-0 1}; do echo "$t $s"; done; done \
  | xargs -P 2 -L 1 bash -c 'one $0 $1'
