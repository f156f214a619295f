#!/usr/bin/env bash
# Session 17's GPU calls. Usage: bash benchmarks/sessions/session17_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
TTFT="python3 benchmarks/kmeans_ttft.py"
case ${3:?} in
ttft)  # call 1: K-means by segment (linear in the prompt) against the whole-prompt default: per layer, then
# TTFT from 8K to 64K, then where an 8K prefill's time goes (full against louiskv's rows) by kernel
step kernel 120 $TTFT --parts kernel --contexts 8192,32768,65536 --variants spaced/8/split,spaced/8/split/8192,spaced/8/split/4096,spaced/3/bf16,spaced/3/bf16/8192 --json "$OUT/kernel.json"
step ttft 330 $TTFT --parts ttft,profile --contexts 8192,32768,65536 --ttft-variants spaced/8/split,spaced/8/split/8192,spaced/8/split/4096 --nosync off --no-pariskv --census-length 8192 --json "$OUT/ttft.json"
;;
stats)  # call 2: the prompt's unit statistics in one Triton pass (unit_stats) on the GPU: tests, then TTFT
# again with it (and pariskv's rows), and where an 8K prefill's time goes now
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_unit_stats.py tests/kernels/triton/test_kmeans.py tests/units
step ttft 360 $TTFT --parts ttft,profile --contexts 8192,32768,65536 --ttft-variants spaced/8/split,spaced/8/split/8192 --nosync off --census-length 8192 --json "$OUT/ttft.json"
;;
final)  # call 3: with pariskv's prompt encoded in one launch a layer (analytic_encode) and the pool laid out by
# row gathers: GPU tests, TTFT side by side for every row, the 8K profile, and pariskv's decode step unchanged
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_unit_stats.py tests/kernels/triton/test_analytic_ops.py tests/kernels/triton/test_analytic_encode.py tests/kernels/triton/test_fetch.py tests/units
step ttft 330 $TTFT --parts ttft,profile --contexts 8192,32768,65536 --ttft-variants spaced/8/split,spaced/8/split/8192,spaced/3/bf16 --nosync off --census-length 8192 --json "$OUT/ttft.json"
step e2e_paris_32k 100 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
;;
esac
