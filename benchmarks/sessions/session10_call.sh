#!/usr/bin/env bash
# Session 10's GPU calls. Usage: bash benchmarks/sessions/session10_call.sh OUTDIR TAR MODE
# Each step's log lands in OUTDIR; the folder is re-packed into TAR after every step, so a call cut
# short still returns what finished. A file wheels/chunk_* carried with the call is moved to
# /tmp/gemma_chunks (kept while the machine stays warm) for the Gemma 3 call.
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/gemma_chunks; for c in wheels/chunk_*; do [ -f "$c" ] && mv "$c" /tmp/gemma_chunks/; done; ls -la /tmp/gemma_chunks > "$OUT/chunks.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 25 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
E2E="python3 -m kvpolicy bench e2e --full-kinds full-graph --budget 2048 --steps 18 --compiled-layers"
PROF="python3 benchmarks/profile_step.py --context 131072 --batch 4 --rows 45"
case ${3:?} in
first)  # call 1 (the e2e_short and gpu_tests rows of docs/bench/session10/first; the profiles timed out at 45 s)
step gpu_tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_admit.py tests/test_graph_ready.py tests/kernels/triton/test_refresh.py tests/test_store_refresh.py
step e2e_short 230 $E2E --contexts 32768,131072 --batches 1,4 --presets louiskv@gpu --json "$OUT/e2e_short.json"
step prof_pariskv_gpu 45 $PROF --preset pariskv --placement gpu --out "$OUT/prof_pariskv_gpu.txt"
;;
whole)  # call 2: the GPU pool read whole in one launch, the pinned pool at real-model overlap
step gpu_tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_fetch.py tests/test_store_refresh.py tests/bench/test_overlap.py tests/test_graph_ready.py -k "louiskv or fetch or store or overlap or read_whole"
step prof_every_gpu 80 $PROF --preset louiskv --placement gpu --trigger '{"name":"every_step"}' --out "$OUT/prof_every_gpu.txt"
step e2e_gpu 110 $E2E --contexts 131072 --batches 4 --presets louiskv@gpu --json "$OUT/e2e_gpu.json"
step e2e_pinned 170 $E2E --contexts 131072 --batches 4 --presets louiskv@cpu --stickiness 16,32 --json "$OUT/e2e_pinned.json"
;;
final)  # call 3 (cut twice to the device time left after two refused starts): ParisKV's new kernels on the GPU, then 1x32K
step gpu_tests 35 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/triton/test_analytic_ops.py tests/triggers/test_score_gap.py
step paris 90 bash benchmarks/sessions/session10_paris.sh "$OUT/paris"
step e2e_32k1 50 $E2E --contexts 32768 --batches 1 --presets louiskv@gpu --json "$OUT/e2e_32k1.json"
;;
esac
