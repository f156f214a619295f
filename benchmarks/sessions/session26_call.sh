#!/usr/bin/env bash
# Session 26's GPU calls (written without a device; not run yet): the outlier trigger's int8 keys and
# row stage (session 25, never on a GPU) and its `every` option (session 26), then the H200 cells.
# Usage: bash benchmarks/sessions/session26_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
TRIGGER='"name": "score_gap", "measure": "mass", "margin": 1e9, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"'
PROFILE="python3 benchmarks/profile_step.py --preset louiskv --placement gpu --rows 40 --context 131072 --batch 1"
case ${3:?} in
verify)  # the fused ops against the reference (int8 keys, the row stage, every), the replayed step's kernels, e2e
step gpu_tests 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py
step profile_128k 100 $PROFILE --trigger "{$TRIGGER}" --out "$OUT/profile_128k.txt"
step profile_128k_every2 100 $PROFILE --trigger "{$TRIGGER, \"every\": 2}" --out "$OUT/profile_128k_every2.txt"
step e2e_32k 220 $E2E --contexts 32768 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_32k.json"
step e2e_128k1 160 $E2E --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json"
;;
second)  # on an H200: the 4x128K cell an H100 cannot hold, and 32K beside it
step e2e_128k4 300 $E2E --contexts 131072 --batches 4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_128k4.json"
step e2e_32k 220 $E2E --contexts 32768 --batches 1,4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k.json"
;;
esac
