#!/usr/bin/env bash
# Session 42's GPU calls. Usage: bash benchmarks/sessions/session42_call.sh OUTDIR TAR MODE
# MODE slot: batch 8's attention kernel reads a GPU pool's retrieved rows by slot at 43.8 us a layer against the
# floor's 27.7 (session 41's profile). The kernel alone (benchmarks/attention_by_slot.py: rows copied in, by slot
# with the slots loaded ahead of valid (session 42) or after it, by row with no zone map, K/V loaded ahead of valid,
# 2 and 4 pipeline stages), then end to end at 2,304 tokens, batch 8: the rows fetched into the buffer
# (store.ATTEND_POOL_BY_SLOT=False), by slot as before (attention.SLOTS_AHEAD_OF_VALID=False), by slot as now, and
# with K/V loaded ahead of valid (attention.KV_AHEAD_OF_VALID=True).
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
slot)
  step attention_by_slot 200 python3 benchmarks/attention_by_slot.py --batches 1,4,8
  step e2e_copied 200 python3 benchmarks/with_settings.py kvpolicy.store.ATTEND_POOL_BY_SLOT=False \
    -- ${E2E#python3 } --contexts 2304 --batches 8 --presets louiskv@gpu --json "$OUT/e2e_copied.json"
  step e2e_slots_after_valid 200 python3 benchmarks/with_settings.py \
    kvpolicy.kernels.triton.attention.SLOTS_AHEAD_OF_VALID=False \
    -- ${E2E#python3 } --contexts 2304 --batches 8 --presets louiskv@gpu --json "$OUT/e2e_slots_after_valid.json"
  step e2e_slots_ahead 200 ${E2E} --contexts 2304 --batches 8 --presets louiskv@gpu --json "$OUT/e2e_slots_ahead.json"
  step e2e_kv_ahead 200 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.attention.KV_AHEAD_OF_VALID=True \
    -- ${E2E#python3 } --contexts 2304 --batches 8 --presets louiskv@gpu --json "$OUT/e2e_kv_ahead.json" ;;
*) echo "session42_call.sh: MODE must be slot, got '$3'" >&2; exit 2 ;;
esac
