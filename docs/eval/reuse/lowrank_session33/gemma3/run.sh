#!/bin/bash
# Session 33, Gemma 3 270M (D=256, 1 KV head, 4 query heads): the low-rank first pass of ../README.md at 4K
# needles, budget 512, the louiskv preset's default Gemma 3 trigger (score_gap, outlier, margin 0.5), reference
# kernels, CPU. From a git archive of the lead's HEAD with this folder's script copied in:
#   mkdir -p /tmp/snap33g && git -C /work/main archive HEAD | tar x -C /tmp/snap33g
#   cp docs/eval/reuse/lowrank_session33/gemma3/measure_lowrank.py /tmp/snap33g/
# Open loop (the full trigger decides; pca and chan at r = 8-128, k = 8, 16, 32, 4-bit beside), 2 at a time:
#   SEEDS="0 1" ./run.sh open
OUT=${OUT:-/tmp/lr33g}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p $OUT
one() {  # task seed [closed basis:r:k]
  local tag=$1_seed$2${3:+_closed_${3//:/-}}
  cd /tmp/snap33g && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/snap33g KVPOLICY_LR33_OUT=$OUT/$tag.json \
    KVPOLICY_LR33_CLOSED=$3 $PY measure_lowrank.py eval --device cpu --model gemma3 --tasks $1 --lengths 4096 \
    --budgets 512 --seeds $2 --presets louiskv --out $OUT/eval_$tag > $OUT/$tag.log 2>&1
}
export -f one; export OUT PY
if [ "$1" = open ]; then
  export KVPOLICY_LR33_BASES=${KVPOLICY_LR33_BASES:-pca,chan} KVPOLICY_LR33_RANKS=${KVPOLICY_LR33_RANKS:-8,16,32,64,128} \
    KVPOLICY_LR33_KS=${KVPOLICY_LR33_KS:-8,16,32} KVPOLICY_LR33_BITS=${KVPOLICY_LR33_BITS-4}
  for s in ${SEEDS:-0 1}; do for t in ${TASKS:-niah_single niah_multikey niah_multivalue niah_multiquery}; do echo "$t $s"; done; done \
    | xargs -P ${JOBS:-2} -L 1 bash -c 'one $0 $1'
fi
# Closed loop (the named top-k scheme decides the run; only its own basis, rank and k measured), seeds 0 1:
#   ./run.sh closed pca:32:16
if [ "$1" = closed ]; then
  IFS=: read -r b r k <<< "$2"
  export KVPOLICY_LR33_BASES=$b KVPOLICY_LR33_RANKS=$r KVPOLICY_LR33_KS=$k KVPOLICY_LR33_BITS=
  for s in ${SEEDS:-0 1}; do for t in ${TASKS:-niah_single niah_multikey niah_multivalue niah_multiquery}; do echo "$t $s $2"; done; done \
    | xargs -P ${JOBS:-2} -L 1 bash -c 'one $0 $1 $2'
fi
