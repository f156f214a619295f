#!/usr/bin/env bash
# Session 30's GPU calls. Usage: bash benchmarks/sessions/session30_call.sh OUTDIR TAR MODE
# MODE tests: the attention's GPU tests at a tile a split (MIN_TILES_PER_SPLIT=1) and the analytic ops'
# (query_votes' logit queries, head_softmax's two-launch rewrite), then head_softmax_rerank.py;
# e2e: pariskv with either rerank, louiskv at batch 4 at a tile a split;
# challengers: the score-gap trigger's challengers on the triton backend: its GPU tests, then louiskv end to
# end at 1x32K and 1x128K (row score_gap_every4_challengers8_reuse), and the replayed step's kernels at 1x128K
# with every=4, 8 challengers (and the preset's outlier trigger, given a 4th argument with-outlier-profile);
# the blocks kernel with 8 challengers, a measured step and a step between (outlier_blocks.py); paris: pariskv's reranks end to end
E2E_ARGS="-m kvpolicy bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers"
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case $3 in
tests)
  step attention_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_attention.py
  step analytic_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py
  step head_softmax_bench 150 python3 benchmarks/head_softmax_rerank.py --contexts 32768,131072 --batches 1,4 \
    --json "$OUT/head_softmax.json" ;;
e2e)
  for r in head_softmax group_mean; do
    step e2e_$r 170 python3 benchmarks/with_settings.py kvpolicy.presets.PARISKV_RERANK=$r -- $E2E_ARGS \
      --contexts 32768,131072 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_$r.json"
  done
  step e2e_louiskv_b4 200 $E2E --contexts 32768 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_louiskv_b4.json" ;;
challengers)
  step challenger_tests 200 python3 -m pytest -q -rs tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py \
    -k "outlier or challengers or fused"
  step blocks_challengers 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --challengers 8
  step e2e_challengers 240 $E2E --contexts 32768,131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_challengers.json"
  OUTLIER='"name": "score_gap", "measure": "mass", "margin": 1e9, "leaving": "ignored", "estimate": "outlier", "outliers": 4, "group": "each"'
  P="python3 benchmarks/profile_step.py --placement gpu --batch 1 --rows 40 --preset louiskv --context 131072"
  [ "${4:-}" = with-outlier-profile ] && step profile_outlier 90 $P --trigger "{$OUTLIER}" --out "$OUT/profile_outlier.txt"
  step profile_challengers 90 $P --trigger "{$OUTLIER, \"every\": 4, \"challengers\": 8}" --out "$OUT/profile_challengers.txt" ;;
challengers2)  # the third version (a launch of its own for the steps between; the next challengers from the C
  # blocks of largest best candidate): its tests with challengers on the GPU, the blocks kernel, louiskv at 1x128K
  step blocks_challengers 100 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --challengers 8
  step e2e_challengers 170 $E2E --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_challengers.json"
  step challenger_tests 120 python3 -m pytest -q -rs tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py \
    -k "challengers" ;;
paris)
  for r in head_softmax group_mean; do
    step e2e_$r 170 python3 benchmarks/with_settings.py kvpolicy.presets.PARISKV_RERANK=$r -- $E2E_ARGS \
      --contexts 32768,131072 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_$r.json"
  done ;;
*) echo "session30_call.sh: MODE must be tests, e2e, challengers, challengers2 or paris, got '$3'" >&2; exit 2 ;;
esac
