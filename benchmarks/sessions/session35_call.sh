#!/usr/bin/env bash
# Session 35's GPU calls. Usage: bash benchmarks/sessions/session35_call.sh OUTDIR TAR MODE
# MODE fixed: ScoreGap.fixed_query's first GPU run (its ops' tests, with the whole score-gap ops file since
# session 34 reshaped the default blocks kernel too, and the pinned/split outlier keys' GPU test), the blocks
# kernel both ways and with its keys packed (_KEY_LOOP: removed after this call, its code is in c1db8c5), louiskv end to end at 1x128K with the
# score_gap_fixed_reuse row beside score_gap_reuse; more: the between-settings tests again, pariskv's 1x32K step
# profiled, louiskv at 1x128K with fixed_query as the preset's default;
# h200: the between-settings tests, then what needs an H200 (4x128K's full-graph KV is 74 GiB; 1M tokens): the 4x128K rows with the fixed row,
# then louiskv's 1M row after session 34's outlier-keys fix
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
fixed)
  step fixed_tests 200 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/kernels/test_fixed_point.py tests/test_placement.py
  step blocks_exact 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped,packed
  step blocks_fixed 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped,packed \
    --fixed-query
  step e2e_fixed 150 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_fixed.json" ;;
more)  # the 4 tests "fixed" called with a stale signature (a test defect, fixed); pariskv's 1x32K step (0.15 ms
  # short of 1.0x on the H200): where it goes today (session 19's profile is old)
  step between_tests 90 python3 -m pytest -q -rs -n 4 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    -k between_settings
  step prof_paris32k 80 python3 benchmarks/profile_step.py --preset pariskv --context 32768 --batch 1 --placement gpu \
    --rows 40 --out "$OUT/prof_paris32k.txt"
  # the preset's trigger with its query in fixed point (the default since this session) against exact products
  step e2e_default 150 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_default.json" ;;
h200)
  step between_tests 70 python3 -m pytest -q -rs -n 4 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    -k between_settings
  step e2e_128k4 200 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_128k4.json"
  step million_louiskv 300 ${E2E} --contexts 1048576 --batches 1 --presets louiskv@split --json "$OUT/million_louiskv.json" ;;
h200_lean)  # the 4x128K rows alone, in the device time left
  step e2e_128k4 200 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_128k4.json" ;;
*) echo "session35_call.sh: MODE must be fixed, more, h200 or h200_lean, got '$3'" >&2; exit 2 ;;
esac
