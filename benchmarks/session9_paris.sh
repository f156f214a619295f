#!/usr/bin/env bash
# Session 9's ParisKV call on the H200 (issue 13). Usage: bash benchmarks/session9_paris.sh OUTDIR
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
# the new gather kernel and the radix tunables against their references at GPU sizes
step gpu_tests 30 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_gather_single.py tests/kernels/triton/test_analytic_ops.py -k "gather or rerank_select"
# single-row gather: gather.py against gather_single's schedules, 4 KB-page (mmap) and THP pools
step pinned_gather 40 python3 benchmarks/pinned_gather.py --contexts 1048576,131072 --batch 4 --repeats 10 --json "$OUT/pinned_gather.json"
# selection per layer; 'radix' is now 128 x 4 warps, 'radix score 32x4w' the setting before
step pariskv_select 45 python3 benchmarks/pariskv_select.py --no-gather --json "$OUT/pariskv_select.json"
step e2e_pariskv_128k4 200 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets pariskv@gpu,pariskv@cpu --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers --json "$OUT/e2e_pariskv_128k4.json"
echo "total seconds $(( $(date +%s) - START ))" | tee -a "$OUT/versions.txt"
