#!/usr/bin/env bash
# Issue 13's 1M-token cell (batch 1, Qwen3-8B shape, pinned pool). Usage: bash benchmarks/sessions/session9_paris_1m.sh OUTDIR
# The pools alone are ~144 GiB: on nvidia-h200 (128 GiB host) the pariskv/cpu row and full-graph's
# row both say "does not fit: ... needs N GiB of KV, M GiB ..." (kvpolicy.bench.e2e.DoesNotFit) and
# the run exits 0; on nvidia-h200-x2 (256 GiB host, one GPU used) pariskv/cpu runs, full-graph does not fit.
set -u
OUT=${1:?usage: session9_paris_1m.sh OUTDIR}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
free -g > "$OUT/host_memory.txt" 2>&1
t0=$(date +%s)
timeout "${LIMIT_S:-420}" python3 -m kvpolicy bench e2e --contexts 1048576 --batches 1 --presets pariskv@cpu \
    --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_1m.json" > "$OUT/e2e_1m.log" 2>&1
echo "rc=$? seconds=$(( $(date +%s) - t0 ))" >> "$OUT/e2e_1m.log"
tail -n 20 "$OUT/e2e_1m.log"
