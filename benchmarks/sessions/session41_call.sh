#!/usr/bin/env bash
# Session 41's GPU calls. Usage: bash benchmarks/sessions/session41_call.sh OUTDIR TAR MODE
# MODE tests: the kernel and trigger test files session 40 trimmed for the interpreter (gpu_cross: a covering
# subset on the CPU, the whole cross product and the original shapes on a GPU), run on the GPU, where they had not
# run since the trim;
# profile8: where batch 8's reusing step spends its time over the floor (the floor cell's one missed batch: +10.5%
# reusing without a trigger, session 40): one replayed louiskv step at 2,304 tokens, batch 8, reusing, beside
# full-graph at the 2,048 tokens the budget attends. (The target table's modes are session40_call.sh's long and huge.)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
tests)
  step trimmed_tests 420 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/triggers/test_score_gap.py tests/kernels/triton/test_analytic_ops.py tests/kernels/triton/test_select.py \
    tests/units/test_analytic_index.py tests/test_store_refresh.py tests/test_gpu_cross.py ;;
profile8)
  step profile_b8_reuse 150 python3 benchmarks/profile_step.py --context 2304 --batch 8 --placement gpu \
    --trigger '{"name":"interval","n":1099511627776}' --rows 45
  step profile_b8_floor 150 python3 benchmarks/profile_step.py --preset full --context 2048 --batch 8 --rows 45 ;;
byslot)
  # profile8 found batch 8's attention kernel at 43.8 us a layer against the floor's 27.7: the retrieved rows read
  # from a GPU pool by slot (store.ATTEND_POOL_BY_SLOT) against rows fetched into the buffer, end to end
  for setting in False True; do
    step "e2e_byslot_$setting" 170 python3 benchmarks/with_settings.py kvpolicy.store.ATTEND_POOL_BY_SLOT=$setting \
      -- ${E2E#python3 } --contexts 2304 --batches 8 --presets louiskv@gpu --json "$OUT/e2e_byslot_$setting.json"
  done ;;
*) echo "session41_call.sh: MODE must be tests, profile8 or byslot, got '$3'" >&2; exit 2 ;;
esac
