#!/usr/bin/env bash
# Session 9's GPU calls. Usage: bash benchmarks/sessions/session9_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
baseline)
step gpu_tests 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_placement.py tests/kernels/triton/test_refresh.py tests/test_plan.py
step gather 60 python3 -m kvpolicy bench gather --contexts 131072,1048576 --batches 4 --runs 16 --repeats 20
step e2e_128k4 200 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu,louiskv@cpu --json "$OUT/e2e_128k4.json"
step e2e_512k1 120 $E2E --contexts 524288 --batches 1 --presets louiskv@cpu --json "$OUT/e2e_512k1.json"
step capacity 150 python3 -m kvpolicy bench capacity --steps 18 --compiled-layers --json "$OUT/capacity.json"
;;
second)
step gpu_tests 110 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_refresh.py tests/test_store_refresh.py tests/test_placement.py
step e2e_128k4_cpu 170 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --json "$OUT/e2e_128k4_cpu.json"
step ttft 150 python3 benchmarks/kmeans_ttft.py --parts syncs,ttft --contexts 8192,32768 --nosync off --json "$OUT/ttft.json"
;;
third)
step ttft 170 python3 benchmarks/kmeans_ttft.py --parts ttft --contexts 8192,32768,65536 --ttft-variants spaced/8/split,spaced/3/bf16,pages/2/split --nosync off --json "$OUT/ttft.json"
step paris 240 bash benchmarks/sessions/session9_paris.sh "$OUT/paris"
;;
esac
