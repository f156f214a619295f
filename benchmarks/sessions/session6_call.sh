#!/usr/bin/env bash
# Session 6's GPU calls: the re-selection as a CUDA graph conditional node against kernels inline.
# Usage: bash benchmarks/sessions/session6_call.sh OUTDIR TAR [first|second|third]
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 30 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
REUSE='{"name":"interval","n":1099511627776}'
case ${3:-first} in
first)
step kernels 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_graph_branch.py tests/test_decode_graph.py tests/test_triton_select.py
step sortbench 45 python3 benchmarks/select_sort.py --units 2048,8192,16384,32768 --batches 1,4 --repeats 20
step profile 110 bash -c "for b in node inline; do python3 benchmarks/profile_step.py --rows 45 --preset louiskv --context 2304 --batch 1 --placement gpu --trigger '$REUSE' --branches \$b --out $OUT/profile_reuse_2304_\$b.txt || exit 1; done"
step e2e 330 python3 -m kvpolicy bench e2e --contexts 32768,131072 --batches 1,4 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --branches node,inline --json "$OUT/e2e.json"
;;
second)
step kernels 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_graph_branch.py tests/test_decode_graph.py
step sort_b1024 40 python3 -c "import runpy, sys; import kvpolicy.kernels.triton.select as s; s._THRESHOLD_BLOCK = 1024; sys.argv = ['select_sort.py', '--units', '8192,32768', '--batches', '1', '--repeats', '20']; runpy.run_path('benchmarks/select_sort.py', run_name='__main__')"
step sort_b2048w16 40 python3 -c "import runpy, sys; import kvpolicy.kernels.triton.select as s; s._THRESHOLD_BLOCK = 2048; s._NUM_WARPS = 16; sys.argv = ['select_sort.py', '--units', '8192,32768', '--batches', '1', '--repeats', '20']; runpy.run_path('benchmarks/select_sort.py', run_name='__main__')"
step profile 90 bash -c "for b in node inline; do python3 benchmarks/profile_step.py --rows 45 --preset louiskv --context 2304 --batch 1 --placement gpu --trigger '$REUSE' --branches \$b --out $OUT/profile_reuse_2304_\$b.txt || exit 1; done"
step e2e_32k 120 python3 -m kvpolicy bench e2e --contexts 32768 --batches 1 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --branches node,inline --json "$OUT/e2e_32k.json"
step e2e 200 python3 -m kvpolicy bench e2e --contexts 32768,131072 --batches 4,1 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --branches node --json "$OUT/e2e.json"
;;
third)
step kernels 90 python3 -m pytest -q -p no:cacheprovider tests/test_graph_branch.py
step targets_128k4 150 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets louiskv@cpu,pariskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e_128k_b4.json"
step targets_512k 120 python3 -m kvpolicy bench e2e --contexts 524288 --batches 1 --presets louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e_512k_b1_cpu.json"
step pariskv_select 110 python3 benchmarks/pariskv_select.py --json "$OUT/pariskv_select.json"
;;
suite)
step gpu_suite 560 python3 -m pytest -q -p no:cacheprovider -x tests/ --deselect tests/test_eval_slice.py
;;
esac
