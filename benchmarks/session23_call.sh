#!/usr/bin/env bash
# Session 23's GPU calls: session 20's steps (benchmarks/session20_call.sh; none has run on a GPU yet) in
# order of importance, so a call cut short by its limit, or a session that gets only one call, returns
# the GPU tests and the target cells first.
# Usage: bash benchmarks/session23_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
COPIED="python3 benchmarks/with_settings.py kvpolicy.store.ATTEND_POOL_BY_SLOT=False -- ${E2E#python3 }"
case ${3:?} in
first)  # the GPU tests of sessions 19-21's kernels, then the issue-12/13 target cells: 1x32K, 4x128K, 1x512K
step gpu_tests 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py tests/kernels/triton/test_step.py tests/kernels/triton/test_admit.py tests/kernels/triton/test_attention.py tests/kernels/triton/test_fetch.py tests/test_store_refresh.py tests/test_layer.py
step e2e_32k 150 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k.json"
step e2e_128k4 200 $E2E --contexts 131072 --batches 4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_128k4.json"
step e2e_512k 150 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k.json"
;;
second)  # 1M tokens over GPU and host, the pinned interval row at 4x128K, and the rows copied as before session 20
step e2e_1m 240 $E2E --contexts 1048576 --batches 1 --presets pariskv@split --json "$OUT/e2e_1m.json"
step rates_128k4 200 python3 benchmarks/pinned_rates.py --context 131072 --batch 4 --stickiness 32,48 --json "$OUT/rates_128k4.json"
step e2e_32k_copied 150 $COPIED --contexts 32768 --batches 1 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k_copied.json"
;;
esac
