#!/usr/bin/env bash
# Session 16's GPU calls. Usage: bash benchmarks/sessions/session16_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
rates)  # call 1: louiskv's pinned interval row at the miss fraction a real model shows (the stickiness
# grid), at 4x128K and 1x512K; pariskv at 1x512K (GPU pool: its KV, 75 GB, fits), never run before
step rates_128k4 260 python3 benchmarks/pinned_rates.py --context 131072 --batch 4 --stickiness 32,48,64 --json "$OUT/rates_128k4.json"
step paris_512k1 130 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/paris_512k1.json"
step rates_512k1 190 python3 benchmarks/pinned_rates.py --context 524288 --batch 1 --stickiness 64,128 --json "$OUT/rates_512k1.json"
;;
paris)  # call 2: helper-18's pariskv launches at batch 1 (the rerank's row method, self-clearing scratch, no
# counters launch) on the GPU for the first time: tests, old against new per layer, 1x32K end to end
step gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py tests/selectors/test_collision_rerank.py tests/benchmarks/test_pariskv_select.py tests/test_graph.py
step select 120 python3 benchmarks/pariskv_select.py --quick --contexts 32768,131072 --batches 1,4 --no-gather --json "$OUT/pariskv_select.json"
step e2e_paris_32k 90 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
step prof_paris_32k 70 python3 benchmarks/profile_step.py --context 32768 --batch 1 --rows 45 --preset pariskv --placement gpu --out "$OUT/prof_paris_32k.txt"
;;
radix)  # call 3: the row method measured slower (call 2): auto back to the radix method; what the
# self-clearing scratch and the counters folded into encode give at 1x32K on their own
step e2e_paris_32k 90 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
step gpu_tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "decode_sizes or method"
;;
headmax)  # call 4: pariskv's per-head votes (helper-20's kernels) on the GPU for the first time: tests,
# then group_mean against head_max per layer at 1x32K and 4x128K
step gpu_tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "head_max_votes_at_decode_sizes or per_head"
step hm_1x32k 90 python3 benchmarks/pariskv_select.py --contexts 32768 --batches 1 --votes group_mean,head_max --quick --no-gather --json "$OUT/hm_1x32k.json"
step hm_4x128k 110 python3 benchmarks/pariskv_select.py --contexts 131072 --batches 4 --votes group_mean,head_max --quick --no-gather --json "$OUT/hm_4x128k.json"
;;
esac
