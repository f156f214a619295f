#!/usr/bin/env bash
# Session 43's GPU calls. Usage: bash benchmarks/sessions/session43_call.sh OUTDIR TAR MODE
# Session 42 shipped a GPU pool's rows copied into the buffer at a re-selection for a policy that keeps its selection
# (store.ATTEND_POOL_BY_SLOT = "every_step") and by-slot rows at 2 pipeline stages, measured at batch 8 only.
# MODE check: the tests of the changed path that run differently on a GPU (attention, fetch, the step's ops,
# stores, graphs and placements, and tests/gpu's dense anchor on GPU pools), then the floor cell at batches 1, 4, 8;
# long: louiskv at 1x128K (GPU pool) and 4x128K (GPU and pinned pools), issue 12's table;
# every: an every-step policy end to end with its rows by slot at 2 stages (shipped) and 3 (before), then 1x/4x32K;
# paris: pariskv on a pinned pool at 4x128K (issue 13: 0.54x at random weights' miss 0.90) with its selection's
# query pulled (--query-pull) so that successive selections overlap as on Gemma 3 (miss 0.24-0.33, EVAL.md).
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
check)
  step gpu_tests 270 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/gpu tests/kernels/triton/test_attention.py \
    tests/kernels/triton/test_fetch.py tests/kernels/triton/test_step.py tests/kernels/triton/test_admit.py \
    tests/test_store.py tests/test_graph.py tests/test_graph_branch.py tests/test_placement.py tests/test_pinned.py
  step e2e_cell 240 ${E2E} --contexts 2304 --batches 1,4,8 --presets louiskv@gpu --json "$OUT/e2e_cell.json" ;;
long)
  step e2e_128k1 200 ${E2E} --contexts 131072 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_128k1.json"
  step e2e_128k4 330 ${E2E} --contexts 131072 --batches 4 --presets louiskv@gpu,louiskv@cpu --json "$OUT/e2e_128k4.json" ;;
every)
  for stages in 2 3; do
    step "e2e_every_$stages" 170 python3 benchmarks/with_settings.py \
      kvpolicy.kernels.triton.attention.NUM_STAGES_BY_SLOT=$stages -- ${E2E#python3 } --contexts 2304 --batches 1,8 \
      --presets clusterkv@gpu --json "$OUT/e2e_every_$stages.json"
  done
  step e2e_32k 240 ${E2E} --contexts 32768 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_32k.json" ;;
paris)
  step e2e_paris128k4 560 ${E2E} --contexts 131072 --batches 4 --presets pariskv@cpu --query-pull 0,1,2,4 \
    --json "$OUT/e2e_paris128k4.json" ;;
paris_profile)
  # where pariskv's pinned step goes when few rows miss (p1: 22.76 ms at miss 0.04, 14.05 over the floor)
  step profile_paris128k4_p4 200 python3 benchmarks/profile_step.py --preset pariskv --context 131072 --batch 4 \
    --placement cpu --query-pull 4 --rows 40 ;;
paris_profile0)
  # the same at random weights' overlap (p1: 49.86 ms at miss 0.90): what of the refresh follows the misses
  step profile_paris128k4_p0 200 python3 benchmarks/profile_step.py --preset pariskv --context 131072 --batch 4 \
    --placement cpu --rows 40 ;;
refresh)
  # (not run in session 43) the refresh alone at 4x128K, single rows, with a share of rows already in the buffer:
  # its time at resident 1 is the part that does not follow the misses (q1/q2: about 0.21 ms a layer)
  step gather_refresh 200 python3 -m kvpolicy bench gather --gather-ops refresh --runs 1 --batches 4 --budget 2048 \
    --resident 0,0.5,0.9,0.96,1 --json "$OUT/gather_refresh.json" ;;
*) echo "session43_call.sh: MODE must be check, long, every, paris, paris_profile, paris_profile0 or refresh, got '$3'" >&2; exit 2 ;;
esac
