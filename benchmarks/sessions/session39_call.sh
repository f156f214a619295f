#!/usr/bin/env bash
# Session 39's GPU calls. Usage: bash benchmarks/sessions/session39_call.sh OUTDIR TAR MODE
# MODE suite: every Triton GPU test and the GPU-touching integration tests (session36_call.sh's suite), first run
# with the trigger deciding in its blocks launch and its fixed placeholder arguments (896c871);
# leaving: the trigger's follow launch folded into its blocks launch and decision (_LEAVING_IN_BLOCKS) against the
# follow launch: the op at 2,304 tokens and 1x128K, then louiskv end to end at 2,304 tokens, batches 1 and 4;
# first: the trigger's GPU tests, then leaving; again: leaving's end-to-end pair in the other order; long: louiskv
# at 1x128K as shipped (the floor target's other cell);
# wide: issue 12's own floor cell at batch 8 (call b8; the H200 rows are session38_call.sh's h200 mode).
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
suite) bash "$(dirname "$0")/session36_call.sh" "$OUT" "$TAR" suite ;;
first)  # the trigger's GPU tests, then leaving's rows (one call)
  step trigger_tests 150 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/kernels/triton/test_pdl.py tests/triggers tests/integration/test_score_gap_dense.py
  bash "$0" "$OUT" "$TAR" leaving ;;
leaving)  # the follow launch's work in the blocks launch and the decision (_LEAVING_IN_BLOCKS), against the launch
  for context in 2304 131072; do
    step "blocks_$context" 60 python3 benchmarks/outlier_blocks.py --context $context --batch 1 --fixed-query \
      --only shipped,follow-launch
  done
  for setting in True False; do
    step "e2e_leaving_$setting" 170 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.score_gap_outlier._LEAVING_IN_BLOCKS=$setting -- ${E2E#python3 } --contexts 2304 \
      --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_leaving_$setting.json"
  done ;;
again)  # leaving's end-to-end pair again, in the other order (the follow launch first)
  for setting in False True; do
    step "e2e_again_$setting" 170 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.score_gap_outlier._LEAVING_IN_BLOCKS=$setting -- ${E2E#python3 } --contexts 2304 \
      --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_again_$setting.json"
  done ;;
long) step e2e_128k 200 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k.json" ;;
wide) step e2e_cell_b8 150 ${E2E} --contexts 2304 --batches 8 --presets louiskv@gpu --json "$OUT/e2e_cell_b8.json" ;;
*) echo "session39_call.sh: MODE must be suite, first, leaving, again, long or wide, got '$3'" >&2; exit 2 ;;
esac
