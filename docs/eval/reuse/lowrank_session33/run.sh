#!/bin/bash
# Session 33: a low-rank first pass for the outlier score-gap trigger (SmolLM2 4K, budget 512, the louiskv
# preset's default trigger, reference kernels, CPU). From a git archive of the lead's HEAD with this folder's
# script copied in:
#   mkdir -p /tmp/snap33 && git -C /work/main archive HEAD | tar x -C /tmp/snap33
#   cp docs/eval/reuse/lowrank_session33/measure_lowrank.py /tmp/snap33/
# Open loop (the full trigger decides; every scheme measured beside it), 2 runs at a time:
OUT=${OUT:-/tmp/lr33}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p $OUT
one() {  # task seed [closed basis:r:k]
  local tag=$1_seed$2${3:+_closed_${3//:/-}}
  cd /tmp/snap33 && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap33 KVPOLICY_LR33_OUT=$OUT/$tag.json \
    KVPOLICY_LR33_CLOSED=$3 $PY measure_lowrank.py eval --device cpu --model smollm2 --tasks $1 --lengths 4096 \
    --budgets 512 --seeds $2 --presets louiskv --out $OUT/eval_$tag > $OUT/$tag.log 2>&1
}
export -f one; export OUT PY
if [ "$1" = open ]; then
  for s in ${SEEDS:-0 1}; do for t in niah_single niah_multikey niah_multivalue niah_multiquery; do echo "$t $s"; done; done \
    | xargs -P 2 -L 1 bash -c 'one $0 $1'
fi
# Closed loop (the named top-k scheme decides the run; only its own rank and k measured), seeds 0 1:
#   ./run.sh closed pca:16:16
if [ "$1" = closed ]; then
  IFS=: read -r b r k <<< "$2"
  export KVPOLICY_LR33_RANKS=$r KVPOLICY_LR33_KS=$k KVPOLICY_LR33_BITS=
  [ "$b" = bits ] && export KVPOLICY_LR33_RANKS=8 KVPOLICY_LR33_BITS=$r
  for s in ${SEEDS:-0 1}; do for t in niah_single niah_multikey niah_multivalue niah_multiquery; do echo "$t $s $2"; done; done \
    | xargs -P 2 -L 1 bash -c 'one $0 $1 $2'
fi
