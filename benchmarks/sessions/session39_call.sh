#!/usr/bin/env bash
# Session 39's GPU calls. Usage: bash benchmarks/sessions/session39_call.sh OUTDIR TAR MODE
# MODE suite: every Triton GPU test and the GPU-touching integration tests (session36_call.sh's suite), first run
# with the trigger deciding in its blocks launch and its fixed placeholder arguments (896c871);
# h200: the rows the targets name on an H200 that sessions 35-38 could not get (louiskv at 4x128K with the
# preset's trigger; pariskv at 1x32K, rerank_select's radix and row methods side by side);
# cell: issue 12's own floor cell (louiskv at 2,304 tokens, batches 1 and 4) against the floor in the same run.
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
suite) bash "$(dirname "$0")/session36_call.sh" "$OUT" "$TAR" suite ;;
h200)
  step e2e_128k4 200 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_128k4.json"
  for method in radix row; do
    step "e2e_paris32k_$method" 100 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.rerank_select.METHOD="'$method'" -- ${E2E#python3 } --contexts 32768 --batches 1 \
      --presets pariskv@gpu --json "$OUT/e2e_paris32k_$method.json"
  done ;;
cell) step e2e_floor_cell 240 ${E2E} --contexts 2304 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_floor_cell.json" ;;
*) echo "session39_call.sh: MODE must be suite, h200 or cell, got '$3'" >&2; exit 2 ;;
esac
