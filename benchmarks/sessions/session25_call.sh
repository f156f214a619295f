#!/usr/bin/env bash
# Session 25's GPU calls: where the outlier score_gap trigger's 135 us a layer goes (session 24, H100),
# before and after its scoring became one tl.dot a key tile; then the cells an 80 GB card could not hold.
# Usage: bash benchmarks/sessions/session25_call.sh OUTDIR TAR MODE   (MODE first: needs the previous tree in _old/)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
TRIGGER='{"name": "score_gap", "measure": "mass", "margin": 1e9, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"}'
PROFILE="python3 benchmarks/profile_step.py --preset louiskv --placement gpu --rows 40"
case ${3:?} in
first)
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py
# the step before (the tree at session 24's end, in _old/) and after, each replayed under the profiler
step profile_old_128k 120 env PYTHONPATH=$PWD/_old $PROFILE --context 131072 --batch 1 --trigger "$TRIGGER" --out "$OUT/profile_old_128k.txt"
step profile_new_128k 120 $PROFILE --context 131072 --batch 1 --trigger "$TRIGGER" --out "$OUT/profile_new_128k.txt"
step profile_reuse_128k 120 $PROFILE --context 131072 --batch 1 --trigger '{"name": "interval", "n": 1099511627776}' --out "$OUT/profile_reuse_128k.txt"
step e2e_128k1 200 $E2E --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json"
;;
# (mode tune, removed: the op's PROGRAMS at a few grid sizes, as at ed9f729 (r2) and 4384738 (r3); PROGRAMS is gone)
verify)  # the shipped op (int8 outlier keys and the row stage since r4): its tests, the profile, the e2e cells
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py
step profile_128k 100 $PROFILE --context 131072 --batch 1 --trigger "$TRIGGER" --out "$OUT/profile_128k.txt"
step e2e_32k 200 $E2E --contexts 32768 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_32k.json"
step e2e_128k1 150 $E2E --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json"
;;
second)  # on an H200: the 4x128K cell an H100 cannot hold, and 32K beside it
step e2e_128k4 280 $E2E --contexts 131072 --batches 4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_128k4.json"
step e2e_32k 200 $E2E --contexts 32768 --batches 1,4 --presets pariskv@gpu,louiskv@gpu --json "$OUT/e2e_32k.json"
;;
esac
