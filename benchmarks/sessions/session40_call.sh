#!/usr/bin/env bash
# Session 40's GPU calls. Usage: bash benchmarks/sessions/session40_call.sh OUTDIR TAR MODE
# Issue 12's target table again on one machine, after sessions 35-39's trigger work (the last H200 table is
# session 34's): MODE cell: the floor cell (louiskv at 2,304 tokens, batches 1, 4, 8) and louiskv at 1x32K and 4x32K;
# long: louiskv at 1x128K (GPU pool) and 4x128K (GPU and pinned pools); huge: 1x512K (pinned pool), then pariskv at 1x32K
# with rerank_select's radix and row methods side by side (issue 13's cell);
# profile: one replayed step at 2,304 tokens with the preset's SmolLM2 trigger (reusing), with the trigger's follow
# launch folded into its blocks launch (_LEAVING_IN_BLOCKS, shipped) and without; then at 1x128K reusing with no
# trigger, with the preset's and with it measuring every second step (where its 0.9 ms over the reuse row goes).
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
cell)
  step e2e_cell 240 ${E2E} --contexts 2304 --batches 1,4,8 --presets louiskv@gpu --json "$OUT/e2e_cell.json"
  step e2e_32k 240 ${E2E} --contexts 32768 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_32k.json" ;;
long)
  step e2e_128k1 200 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json"
  step e2e_128k4 330 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu,louiskv@cpu --json "$OUT/e2e_128k4.json" ;;
huge)
  step e2e_512k 300 ${E2E} --contexts 524288 --batches 1 --presets louiskv@cpu --json "$OUT/e2e_512k.json"
  paris_select_pair 120 ;;
profile)
  gap='"name":"score_gap","measure":"mass","margin":1e9,"leaving":"ignored","estimate":"outlier","outliers":4,"group":"each","fixed_query":true'
  for setting in True False; do
    step "profile_leaving_$setting" 120 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.score_gap_outlier._LEAVING_IN_BLOCKS=$setting -- benchmarks/profile_step.py \
      --context 2304 --batch 1 --placement gpu --trigger "{$gap}" --rows 40
  done
  # at 1x128K: reusing without a trigger, with the preset's, and with it measuring at one step in two
  long_profile() { step "profile_128k_$1" 120 python3 benchmarks/profile_step.py --context 131072 --batch 1 \
    --placement gpu --trigger "$2" --rows 40; }
  long_profile reuse '{"name":"interval","n":1099511627776}'
  long_profile score_gap "{$gap}"
  long_profile every2 "{$gap,\"every\":2}" ;;
*) echo "session40_call.sh: MODE must be cell, long, huge or profile, got '$3'" >&2; exit 2 ;;
esac
