#!/usr/bin/env bash
# Session 30's GPU calls. Usage: bash benchmarks/session30_call.sh OUTDIR TAR MODE
# MODE tests: the attention's GPU tests at a tile a split (MIN_TILES_PER_SPLIT=1) and the analytic ops'
# (query_votes' logit queries, head_softmax's two-launch rewrite), then head_softmax_rerank.py;
# e2e: pariskv with either rerank, louiskv at batch 4 at a tile a split
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case $3 in
tests)
  step attention_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_attention.py
  step analytic_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py
  step head_softmax_bench 150 python3 benchmarks/head_softmax_rerank.py --contexts 32768,131072 --batches 1,4 \
    --json "$OUT/head_softmax.json" ;;
e2e)
  for r in head_softmax group_mean; do
    step e2e_$r 170 python3 benchmarks/with_settings.py kvpolicy.presets.PARISKV_RERANK=$r -- $E2E \
      --contexts 32768,131072 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_$r.json"
  done
  step e2e_louiskv_b4 200 $E2E --contexts 32768 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_louiskv_b4.json" ;;
*) echo "session30_call.sh: MODE must be tests or e2e, got '$3'" >&2; exit 2 ;;
esac
