#!/usr/bin/env bash
# Session 28's GPU calls: the outlier trigger's kernel settings side by side (benchmarks/outlier_blocks.py),
# then the step end to end. Usage: bash benchmarks/sessions/session28_call.sh OUTDIR TAR MODE [SETTINGS...]
# MODE kernels: tests and the settings' times; e2e: end to end with SETTINGS (MODULE.NAME=VALUE for
# with_settings.py); all: tests, the settings' times at 1x128K, end to end with the fastest of them;
# parts: the blocks kernel's parts against the reference at head dim 128, settings, end to end
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
MODE=${3:?}; shift 3
tests() {  # the score-gap ops against the reference, the new settings too
  step gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/triggers/test_score_gap.py
}
e2e() {  # louiskv end to end at 1x128K, 1x32K and 4x32K (4x128K needs an H200), with the settings given
  for cell in "131072 1" "32768 1,4"; do
    set -- $cell "$@"; local context=$1 batches=$2; shift 2
    step e2e_$context 300 python3 benchmarks/with_settings.py "$@" -- -m kvpolicy bench e2e --full-kinds full-graph \
      --budget 2048 --steps 18 --compiled-layers --contexts $context --batches $batches --presets louiskv@gpu \
      --json "$OUT/e2e_$context.json"
  done
}
case $MODE in
kernels) tests
  step blocks_128k 240 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1
  step blocks_4x32k 240 python3 benchmarks/outlier_blocks.py --context 32768 --batch 4 ;;
e2e) e2e "$@" ;;
parts)  # the blocks kernel's parts against the reference at head dim 128, the settings around the fastest
  # (each checked against the reference, and run twice), then end to end with the fastest that agrees
  step parts_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py -k real_head_dims
  step blocks_128k 200 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --best-settings "$OUT/best.txt" \
    --only shipped,base,stages2,bf16+tile8192,bf16+tile8192+rows1x256,bf16+tile8192+w8,bf16+tile16384,bf16+tile16384+w8
  e2e $(cat "$OUT/best.txt") ;;
fix)  # after the marks' clear moved last: the parts at real head dims, the ops tests, the settings again
  step parts_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py -k real_head_dims
  step ops_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py -k "not real_head_dims"
  step blocks_128k 120 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped,base,bf16+tile8192+rows1x256 ;;
*) echo "session28_call.sh: MODE must be kernels, e2e, parts, fix or all, got '$MODE'" >&2; exit 2 ;;
esac
