# The shared start of the sessions' GPU call scripts (sourced: `source "$(dirname "$0")/call_setup.sh" "$@"`).
# Takes OUTDIR TAR from the caller's arguments; defines step NAME LIMIT CMD...: runs CMD under a time
# limit with its log in OUTDIR, then re-packs OUTDIR into TAR, so a call cut short still returns what
# finished. Records the versions; E2E and PROF are the commands most steps time.
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 25 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
E2E="python3 -m kvpolicy bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers"
PROF="python3 benchmarks/profile_step.py --context 131072 --batch 4 --rows 45"
# pariskv at 1x32K with rerank_select's radix and row methods side by side (issue 13's cell), LIMIT seconds each
paris_select_pair() { local limit=$1 method; for method in radix row; do
  step "e2e_paris32k_$method" "$limit" python3 benchmarks/with_settings.py \
    kvpolicy.kernels.triton.rerank_select.METHOD="'$method'" -- ${E2E#python3 } --contexts 32768 --batches 1 \
    --presets pariskv@gpu --json "$OUT/e2e_paris32k_$method.json"
done; }
