#!/usr/bin/env bash
# Session 42's GPU calls. Usage: bash benchmarks/sessions/session42_call.sh OUTDIR TAR MODE
# Call s1 ran this script's mode "slot" as at commit 9e0d1a3 (`git show 9e0d1a3:benchmarks/sessions/session42_call.sh`):
# the attention kernel alone over rows copied in, by slot and by row (benchmarks/attention_by_slot.py, then with two
# load-order settings since removed: SLOTS_AHEAD_OF_VALID timed the same, KV_AHEAD_OF_VALID slower), and louiskv end
# to end at 2,304 tokens, batch 8, with its rows copied (store.ATTEND_POOL_BY_SLOT=False) and by slot.
# MODE verify: the choice shipped after it (docs/bench/session42); MODE every: the by-slot stage count, end to end.
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
verify)
  # the shipped choice (a policy that keeps its selection copies its rows; every-step policies attend by slot at
  # 2 stages): the floor cell at batches 1 and 4 (s1 measured 8), then 1x128K
  step e2e_cell 200 ${E2E} --contexts 2304 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_cell.json"
  step e2e_128k1 200 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json" ;;
every)
  # an every-step policy's rows read by slot at 2 pipeline stages (shipped) and at 3 (before session 42), end to end
  for stages in 2 3; do
    step "e2e_every_$stages" 200 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.attention.NUM_STAGES_BY_SLOT=$stages -- ${E2E#python3 } --contexts 2304 --batches 1,8 \
      --presets clusterkv@gpu --json "$OUT/e2e_every_$stages.json"
  done ;;
*) echo "session42_call.sh: MODE must be verify or every, got '$3'" >&2; exit 2 ;;
esac
