#!/usr/bin/env bash
# Session 15's GPU calls. Usage: bash benchmarks/sessions/session15_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
EVERY='{"name":"every_step"}'
case ${3:?} in
first)  # call 1: session 14's lost call: helper-13's pariskv kernels (threshold folded for small calls,
# three radix levels, loads hoisted) and the pinned fetch's glue folded (zone rows, skip, commit tiles)
step gpu_tests_paris 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py tests/selectors/test_collision_rerank.py
step e2e_paris_32k 80 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
step gpu_tests_pinned 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_refresh.py tests/kernels/triton/test_step.py tests/test_store_refresh.py
step e2e_pinned 250 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
profile)  # call 2: the rest of call 1's tests (the pariskv files ran past 100 s at 85%, no failure; the
# store test now decodes on the GPU); where pariskv's 1x32K step and pinned interval(5) spend their time
step gpu_tests_paris 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py tests/selectors/test_collision_rerank.py
step gpu_tests_pinned 60 python3 -m pytest -q -p no:cacheprovider tests/test_store_refresh.py
step prof_paris_32k 90 python3 benchmarks/profile_step.py --context 32768 --batch 1 --rows 45 --preset pariskv --placement gpu --out "$OUT/prof_paris_32k.txt"
step prof_pinned_interval 120 $PROF --preset louiskv --placement cpu --trigger '{"name":"interval","n":5}' --steps 20 --stickiness 32 --out "$OUT/prof_pinned_interval.txt"
;;
sticky)  # call 3: the benchmark's sticky bias in one launch (it put ~12 PyTorch launches into every
# pinned re-selecting layer); the gather bench with the decode's refresh_rows beside gather_rows_into
step gpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/bench/test_overlap.py tests/bench/test_gather_bench.py
step gather 90 python3 -m kvpolicy bench gather --batches 1,4 --runs 16 --repeats 20 --json "$OUT/gather.json"
step e2e_pinned 250 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
fetch)  # call 4: helper-15's fetch_whole (take as a mask, tile 0's loads up front; tile and warp
# variants timed), no admit launch for always-reselecting steps; pariskv 1x32K; louiskv pinned 1x512K
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_fetch.py tests/test_store_refresh.py tests/triggers/test_triggers.py
step fetch_whole 70 python3 benchmarks/fetch_whole.py --contexts 32768,131072 --batches 1,4
step e2e_paris_32k 80 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
step e2e_512k1 190 $E2E --contexts 524288 --batches 1 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_512k1.json"
;;
final)  # call 5: the scoring reads the model's query dtype, number_misses in int32 (on GPU for the first
# time); the gather timed as a graph replay; pariskv's selection per layer; louiskv pinned 4x128K
step gpu_tests 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score.py tests/kernels/triton/test_refresh.py tests/bench/test_overlap.py tests/bench/test_gather_bench.py tests/triggers/test_score_gap.py
step gather 70 python3 -m kvpolicy bench gather --batches 1,4 --runs 16 --repeats 20 --json "$OUT/gather.json"
step pariskv_select 100 python3 benchmarks/pariskv_select.py --quick --no-gather --json "$OUT/pariskv_select.json"
step e2e_pinned 230 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
;;
esac
