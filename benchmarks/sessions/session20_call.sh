#!/usr/bin/env bash
# Session 20's GPU calls (none ran in session 20: no machine was lent; for the next session).
# Usage: bash benchmarks/sessions/session20_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
# a row with the retrieved rows copied into the buffer (fetch_whole moving every row), as before session 20
COPIED="python3 benchmarks/with_settings.py kvpolicy.store.ATTEND_POOL_BY_SLOT=False -- ${E2E#python3 }"
case ${3:?} in
first)  # call 1: what session 19 and 20 changed, on the GPU for the first time, then the rows it moves.
# Tests: helper-24's fused score_gap kernels (s19), the decision launches (every-step: none; interval: one;
# admit reads the decision), the attention's pool rows by slot and the commit-only fetch (s20)
step gpu_tests 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py tests/kernels/triton/test_step.py tests/kernels/triton/test_admit.py tests/kernels/triton/test_attention.py tests/kernels/triton/test_fetch.py tests/test_store_refresh.py tests/test_layer.py
# pariskv and louiskv on a GPU pool at 1x32K, attending the pool by slot (the default now); after the 4x128K
# cell, with the rows copied (as before); each run with its own full-graph and budget-floor rows
step e2e_32k 150 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k.json"
# the 4x128K target cell before the comparisons, so a call cut short by its limit still returns it
step e2e_128k4 200 $E2E --contexts 131072 --batches 4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_128k4.json"
step e2e_32k_copied 150 $COPIED --contexts 32768 --batches 1 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k_copied.json"
# the pool rows loaded the other way (two masked loads, not a pointer a row: attention.POOL_ROWS_BY_POINTER)
step e2e_32k_two_loads 150 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.attention.POOL_ROWS_BY_POINTER=False -- ${E2E#python3 } --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_32k_two_loads.json"
;;
second)  # call 2: the rest of the GPU-pool rows, the pinned interval row at 4x128K (the interval trigger's
# one decision launch), and the 1M-token batch-1 row over the GPU and the host (placement split)
step e2e_512k 150 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k.json"
step rates_128k4 200 python3 benchmarks/pinned_rates.py --context 131072 --batch 4 --stickiness 32,48 --json "$OUT/rates_128k4.json"
step e2e_1m 240 $E2E --contexts 1048576 --batches 1 --presets pariskv@split --json "$OUT/e2e_1m.json"
;;
esac
