#!/usr/bin/env bash
# Session 36's GPU calls. Usage: bash benchmarks/sessions/session36_call.sh OUTDIR TAR MODE
# MODE suite: every Triton GPU test, then the GPU-touching integration tests, with fixed_query the preset's default
# (session 35 ran only the score-gap, fixed-point and placement files on a GPU);
# h200: the rows an H100 cannot hold (4x128K: full-graph's KV is 74 GiB; 1M tokens) with the new default;
# row: rerank_select's new row method (one program a row after the score pass, for rows of at most 8,192
# candidates) on a GPU: its tests, the selection's methods side by side at 1x32K and 4x32K, then pariskv end to
# end at 1x32K with the radix method (the shipped default) and with the row method;
# blocks: the trigger's blocks kernel (fixed_query, the preset's) under register caps (more programs an SM), at
# 1x128K and 4x128K, then louiskv end to end at 1x128K shipped and with the fastest cap at 1x128K;
# first: row, then blocks; lean: the kernel variants side by side and one end-to-end row of each change
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
row() {
  step row_tests 200 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py \
    -k "rerank_select or head_softmax"
  step row_select 150 python3 benchmarks/pariskv_select.py --quick --contexts 32768 --batches 1,4 --no-gather \
    --json "$OUT/row_select.json"
  for method in radix row; do
    step "e2e_paris32k_$method" 110 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.rerank_select.METHOD="'$method'" -- ${E2E#python3 } --contexts 32768 --batches 1 \
      --presets pariskv@gpu --json "$OUT/e2e_paris32k_$method.json"
  done
}
blocks() {
  step cap_tests 100 python3 -m pytest -q -rs -n 4 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    -k "register_cap or real_head_dims"
  step blocks_128k 120 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --fixed-query \
    --only decode16,shipped,maxnreg96,maxnreg80,maxnreg64 --best-settings "$OUT/best_128k.txt"
  step blocks_128k4 150 python3 benchmarks/outlier_blocks.py --context 131072 --batch 4 --fixed-query --layers 12 \
    --only decode16,shipped,maxnreg96,maxnreg80,maxnreg64
  best=$(cat "$OUT/best_128k.txt" 2>/dev/null)
  step e2e_louis128k_shipped 150 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu \
    --json "$OUT/e2e_louis128k_shipped.json"
  [ -n "$best" ] && step e2e_louis128k_best 150 python3 benchmarks/with_settings.py $best -- ${E2E#python3 } \
    --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_louis128k_best.json"
}
lean() {  # what the device time left allows: each kernel change beside its old form, then end to end
  step blocks_128k 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --fixed-query \
    --only decode16,shipped,maxnreg64 --best-settings "$OUT/best_128k.txt"
  step blocks_128k4 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 4 --fixed-query --layers 8 \
    --only decode16,shipped,maxnreg64
  step row_select 90 python3 benchmarks/pariskv_select.py --quick --contexts 32768 --batches 1 --no-gather \
    --json "$OUT/row_select.json"
  step e2e_louis128k_shipped 130 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu \
    --json "$OUT/e2e_louis128k_shipped.json"
  step e2e_paris32k_row 90 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.rerank_select.METHOD="'row'" \
    -- ${E2E#python3 } --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris32k_row.json"
}
case ${3:?} in
blocks_only)  # the last of the device time: the blocks kernel beside its old form and a register cap
  step blocks_128k 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --fixed-query \
    --only decode16,shipped,maxnreg64 ;;
lean) lean ;;
first) row; blocks ;;
blocks) blocks ;;
suite)
  step triton_tests 270 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton
  step gpu_tests 200 python3 -m pytest -q -rs -n 12 -p no:cacheprovider -m "not model and not gemma3" tests/gpu \
    tests/test_graph.py tests/test_graph_branch.py tests/test_graph_ready.py tests/test_placement.py tests/test_pinned.py \
    tests/triggers tests/test_store_refresh.py tests/test_prefill_streams.py tests/bench ;;
h200)
  step e2e_128k4 200 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_128k4.json"
  step million_louiskv 300 ${E2E} --contexts 1048576 --batches 1 --presets louiskv@split --json "$OUT/million_louiskv.json" ;;
row) row ;;
*) echo "session36_call.sh: MODE must be blocks_only, lean, first, row, blocks, suite or h200, got '$3'" >&2; exit 2 ;;
esac
