#!/usr/bin/env bash
# Session 19's GPU calls. Usage: bash benchmarks/sessions/session19_call.sh OUTDIR TAR MODE
# (a record: modes lookups, ahead and packed ran at commits da5a07a, 488072b and 3f4edea, whose variants were
# removed after; on main they time the current variants, and packed's last step fails on VOTES_PACKED)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
SELECT="python3 benchmarks/pariskv_select.py --quick --no-gather --repeats 10"
case ${3:?} in
lookups|ahead)  # call 1 (lookups, commit da5a07a): ParisKV's lookups without L1 table loads, the
# votes through tl.gather (VOTES_LOOKUP) and the rerank's nibble values by selects (NIBBLES); both slower,
# both removed. Call 2 (ahead): the votes' ids and the rerank's codes loaded a step ahead (VOTES_AHEAD,
# CODES_AHEAD). Each: the analytic ops' decode-size tests (also the large calls' fold and chunks of 4,096,
# the session-18 defaults never tested there), then the selection per layer with the variants beside the
# shipped rows at 128Kx4, 1Mx4, 512Kx1 and 32Kx1
step gpu_tests 220 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "decode_sizes or collision_candidates or ahead"
step select_4 170 $SELECT --contexts 131072,1048576 --batches 4 --json "$OUT/select_4.json"
step select_512k 70 $SELECT --contexts 524288 --batches 1 --json "$OUT/select_512k.json"
step select_32k 50 $SELECT --contexts 32768 --batches 1 --json "$OUT/select_32k.json"
[ "$3" = ahead ] && step e2e_512k 130 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k.json"
;;
packed)  # call 3: both step-ahead loads slower (call 2), removed; the votes from a table of two 4-bit votes a
# byte (VOTES_PACKED), and the radix level and place passes on chunks of at least 1,024 in large calls (the
# default now): tests, the selection per layer at the four sizes, then pariskv at 1x512K with the packed table
step gpu_tests 220 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "decode_sizes or collision_candidates or packed"
step select_4 170 $SELECT --contexts 131072,1048576 --batches 4 --json "$OUT/select_4.json"
step select_512k 70 $SELECT --contexts 524288 --batches 1 --json "$OUT/select_512k.json"
step select_32k 50 $SELECT --contexts 32768 --batches 1 --json "$OUT/select_32k.json"
step e2e_512k_packed 130 python3 benchmarks/with_settings.py kvpolicy.kernels.triton.collision_candidates.VOTES_PACKED=True -- ${E2E#python3 } --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k_packed.json"
;;
e2e)  # call 4: the packed table slower (call 3), removed; pariskv end to end with the shipped kernels (the
# level passes' larger chunk in large calls) at 1x512K and 1x32K, at 4x128K on a GPU and a pinned pool (the
# pinned row last measured in session 9), and the single-row gather from a pinned pool at 1Mx4 (session 9)
step gpu_tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py -k "group_mean or rerank_select_at_decode"
step e2e_512k 130 $E2E --contexts 524288 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_512k.json"
step e2e_32k 100 $E2E --contexts 32768 --batches 1 --presets pariskv@gpu --json "$OUT/e2e_32k.json"
step e2e_128k4 200 $E2E --contexts 131072 --batches 4 --presets pariskv@gpu,pariskv@cpu --json "$OUT/e2e_128k4.json"
step pinned_gather_1m 70 python3 benchmarks/pinned_gather.py --contexts 1048576 --batch 4 --repeats 10 --spans 131072,262144,524288 --json "$OUT/pinned_gather_1m.json"
;;
thp)  # call 5: the pinned pools in transparent huge pages (pinned.HUGE_PAGES: a private mapping, advised;
# before, a shared mapping, which THP's madvise mode never backs with huge pages): the pinned pool's GPU
# tests, the single-row gather at 1Mx4 from each pool kind (mmap: pinned_empty now; mmap4k: as before),
# louiskv's pinned interval row at 4x128K at the two stickiness settings around the suite's miss, and
# pariskv's pinned 4x128K row
step gpu_tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_pinned_pool.py tests/test_pinned.py
step pinned_gather_1m 110 python3 benchmarks/pinned_gather.py --contexts 1048576 --batch 4 --repeats 10 --spans 131072 --pools mmap,mmap4k,thp,hostalloc --json "$OUT/pinned_gather_1m.json"
step rates_128k4 200 python3 benchmarks/pinned_rates.py --context 131072 --batch 4 --stickiness 32,48 --json "$OUT/rates_128k4.json"
step e2e_paris_pinned 130 $E2E --contexts 131072 --batches 4 --presets pariskv@cpu --json "$OUT/e2e_paris_pinned.json"
;;
profiles)  # call 6: where the two nearest misses' steps go: louiskv's pinned interval(5) step at 4x128K
# (2.49x against 2.5, call 5) and pariskv's step at 1x32K (0.96x against 1.0, call 4)
step prof_pinned_interval 150 $PROF --preset louiskv --placement cpu --trigger '{"name":"interval","n":5}' --stickiness 32 --steps 10 --out "$OUT/prof_pinned_interval.txt"
step prof_paris_32k 100 python3 benchmarks/profile_step.py --context 32768 --batch 1 --rows 45 --preset pariskv --placement gpu --out "$OUT/prof_paris_32k.txt"
;;
trigger)  # call 7: helper-24's score_gap changes (new measures and margins in the fused trigger kernels) on
# the GPU for the first time: the trigger's op and trigger tests, then louiskv's rows at 1x32K (its
# score_gap_reuse row runs the fused kernels at the preset's trigger)
step gpu_tests 100 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py tests/triggers/test_score_gap.py
step e2e_louiskv_32k 110 $E2E --contexts 32768 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_louiskv_32k.json"
;;
esac
