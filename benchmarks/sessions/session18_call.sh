#!/usr/bin/env bash
# Session 18's GPU calls. Usage: bash benchmarks/sessions/session18_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
TTFT="python3 benchmarks/kmeans_ttft.py"
case ${3:?} in
ttft)  # call 1: K-means' update fused into its assignment (+fuse), the units' side stream at high priority
# (@p-1) and segments of 16,384 tokens: tests, per-layer K-means, TTFT 8K-64K, where an 8K prefill's time goes
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_kmeans.py tests/units
step kernel 100 $TTFT --parts kernel --contexts 8192,32768,65536 --variants spaced/8/split,spaced/8/split+fuse,spaced/8/split/16384,spaced/8/split/16384+fuse --json "$OUT/kernel.json"
step ttft 360 $TTFT --parts ttft,profile --contexts 8192,32768,65536 --ttft-variants spaced/8/split,spaced/8/split@p-1,spaced/8/split+fuse,spaced/8/split@p-1+fuse,spaced/8/split/16384,spaced/8/split/16384@p-1+fuse --nosync off --census-length 8192 --json "$OUT/ttft.json"
;;
final)  # call 3: the new defaults (side stream at priority -1, fused update, segments of 16,384): tests, ParisKV's
# prompt encode by (tokens a program, warps), then TTFT 8K-64K side by side with the whole prompt's K-means
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_kmeans.py tests/kernels/triton/test_analytic_encode.py tests/units
step encode 60 python3 benchmarks/encode_tuning.py --contexts 8192,32768 --tokens 1,2,8 --warps 1,2,4
step ttft 330 $TTFT --parts ttft,profile --contexts 8192,32768,65536 --ttft-variants spaced/8/split,spaced/8/split/whole --nosync off --census-length 8192 --json "$OUT/ttft.json"
;;
encode)  # call 4: ParisKV's prompt encode at one warp a program: its tests, then TTFT 8K-64K again
step gpu_tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_encode.py tests/kernels/triton/test_analytic_ops.py
step ttft 300 $TTFT --parts ttft --contexts 8192,32768,65536 --ttft-variants spaced/8/split --repeats 3 --nosync off --json "$OUT/ttft.json"
;;
decode)  # call 5: both encodes at one warp (the decode's must match the prompt's bits): tests, pariskv's decode
# step at 1x32K, and TTFT at 8K with more repeats (its louiskv row sat at 1.089-1.111 in calls 1, 3 and 4)
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_encode.py tests/kernels/triton/test_analytic_ops.py tests/kernels/triton/test_kmeans.py
step e2e_paris_32k 120 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_paris_32k.json"
step ttft 150 $TTFT --parts ttft --contexts 8192 --ttft-variants spaced/8/split --repeats 7 --nosync off --json "$OUT/ttft.json"
;;
fold)  # call 6: ParisKV's collision candidates with a large call's threshold folded into the compaction:
# the analytic ops' GPU tests, the selection per layer with the fold variants (1Mx4, 128Kx4, 512Kx1),
# then pariskv at 1x512K end to end with the fold on
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py
step select 150 python3 benchmarks/pariskv_select.py --quick --no-gather --repeats 10 --contexts 131072,1048576 --batches 4 --json "$OUT/select_4.json"
step select_512k 60 python3 benchmarks/pariskv_select.py --quick --no-gather --repeats 10 --contexts 524288 --batches 1 --json "$OUT/select_512k.json"
step e2e_512k_fold 150 python3 -c "import sys; import kvpolicy.kernels.triton.collision_candidates as c; c.FOLD_LARGE_THRESHOLD = True; from kvpolicy.cli import main; sys.exit(main(sys.argv[1:]))" bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k_fold.json"
;;
last)  # call 7 (not run: the session's device time ran out): the large call's fold and chunks of 4,096 as the defaults: the collision tests at decode sizes
# on the GPU, then pariskv at 1x512K end to end
step gpu_tests 70 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "decode_sizes or collision_candidates"
step e2e_512k 110 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k.json"
;;
esac
