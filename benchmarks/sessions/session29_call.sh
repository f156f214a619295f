#!/usr/bin/env bash
# Session 29's GPU calls. Usage: bash benchmarks/sessions/session29_call.sh OUTDIR TAR MODE
# MODE h200: the 4x128K cell an H100 cannot hold, louiskv and pariskv, pool on the GPU then pinned;
# profile: the replayed step's kernels at 1x128K: the floor (full at 2,048 tokens), louiskv's reuse step
# without a trigger and with the preset's outlier trigger (at a margin it never passes); tune: the
# attention's splits and the outlier blocks kernel at fewer keys; paris: pariskv's head_softmax rerank
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
paris)  # pariskv's rerank per query head (head_softmax, the preset's since session 29): its Triton ops' GPU
  # tests, then end to end against the group's mean query (group_mean), one run each
  step rerank_tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "rerank or softmax"
  for r in head_softmax group_mean; do
    step e2e_$r 170 python3 benchmarks/with_settings.py kvpolicy.presets.PARISKV_RERANK=$r -- -m kvpolicy bench e2e \
      --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 32768,131072 --batches 1 \
      --presets pariskv@gpu --json "$OUT/e2e_$r.json"
  done
  step profile_pariskv 60 python3 benchmarks/profile_step.py --placement gpu --batch 1 --rows 30 --preset pariskv \
    --context 131072 --out "$OUT/profile_pariskv.txt" ;;
*) echo "session29_call.sh: MODE must be h200, profile, tune or paris, got '$3'" >&2; exit 2 ;;
esac
