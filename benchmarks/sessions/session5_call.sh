#!/usr/bin/env bash
# Session 5's GPU call: the fused reuse path's kernel tests, a profile of the reusing step, the e2e grid
# with the budget-floor row. Usage: bash benchmarks/sessions/session5_call.sh OUTDIR TAR [first|second]
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 25 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
case ${3:-first} in
first)
step kernels 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_step.py tests/test_triton_unit_append.py tests/test_decode_graph.py tests/test_graph_ready.py tests/test_triton_admit.py tests/test_triton_select.py tests/test_policy_behaviour.py
step profile 120 bash -c "python3 benchmarks/profile_step.py --rows 60 --preset louiskv --context 2304 --batch 1 --placement gpu --trigger '{\"name\":\"interval\",\"n\":1099511627776}' --out $OUT/profile_reuse_2304.txt && python3 benchmarks/profile_step.py --rows 60 --preset louiskv --context 131072 --batch 4 --placement gpu --trigger '{\"name\":\"interval\",\"n\":1099511627776}' --out $OUT/profile_reuse_128k4.txt"
step e2e 400 python3 -m kvpolicy bench e2e --contexts 32768,131072 --batches 1,4 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e.json"
;;
second)
step kernels 110 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_step.py tests/test_decode_graph.py tests/test_graph_ready.py tests/test_triton_attention.py tests/test_policy_behaviour.py
step e2e 200 python3 -m kvpolicy bench e2e --contexts 32768,131072 --batches 1,4 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e.json"
step targets_128k4 150 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e_128k_b4_cpu.json"
step targets_512k 120 python3 -m kvpolicy bench e2e --contexts 524288 --batches 1 --presets louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e_512k_b1_cpu.json"
;;
third)
step kernels 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_select.py tests/test_triton_step.py tests/test_decode_graph.py
step sortbench 45 python3 benchmarks/select_sort.py --units 2048,8192,16384,32768 --batches 1,4 --repeats 20
step e2e 230 python3 -m kvpolicy bench e2e --contexts 32768,131072 --batches 1,4 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --json "$OUT/e2e.json"
;;
esac
