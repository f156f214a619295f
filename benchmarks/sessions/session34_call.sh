#!/usr/bin/env bash
# Session 34's GPU calls. Usage: bash benchmarks/sessions/session34_call.sh OUTDIR TAR MODE
# MODE tests: every Triton GPU test at the shipped defaults (the PDL constexpr became a mode in session 33 and had
# not run on a GPU), then the outlier trigger's blocks kernel with its keys' loads issued together (_KEYS_AHEAD);
# e2e: louiskv at 1x128K end to end, shipped against the fastest blocks variant and against session 33's
# LARGE_GRIDS="no-early-next" (full-graph in each run);
# h200: the cells an H100 cannot hold (4x128K: full-graph's KV is 74 GiB), on an H200, with the H200 rows of the
# targets not timed there since sessions 19 and 30: louiskv's pinned 4x128K row at a real model's miss, both presets
# at 4x128K, then at 1x32K and 1x128K; million: issue 13's 1M-token batch-1 row (never run: a pinned pool alone
# needs 144 GiB, the host has about 111), pools over the H200 and pinned host memory (placement split), full
# attention's row a "does not fit"; louiskv_million: louiskv's row of it again after a fix; fixed: the trigger's
# query in fixed point
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
tests)
  step triton_tests 270 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton
  step blocks 120 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 \
    --only shipped,ahead2,ahead4,ahead4+tile4096 --best-settings "$OUT/best_blocks.txt" ;;
e2e)  # louiskv at 1x128K: the shipped settings, the fastest blocks variant of "tests" (its file, carried back in
  # as benchmarks/sessions/best_blocks.txt), and session 33's LARGE_GRIDS="no-early-next"
  best=$(cat benchmarks/sessions/best_blocks.txt 2>/dev/null)
  for name in shipped best large_grids; do
    case $name in
      shipped) settings="kvpolicy.kernels.triton.pdl.LARGE_GRIDS='plain'" ;;
      best) [ -n "$best" ] || continue; settings=$best ;;
      large_grids) settings="kvpolicy.kernels.triton.pdl.LARGE_GRIDS='no-early-next'" ;;
    esac
    step "e2e_$name" 100 python3 benchmarks/with_settings.py $settings -- ${E2E#python3 } \
      --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_$name.json"
  done ;;
h200)
  step rates_128k4 170 python3 benchmarks/pinned_rates.py --context 131072 --batch 4 --stickiness 32,40,48 \
    --json "$OUT/rates_128k4.json"
  step e2e_128k4 170 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu,pariskv@gpu --json "$OUT/e2e_128k4.json"
  step e2e_batch1 200 ${E2E} --contexts 32768,131072 --batches 1 --presets louiskv@gpu,pariskv@gpu \
    --json "$OUT/e2e_batch1.json" ;;
million)
  step million_pariskv 420 ${E2E} --contexts 1048576 --batches 1 --presets pariskv@split --json "$OUT/million_pariskv.json"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/smi_after.txt" 2>&1; free -g >> "$OUT/smi_after.txt"
  step million_louiskv 150 ${E2E} --contexts 1048576 --batches 1 --presets louiskv@split --json "$OUT/million_louiskv.json" ;;
louiskv_million)  # after the outlier keys' fix (taken on the GPU from a pinned pool): its GPU test, then louiskv's
  # 1M row again (m1's score-gap rows failed at prefill; its interval row ran out of GPU memory)
  step placement_tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_placement.py -k gpu
  step million_louiskv 330 ${E2E} --contexts 1048576 --batches 1 --presets louiskv@split --json "$OUT/million_louiskv.json" ;;
fixed)  # ScoreGap.fixed_query (int8 products with the query in fixed point): its GPU tests, the blocks kernel both
  # ways, end to end at 1x128K and 4x128K (the score_gap_fixed_reuse row beside score_gap_reuse), then louiskv_million
  step fixed_tests 150 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/kernels/test_fixed_point.py -k "outlier or fixed"
  step blocks_exact 60 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped
  step blocks_fixed 60 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --fixed-query
  step e2e_fixed 200 ${E2E} --contexts 131072 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_fixed.json" ;;
fixed_lean)  # "fixed" in the device time left: the fixed-point tests, then the blocks kernel both ways
  step fixed_tests 80 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/kernels/test_fixed_point.py -k "True or fixed"
  step blocks_exact 45 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --repeats 20
  step blocks_fixed 45 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --repeats 20 \
    --fixed-query ;;
*) echo "session34_call.sh: MODE must be tests, e2e, h200, million, louiskv_million, fixed or fixed_lean, got '$3'" >&2
  exit 2 ;;
esac
