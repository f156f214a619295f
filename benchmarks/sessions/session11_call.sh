#!/usr/bin/env bash
# Session 11's GPU calls. Usage: bash benchmarks/sessions/session11_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
fill)  # call 1: the fill's variants, then the cells not yet run at the 20% rate
step gpu_tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_select.py
step fill_variants 120 python3 benchmarks/fill_variants.py
step e2e_rate 260 $E2E --contexts 32768,131072 --batches 4,1 --presets louiskv@gpu --json "$OUT/e2e_rate.json"
;;
louis)  # call 2: the winners' rank launch (fill_variants.py then had sort and rank columns) and the float16 means
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score.py tests/kernels/triton/test_unit_append.py tests/kernels/triton/test_select.py -k "radix or winner or score or append or replays"
step fill_variants 90 python3 benchmarks/fill_variants.py
step prof_every_gpu 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"every_step"}' --out "$OUT/prof_every_gpu.txt"
step prof_scoregap_reuse 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"score_gap","margin":1000,"measure":"mass","leaving":"ignored"}' --out "$OUT/prof_scoregap_reuse.txt"
step e2e_gpu 110 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_gpu.json"
;;
louis2)  # call 2 again after fixing unit_append's compile error on triton 3.6 (the fill variants done)
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score.py tests/kernels/triton/test_unit_append.py tests/kernels/triton/test_select.py -k "radix or winner or score or append or replays"
step prof_every_gpu 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"every_step"}' --out "$OUT/prof_every_gpu.txt"
step prof_scoregap_reuse 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"score_gap","margin":1000,"measure":"mass","leaving":"ignored"}' --out "$OUT/prof_scoregap_reuse.txt"
step e2e_gpu 110 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_gpu.json"
step e2e_pinned 150 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
# the pinned slot map (branch pinned-map, reverted on main after its GPU tests failed), from an
# uncommitted export of that branch in pm_check/: which cases fail, and how
[ -d pm_check ] && step pm_check 90 bash -c 'cd pm_check && PYTHONPATH=$PWD python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_fetch_mapped.py 2>&1 | tail -60'
;;
pinned)  # call 3: the pinned pool (4x128K at a real model's overlap, 1x512K)
step pinned_reselect 120 python3 benchmarks/pinned_reselect.py --out "$OUT/pinned_reselect.txt"
step e2e_pinned 200 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_pinned.json"
step e2e_512k1 150 $E2E --contexts 524288 --batches 1 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_512k1.json"
;;
paris)  # call 4: pariskv end to end against full attention
step e2e_paris 240 $E2E --contexts 131072,32768 --batches 4,1 --presets pariskv@gpu --json "$OUT/e2e_paris.json"
;;
esac
