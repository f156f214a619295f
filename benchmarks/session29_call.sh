#!/usr/bin/env bash
# Session 29's GPU calls. Usage: bash benchmarks/session29_call.sh OUTDIR TAR MODE
# MODE h200: the 4x128K cell an H100 cannot hold, louiskv and pariskv, pool on the GPU then pinned
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case $3 in
h200)
  step e2e_128k4_gpu 330 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu,pariskv@gpu --json "$OUT/e2e_128k4_gpu.json"
  step e2e_128k4_pinned 240 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu,pariskv@cpu --json "$OUT/e2e_128k4_pinned.json" ;;
*) echo "session29_call.sh: MODE must be h200, got '$3'" >&2; exit 2 ;;
esac
