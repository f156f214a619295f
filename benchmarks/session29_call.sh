#!/usr/bin/env bash
# Session 29's GPU calls. Usage: bash benchmarks/session29_call.sh OUTDIR TAR MODE
# MODE h200: the 4x128K cell an H100 cannot hold, louiskv and pariskv, pool on the GPU then pinned;
# profile: the replayed step's kernels at 1x128K: the floor (full at 2,048 tokens), louiskv's reuse step
# without a trigger and with the preset's outlier trigger (at a margin it never passes)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case $3 in
h200)
  step e2e_128k4_gpu 330 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu,pariskv@gpu --json "$OUT/e2e_128k4_gpu.json"
  step e2e_128k4_pinned 240 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu,pariskv@cpu --json "$OUT/e2e_128k4_pinned.json" ;;
profile)
  OUTLIER='{"name": "score_gap", "measure": "mass", "margin": 1e9, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"}'
  P="python3 benchmarks/profile_step.py --placement gpu --batch 1 --rows 40"
  step profile_floor 90 $P --preset full --context 2048 --out "$OUT/profile_floor.txt"
  step profile_reuse 90 $P --preset louiskv --context 131072 --trigger '{"name": "interval", "n": 1000000}' --out "$OUT/profile_reuse.txt"
  step profile_outlier 90 $P --preset louiskv --context 131072 --trigger "$OUTLIER" --out "$OUT/profile_outlier.txt" ;;
tune)  # the attention's splits of a short part (MIN_TILES_PER_SPLIT), the outlier blocks kernel at fewer outliers
  A=kvpolicy.kernels.triton.attention.MIN_TILES_PER_SPLIT
  P="benchmarks/profile_step.py --placement gpu --batch 1 --rows 12"
  for t in 1 2; do
    step profile_floor_t$t 60 python3 benchmarks/with_settings.py $A=$t -- $P --preset full --context 2048 --out "$OUT/profile_floor_t$t.txt"
    step profile_reuse_t$t 60 python3 benchmarks/with_settings.py $A=$t -- $P --preset louiskv --context 131072 \
      --trigger '{"name": "interval", "n": 1000000}' --out "$OUT/profile_reuse_t$t.txt"
  done
  for m in 1 2; do step blocks_m$m 60 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --outliers $m; done
  for t in 4 1; do
    step e2e_t$t 150 python3 benchmarks/with_settings.py $A=$t -- -m kvpolicy bench e2e --full-kinds full-graph --budget 2048 \
      --steps 18 --compiled-layers --contexts 32768,131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_t$t.json"
  done ;;
*) echo "session29_call.sh: MODE must be h200, profile or tune, got '$3'" >&2; exit 2 ;;
esac
