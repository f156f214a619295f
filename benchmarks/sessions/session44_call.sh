#!/usr/bin/env bash
# Session 44's GPU calls. Usage: bash benchmarks/sessions/session44_call.sh OUTDIR TAR MODE
# MODE refresh: issue 13's refresh alone at 4x128K, single rows, with a share of its rows already in the buffer
# (bench gather --resident): its time at resident 1 is the part that does not follow the misses (session 43's
# profiles: about 0.21 ms a layer), then louiskv at 1x128K (issue 12, not re-measured since session 40);
# long: louiskv at 4x128K on GPU and pinned pools (issue 12's table);
# every: an every-step policy at the floor cell and louiskv at 1x/4x32K.
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
refresh)
  step gather_refresh 200 python3 -m kvpolicy bench gather --gather-ops refresh --runs 1 --batches 4 --budget 2048 \
    --resident 0,0.5,0.9,0.96,1 --json "$OUT/gather_refresh.json"
  step e2e_128k1 220 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json" ;;
long)
  step e2e_128k4 400 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu,louiskv@cpu --json "$OUT/e2e_128k4.json" ;;
every)
  step e2e_every 170 ${E2E} --contexts 2304 --batches 1,8 --presets clusterkv@gpu --json "$OUT/e2e_every.json"
  step e2e_32k 240 ${E2E} --contexts 32768 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_32k.json" ;;
*) echo "session44_call.sh: MODE must be refresh, long or every, got '$3'" >&2; exit 2 ;;
esac
