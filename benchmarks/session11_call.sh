#!/usr/bin/env bash
# Session 11's GPU calls. Usage: bash benchmarks/session11_call.sh OUTDIR TAR MODE
# Each step's log lands in OUTDIR; the folder is re-packed into TAR after every step, so a call cut
# short still returns what finished.
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 25 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
E2E="python3 -m kvpolicy bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers"
PROF="python3 benchmarks/profile_step.py --context 131072 --batch 4 --rows 45"
case ${3:?} in
fill)  # call 1: the fill's variants, then the cells not yet run at the 20% rate
step gpu_tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_select.py
step fill_variants 120 python3 benchmarks/fill_variants.py
step e2e_rate 260 $E2E --contexts 32768,131072 --batches 4,1 --presets louiskv@gpu --json "$OUT/e2e_rate.json"
;;
esac
