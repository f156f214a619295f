#!/usr/bin/env bash
# Session 13's GPU calls. Usage: bash benchmarks/sessions/session13_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
SCORE_GAP='{"name":"score_gap","margin":1000,"measure":"mass","leaving":"ignored"}'
case ${3:?} in
fused)  # call 1: the fused score_gap step on the GPU (tests, its reusing step's profile against
# session 12's 5,090 kernels), louiskv end to end at 4x128K with the score_gap row
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/kernels/triton/test_step.py tests/kernels/triton/test_unit_append.py
step gpu_tests_select 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_select.py -k "radix or winner or replays or decode_sizes"
step prof_scoregap_reuse 80 $PROF --preset louiskv --placement gpu --trigger "$SCORE_GAP" --out "$OUT/prof_scoregap_reuse.txt"
step e2e_gpu 170 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_gpu.json"
step e2e_32k 120 $E2E --contexts 32768 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_32k.json"
;;
blocks)  # call 2: the gap pass in blocks (call 1's single program a head took 24 us a layer)
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py
step prof_scoregap_reuse 80 $PROF --preset louiskv --placement gpu --trigger "$SCORE_GAP" --out "$OUT/prof_scoregap_reuse.txt"
step e2e_gpu 200 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_gpu.json"
;;
pinned)  # call 3: the pinned pool at 4x128K (issue 12's 2.5x target, last run in session 10)
step e2e_pinned 280 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
profiles)  # call 4: where a pinned re-selection's time goes (every step, overlapping selections) and pariskv at 1x32K
step prof_pinned_every 120 $PROF --preset louiskv --placement cpu --trigger '{"name":"every_step"}' --stickiness 32 --out "$OUT/prof_pinned_every.txt"
step prof_paris_32k 100 python3 benchmarks/profile_step.py --context 32768 --batch 1 --rows 45 --preset pariskv --placement gpu --out "$OUT/prof_paris_32k.txt"
;;
hash)  # call 5: resident_rows by a hash table (the all-pairs locate took 108 us a layer pinned)
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_refresh.py tests/kernels/triton/test_fetch.py tests/test_store_refresh.py tests/kernels/triton/test_score_gap_ops.py
step prof_pinned_every 120 $PROF --preset louiskv --placement cpu --trigger '{"name":"every_step"}' --stickiness 32 --out "$OUT/prof_pinned_every.txt"
step e2e_pinned 250 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
relaxed)  # call 6: the hash insert's atomics relaxed (call 5's insert took 330 us a launch)
step gpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_refresh.py
step prof_pinned_every 120 $PROF --preset louiskv --placement cpu --trigger '{"name":"every_step"}' --stickiness 32 --out "$OUT/prof_pinned_every.txt"
;;
esac
