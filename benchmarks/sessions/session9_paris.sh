#!/usr/bin/env bash
# Session 9's ParisKV call on the H200 (issue 13). Usage: bash benchmarks/sessions/session9_paris.sh OUTDIR
# Every step runs under `timeout`, bounded also by a deadline for the whole script (TOTAL_S, 235 s
# by default); each step's log (with its rc and seconds) lands in OUTDIR/<step>.log.
set -u
OUT=${1:?usage: session9_paris.sh OUTDIR}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
START=$(date +%s); TOTAL=${TOTAL_S:-235}
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( TOTAL - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 5 )); then echo "== $name skipped: the script's deadline" | tee "$OUT/$name.log"; return; fi
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/$name.log"
  tail -n 40 "$OUT/$name.log"
}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
cat /sys/kernel/mm/transparent_hugepage/enabled >> "$OUT/versions.txt" 2>&1
# the gather kernel (pinned pools included) and the analytic ops at decode sizes against their references
step gpu_tests 45 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_gather_single.py tests/kernels/triton/test_analytic_ops.py -k "gather or decode_sizes"
# single-row gather at 1Mx4: gather.py against gather_single's schedules (and persistent walks) on
# mmap (4 KB pages), THP (touched before pinning, its huge pages counted from smaps), hugetlb
# (only where pages are reserved) and cudaHostAlloc pools; then gather.py with the rows drawn
# from the first 128K/256K/512K positions of the same 1M pool (the span's effect alone)
step pinned_gather_1m 70 python3 benchmarks/pinned_gather.py --contexts 1048576 --batch 4 --repeats 10 --spans 131072,262144,524288 --json "$OUT/pinned_gather_1m.json"
# 1M tokens, batch 1: on this host the rows say "does not fit" (pools ~144 GiB) and it exits 0
step e2e_1m 75 python3 -m kvpolicy bench e2e --contexts 1048576 --batches 1 --presets pariskv@cpu,pariskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_1m.json"
# selection per layer ('radix': 128 x 4 warps, chunks of at least 256; 'radix min chunk 128' the third
# call's setting, 'radix score 32x4w old' session 8's) and
# collision_candidates per tunable (COLLISION_VARIANTS)
step pariskv_select 55 python3 benchmarks/pariskv_select.py --no-gather --repeats 10 --json "$OUT/pariskv_select.json"
# measured in the third call (1.24x GPU pool, 0.45x pinned): runs only if time is left
step e2e_pariskv_128k4 200 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets pariskv@gpu,pariskv@cpu --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --json "$OUT/e2e_pariskv_128k4.json"
echo "total seconds $(( $(date +%s) - START ))" | tee -a "$OUT/versions.txt"
