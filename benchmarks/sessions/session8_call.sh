#!/usr/bin/env bash
# Session 8's GPU calls. Usage: bash benchmarks/sessions/session8_call.sh OUTDIR TAR MODE
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 30 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
case ${3:?} in
first)
step gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_graph_ready.py tests/test_decode_graph.py tests/test_triton_admit.py tests/test_triton_step.py tests/test_refresh_rows.py tests/test_split_placement.py tests/test_triton_select.py tests/test_triton_kmeans.py tests/test_triton_analytic.py
step sortbench 60 python3 benchmarks/select_sort.py --units 2048,8192,32768 --batches 1,4 --repeats 20
step pariskv_select 80 python3 benchmarks/pariskv_select.py --json "$OUT/pariskv_select.json"
step kmeans_kernel 50 python3 benchmarks/kmeans_ttft.py --parts kernel --json "$OUT/kmeans_kernel.json"
step e2e_128k4 190 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets louiskv@gpu,louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_128k4.json"
;;
second)
step gpu_tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_select.py tests/test_graph_ready.py tests/test_triton_admit.py tests/test_triton_step.py tests/test_split_placement.py
step sortbench 45 python3 benchmarks/select_sort.py --units 2048,8192,32768 --batches 1,4 --repeats 20
step e2e_128k4 180 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets louiskv@gpu,louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_128k4.json"
step e2e_pariskv_128k4 110 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets pariskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_pariskv_128k4.json"
step ttft 100 python3 benchmarks/kmeans_ttft.py --parts ttft --contexts 8192,32768,65536 --nosync off --no-pariskv --json "$OUT/ttft.json"
;;
esac
