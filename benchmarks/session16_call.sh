#!/usr/bin/env bash
# Session 16's GPU calls. Usage: bash benchmarks/session16_call.sh OUTDIR TAR MODE
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
rates)  # call 1: louiskv's pinned interval row at the miss fraction a real model shows (the stickiness
# grid), at 4x128K and 1x512K; pariskv at 1x512K (GPU pool: its KV, 75 GB, fits), never run before
step rates_128k4 260 python3 benchmarks/pinned_rates.py --context 131072 --batch 4 --stickiness 32,48,64 --json "$OUT/rates_128k4.json"
step paris_512k1 130 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/paris_512k1.json"
step rates_512k1 190 python3 benchmarks/pinned_rates.py --context 524288 --batch 1 --stickiness 64,128 --json "$OUT/rates_512k1.json"
;;
esac
