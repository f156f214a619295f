#!/usr/bin/env bash
# Session 12's GPU calls. Usage: bash benchmarks/sessions/session12_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
verify)  # call 1: the float16 unit means and the fill's middle sort block on the GPU; louiskv at 4x128K
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score.py tests/kernels/triton/test_unit_append.py tests/kernels/triton/test_select.py -k "radix or winner or score or append or replays or decode_sizes"
step fill_variants 90 python3 benchmarks/fill_variants.py
step prof_every_gpu 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"every_step"}' --out "$OUT/prof_every_gpu.txt"
step e2e_gpu 130 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_gpu.json"
;;
paris)  # call 2: the GPU tests again (call 1's stopped at the exact-means case, fixed), pariskv end
# to end against full attention, the score_gap preset's reusing step
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_score.py tests/kernels/triton/test_unit_append.py tests/kernels/triton/test_select.py -k "radix or winner or score or append or replays or decode_sizes"
step prof_scoregap_reuse 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"score_gap","margin":1000,"measure":"mass","leaving":"ignored"}' --out "$OUT/prof_scoregap_reuse.txt"
step e2e_paris 300 $E2E --contexts 131072,32768 --batches 4,1 --presets pariskv@gpu --json "$OUT/e2e_paris.json"
;;
pinned)  # call 3: the pinned pool at 1x512K
step e2e_512k1 150 $E2E --contexts 524288 --batches 1 --presets louiskv@cpu --stickiness 32 --json "$OUT/e2e_512k1.json"
;;
esac
