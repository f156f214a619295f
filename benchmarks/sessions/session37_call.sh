#!/usr/bin/env bash
# Session 37's GPU calls. Usage: bash benchmarks/sessions/session37_call.sh OUTDIR TAR MODE
# MODE measure: session 36's two unmeasured changes, each beside its old form in one process: the trigger's
# blocks kernel (decode means in tiles of 16 dims against the old whole tile, and a register cap) at 1x128K, the
# rerank_select row method against radix at 1x32K, then pariskv end to end at 1x32K with each method, then
# louiskv end to end at 1x128K (about 450 s);
# tests: the GPU tests of both changes, then the whole Triton GPU suite as far as the call's time allows;
# suite, h200: as session36_call.sh's.
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
measure)
  step blocks_128k 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --fixed-query \
    --only decode16,shipped,maxnreg80,maxnreg64 --best-settings "$OUT/best_128k.txt"
  step row_select 90 python3 benchmarks/pariskv_select.py --quick --contexts 32768 --batches 1 --no-gather \
    --json "$OUT/row_select.json"
  for method in radix row; do
    step "e2e_paris32k_$method" 100 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.rerank_select.METHOD="'$method'" -- ${E2E#python3 } --contexts 32768 --batches 1 \
      --presets pariskv@gpu --json "$OUT/e2e_paris32k_$method.json"
  done
  step e2e_louis128k 130 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu \
    --json "$OUT/e2e_louis128k.json" ;;
tests)
  step changed_tests 200 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/kernels/triton/test_analytic_ops.py -k "register_cap or real_head_dims or rerank_select or head_softmax or outlier"
  step triton_tests 300 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton ;;
suite|h200) bash "$(dirname "$0")/session36_call.sh" "$OUT" "$TAR" "$3" ;;
*) echo "session37_call.sh: MODE must be measure, tests, suite or h200, got '$3'" >&2; exit 2 ;;
esac
