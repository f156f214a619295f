#!/usr/bin/env bash
# Session 31's GPU calls. Usage: bash benchmarks/sessions/session31_call.sh OUTDIR TAR MODE
# MODE first: session 30's fourth challengers version (b9d5399, never run on a GPU): the blocks kernel with 8
# challengers (a measured step, a step between), louiskv end to end at 1x128K (its challengers row beside the
# preset's trigger), then every score-gap GPU test (the default path's _store_parts refactor too), 8 workers;
# second / third: the steps between measured ones in the blocks launch with their keys a tile, beside the other
# settings;
# paris: pariskv's two reranks end to end at 1x32K and 1x128K
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
first)
  step blocks_challengers 90 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped --challengers 8
  step e2e_challengers 170 $E2E --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_challengers.json"
  step score_gap_tests 240 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/triggers/test_score_gap.py ;;
second|third)  # (second ran at 443455c: the steps between did not compile under Triton 3.6, a return inside a called
  # function's if; the keys as one tile a block, slower) third (never ran: no device time left; the shipped
  # settings are own+loop again): the steps between in the blocks launch, keys a tile, beside session 30's
  # fourth version and the two halves; the score-gap GPU tests
  # of what changed; louiskv at 1x128K (pariskv's reranks left out: the device time left)
  step blocks_challengers 150 python3 benchmarks/outlier_blocks.py --context 131072 --batch 1 --only shipped \
    --challengers 8 --challenger-variants shipped,blocks+tile,blocks+loop,own+tile
  step score_gap_tests 80 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/triggers/test_score_gap.py -k "challengers or between or one_tile or fused or real_head_dims"
  step e2e_challengers 170 $E2E --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_challengers.json"
  ;;
paris)
  for r in head_softmax group_mean; do
    step e2e_$r 170 python3 benchmarks/with_settings.py kvpolicy.presets.PARISKV_RERANK=$r -- -m kvpolicy bench e2e \
      --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --contexts 32768,131072 --batches 1 \
      --presets pariskv@gpu --json "$OUT/e2e_$r.json"
  done ;;
*) echo "session31_call.sh: MODE must be first, second, third or paris, got '$3'" >&2; exit 2 ;;
esac
