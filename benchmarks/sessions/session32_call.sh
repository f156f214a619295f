#!/usr/bin/env bash
# Session 32's GPU calls. Usage: bash benchmarks/sessions/session32_call.sh OUTDIR TAR MODE
# MODE first: what programmatic dependent launch saves between small dependent kernels in a graph
# (pdl_chain.py); session 31's untimed challenger settings side by side, and the score-gap GPU tests of what
# changed there;
# pdl: programmatic dependent launch (kernels/triton/pdl.py) in the reusing step's kernels: the GPU tests of the
# kernels it touched, then louiskv and full-graph end to end with it on and off (ran at 0889dad: explicit launch
# arguments in the reusing step's kernels);
# pdl_all: every kernel a pdl_kernel: the chain's checks, louiskv at 1x128K with PDL on and off, every Triton GPU
# test, pariskv at 1x32K with PDL on and off (sized to the device time left; never started);
# pdl_tests: every Triton GPU test with every kernel launched with PDL (KVPOLICY_PDL_SCOPE=all), then louiskv at
# 1x128K with PDL on and off, in the device time left (never started)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
first)
  step pdl_chain 60 python3 benchmarks/pdl_chain.py
  step blocks_challengers 150 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped \
    --challengers 8 --challenger-variants shipped,blocks+tile,blocks+loop,own+tile
  step score_gap_tests 120 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/triggers/test_score_gap.py -k "challengers or between or one_tile or fused or real_head_dims" ;;
pdl)
  step pdl_chain 60 python3 benchmarks/pdl_chain.py
  step pdl_tests 120 python3 -m pytest -q -rs -x -n 8 -p no:cacheprovider tests/kernels/triton/test_attention.py \
    tests/kernels/triton/test_unit_append.py tests/kernels/triton/test_step.py tests/kernels/triton/test_score_gap_ops.py
  for on in True False; do
    step e2e_pdl_$on 170 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=$on -- -m kvpolicy bench e2e \
      --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 131072 --batches 1 \
      --presets louiskv@gpu --json "$OUT/e2e_pdl_$on.json"
  done ;;
pdl_all)
  step pdl_chain 45 python3 benchmarks/pdl_chain.py
  for on in True False; do
    step e2e_louiskv_pdl_$on 100 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=$on -- -m kvpolicy \
      bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 131072 --batches 1 \
      --presets louiskv@gpu --json "$OUT/e2e_louiskv_pdl_$on.json"
  done
  step triton_tests 120 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton
  for on in True False; do
    step e2e_pariskv_pdl_$on 80 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=$on -- -m kvpolicy \
      bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 32768 --batches 1 \
      --presets pariskv@gpu --json "$OUT/e2e_pariskv_pdl_$on.json"
  done ;;
pdl_tests)
  KVPOLICY_PDL_SCOPE=all step triton_tests 110 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton
  for on in True False; do
    step e2e_louiskv_pdl_$on 90 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=$on -- -m kvpolicy \
      bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 131072 --batches 1 \
      --presets louiskv@gpu --json "$OUT/e2e_louiskv_pdl_$on.json"
  done ;;
*) echo "session32_call.sh: MODE must be first, pdl, pdl_all or pdl_tests, got '$3'" >&2; exit 2 ;;
esac
