#!/usr/bin/env bash
# Session 14's GPU calls. Usage: bash benchmarks/sessions/session14_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
EVERY='{"name":"every_step"}'
case ${3:?} in
map)  # call 1: resident_rows through the slot map (the all-pairs compare took 108 us a layer pinned);
# session 13's untested-on-GPU code (the fused score_gap layer test, number_misses) with it
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_refresh.py tests/kernels/triton/test_fetch.py tests/test_store_refresh.py tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py
step resident_rows 40 python3 benchmarks/resident_rows.py --batches 1,4
step prof_pinned_every 110 $PROF --preset louiskv --placement cpu --trigger "$EVERY" --stickiness 32 --out "$OUT/prof_pinned_every.txt"
step e2e_pinned 280 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
pair)  # call 2: keys and values refreshed in one launch; a unit cache of 16K rows against the default
# (2 x the retrieved rows), now that the lookup is linear in the cache's rows
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_refresh.py tests/test_store_refresh.py tests/kernels/triton/test_fetch.py
step e2e_pinned 270 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
step e2e_pinned_c16k 230 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --unit-cache-rows 16384 --json "$OUT/e2e_pinned_c16k.json"
;;
paris)  # call 3: helper-12's pariskv kernels (encode by two small rotations, smaller chunks for small
# calls, two launches fewer a layer) at 1x32K; louiskv pinned at 1x512K with the slot map
step gpu_tests 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py tests/selectors/test_collision_rerank.py tests/triggers/test_triggers.py
step prof_paris_32k 90 python3 benchmarks/profile_step.py --context 32768 --batch 1 --rows 45 --preset pariskv --placement gpu --out "$OUT/prof_paris_32k.txt"
step e2e_32k 130 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k.json"
step e2e_512k1 200 $E2E --contexts 524288 --batches 1 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_512k1.json"
;;
final)  # call 4: the pinned fetch's glue folded (zone rows, skip, commit tiles, misses in one block) and
# helper-13's pariskv kernels (threshold folded for small calls, three radix levels, loads hoisted)
step gpu_tests_paris 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py tests/selectors/test_collision_rerank.py
step e2e_paris_32k 70 python3 -m kvpolicy bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
step gpu_tests_pinned 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_refresh.py tests/kernels/triton/test_step.py tests/test_store_refresh.py
step e2e_pinned 240 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
esac
