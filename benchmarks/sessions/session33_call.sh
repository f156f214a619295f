#!/usr/bin/env bash
# Session 33's GPU calls. Usage: bash benchmarks/sessions/session33_call.sh OUTDIR TAR MODE
# MODE all: every kernel launched with programmatic dependent launch (KVPOLICY_PDL_SCOPE=all): every Triton GPU
# test, then louiskv at 1x128K (with full-graph timed in the same run) and pariskv at 1x32K, PDL on and off
# side by side; the full-graph rows give the second on/off timing session 32 left unsettled (a1 ran it; its
# end-to-end steps failed on a script bug, and its tests ran past 120 s); e2e_first: the same with the
# end-to-end steps first (a2); waves: pdl.WAVES (w1); large_grids: pdl.LARGE_GRIDS (never ran)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
all|e2e_first)
  export KVPOLICY_PDL_SCOPE=all
  [ "$3" = all ] && step triton_tests 120 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/kernels/triton
  for on in True False; do
    step e2e_louiskv_pdl_$on 90 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=$on -- ${E2E#python3 } \
      --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_louiskv_pdl_$on.json"
  done
  for on in True False; do
    step e2e_pariskv_pdl_$on 80 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=$on -- ${E2E#python3 } \
      --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_pariskv_pdl_$on.json"
  done
  # (a1 ran "all": the whole folder needs more than 120 s; here it gets the rest of the call)
  [ "$3" = e2e_first ] && step triton_tests 270 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton
  ;;
waves)  # PDL limited to grids of one wave of SMs (pdl.WAVES=1), beside no limit and PDL off, louiskv at 1x128K
  for setting in WAVES=None WAVES=1 ENABLED=False all:WAVES=1; do
    scope=reusing-step; [ "${setting%%:*}" = all ] && scope=all
    KVPOLICY_PDL_SCOPE=$scope step "e2e_${setting//[:=]/_}" 100 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.pdl.${setting#all:} -- ${E2E#python3 } --contexts 131072 --batches 1 --presets louiskv@gpu \
      --json "$OUT/e2e_${setting//[:=]/_}.json"
  done ;;
large_grids)  # (never ran: no device time left) past one wave, PDL with the next kernel scheduled late, beside
  # plain (the default) and no wave limit, louiskv at 1x128K
  for setting in LARGE_GRIDS=\'no-early-next\' LARGE_GRIDS=\'plain\' WAVES=None; do
    name=e2e_$(echo "$setting" | tr -dc 'A-Za-z_=-' | tr '=' '_')
    step "$name" 100 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.$setting -- ${E2E#python3 } \
      --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/$name.json"
  done ;;
*) echo "session33_call.sh: MODE must be all, e2e_first, waves or large_grids, got '$3'" >&2; exit 2 ;;
esac
