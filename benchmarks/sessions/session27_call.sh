#!/usr/bin/env bash
# Session 27's GPU calls: session 26's (written without a device) plus the held candidate count's
# kernel test and the outlier blocks kernel's timing. Usage: bash benchmarks/sessions/session27_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
TRIGGER='"name": "score_gap", "measure": "mass", "margin": 1e9, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"'
PROFILE="python3 benchmarks/profile_step.py --preset louiskv --placement gpu --rows 40 --context 131072 --batch 1"
case ${3:?} in
verify)  # the fused ops against the reference (int8 keys, the row stage, every, the held count), kernels, e2e
step gpu_tests 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
  tests/triggers/test_score_gap.py tests/kernels/triton/test_analytic_ops.py -k "score_gap or collision_candidates"
step profile_128k 90 $PROFILE --trigger "{$TRIGGER}" --out "$OUT/profile_128k.txt"
step profile_128k_every2 90 $PROFILE --trigger "{$TRIGGER, \"every\": 2}" --out "$OUT/profile_128k_every2.txt"
step e2e_32k 200 $E2E --contexts 32768 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_32k.json"
;;
second)  # on an H200: the 4x128K cell an H100 cannot hold, and 1x128K beside it
step e2e_128k 400 $E2E --contexts 131072 --batches 1,4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_128k.json"
step e2e_32k_paris 150 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_32k_paris.json"
;;
blocks)  # the outlier blocks kernel with position-only load masks: its tests, its kernel time by warps, e2e
step gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py
step profile_128k 90 $PROFILE --trigger "{$TRIGGER}" --out "$OUT/profile_128k.txt"
for w in 2 8; do
step profile_128k_w$w 90 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.score_gap_outlier._BLOCKS_WARPS=$w \
  -- benchmarks/profile_step.py --preset louiskv --placement gpu --rows 8 --context 131072 --batch 1 --trigger "{$TRIGGER}"
done
step e2e 240 $E2E --contexts 32768,131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e.json"
;;
*) echo "session27_call.sh: MODE must be verify, second or blocks, got '$3'" >&2; exit 2 ;;
esac
