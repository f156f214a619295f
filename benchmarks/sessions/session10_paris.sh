#!/usr/bin/env bash
# Session 10's ParisKV selection call on the H200 (issue 13): the selection per layer at 128Kx4
# and 1Mx4 with the kernels before and after session 10 (pariskv_select.py --quick: the whole
# selection both ways, query_votes sort/count, collision_candidates fused/pass and two tunables,
# every kernel's device time), then one profiled graph-replayed decode step of the pariskv
# preset at 128Kx4 (GPU pool). Usage, from the repo root: bash benchmarks/sessions/session10_paris.sh OUTDIR
# Every step runs under `timeout`, bounded also by a deadline for the whole script (TOTAL_S, 90 s
# by default); each step's log (with its rc and seconds) lands in OUTDIR/<step>.log.
set -u
OUT=${1:?usage: session10_paris.sh OUTDIR}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
START=$(date +%s); TOTAL=${TOTAL_S:-90}
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( TOTAL - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if (( limit < 5 )); then echo "== $name skipped: the script's deadline" | tee "$OUT/$name.log"; return; fi
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/$name.log"
  tail -n 30 "$OUT/$name.log"
}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
# 128K, then the profile (its kernels already compiled: Triton's cache is on disk), then 1M with
# what is left (TOTAL_S=130 gives it room; its rows print as they finish)
SEL="python3 benchmarks/pariskv_select.py --quick --no-gather --batches 4 --repeats 10"
step select_128k 35 $SEL --contexts 131072 --json "$OUT/pariskv_select_128k.json"
step prof 40 python3 benchmarks/profile_step.py --preset pariskv --placement gpu --context 131072 --batch 4 --rows 45 --out "$OUT/prof.txt"
step select_1m 45 $SEL --contexts 1048576 --json "$OUT/pariskv_select_1m.json"
