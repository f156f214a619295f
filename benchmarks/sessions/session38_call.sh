#!/usr/bin/env bash
# Session 38's GPU calls. Usage: bash benchmarks/sessions/session38_call.sh OUTDIR TAR MODE
# MODE floor: issue 12's own floor cell, the one its "now" column names (louiskv at a 2,304-token context, the
# context a 2K budget attends, batches 1, 4 and 8, against full-graph and the budget floor in the same run),
# then the GPU test session 37 fixed without rerunning it;
# h200: floor, then the H200 rows the targets name and an H100 cannot hold or did not give (louiskv at 4x128K,
# pariskv at 1x32K with rerank_select's radix and row methods side by side);
# fused (as run at 4c52c09, where the setting was a bool, _DECIDE_IN_BLOCKS, and the cut 64 blocks; it is
# _DECIDE_IN_BLOCKS_UP_TO now: 0 for the decide launch): the trigger's decision in its blocks launch: its GPU tests, the op
# beside the decide launch at 2,304 tokens and 32K, then louiskv end to end with each at 2,304 tokens, batches 1 and
# 4 (1x128K has 128 blocks a row, past the fused decision's 64, so it is unchanged);
# suite: as session36_call.sh's.
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
floor() {
  step e2e_floor_cell 240 ${E2E} --contexts 2304 --batches 1,4,8 --presets louiskv@gpu --json "$OUT/e2e_floor_cell.json"
  step fixed_test 120 python3 -m pytest -q -rs -p no:cacheprovider tests/triggers -k "low_rank_is_checked"
}
fused() {
  step fused_tests 120 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/kernels/triton/test_pdl.py -k "outlier or decide or pdl"
  for context in 2304 32768; do
    step "blocks_$context" 50 python3 benchmarks/outlier_blocks.py --context $context --batch 1 --fixed-query \
      --only shipped,decide-launch
  done
  for setting in 16 0; do
    step "e2e_fused_$setting" 170 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.score_gap_outlier._DECIDE_IN_BLOCKS_UP_TO=$setting -- ${E2E#python3 } --contexts 2304 \
      --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_fused_$setting.json"
  done
}
case ${3:?} in
tiles)  # the blocks kernel at fewer units a block, where the table is small
  for context in 2304 8192 32768; do
    step "tiles_$context" 60 python3 benchmarks/outlier_blocks.py --context $context --batch 1 --fixed-query \
      --only shipped,decide-launch,units16,units32,units16+decide-launch
  done ;;
floor) floor ;;
fused) fused ;;
h200)
  floor
  step e2e_128k4 200 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_128k4.json"
  paris_select_pair 100 ;;
suite) bash "$(dirname "$0")/session36_call.sh" "$OUT" "$TAR" suite ;;
*) echo "session38_call.sh: MODE must be tiles, floor, fused, h200 or suite, got '$3'" >&2; exit 2 ;;
esac
