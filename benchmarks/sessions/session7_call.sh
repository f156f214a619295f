#!/usr/bin/env bash
# Session 7's GPU calls. Usage: bash benchmarks/sessions/session7_call.sh OUTDIR TAR MODE
set -u
OUT=${1:?}; TAR=${2:?}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n 40 "$OUT/$name.log"; tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
REUSE='{"name":"interval","n":1099511627776}'
case ${3:?} in
diagnose)
step divergence 150 python3 scripts/graph_divergence.py cuda
step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_graph_branch.py tests/test_decode_graph.py tests/test_index_memory.py tests/test_pariskv.py tests/test_store.py tests/test_store_refresh.py tests/test_score_gap.py tests/test_triton_select.py tests/test_selectors.py tests/test_eval_graph_decode.py
;;
second)
step graph_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_graph_branch.py tests/test_decode_graph.py tests/test_graph_ready.py tests/test_compiled_layers.py
step sortbench 60 python3 benchmarks/select_sort.py --units 2048,8192,32768 --batches 1,4 --repeats 20
step e2e_compiled 240 python3 -m kvpolicy bench e2e --contexts 131072,32768 --batches 4,1 --presets louiskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_compiled.json"
step e2e_topk_128k4 100 python3 -c "import runpy, sys; import kvpolicy.kernels.triton.select as s; s.RANKING = 'topk'; sys.argv = ['kvpolicy', 'bench', 'e2e', '--contexts', '131072', '--batches', '4', '--presets', 'louiskv@gpu,louiskv@cpu', '--full-kinds', 'full-graph', '--budget', '2048', '--steps', '10', '--compiled-layers', '--json', '$OUT/e2e_topk_128k4.json']; runpy.run_module('kvpolicy', run_name='__main__')"
;;
third)
step sortbench 60 python3 benchmarks/select_sort.py --units 8192,32768 --batches 1,4 --repeats 20
step profile_reselect 120 python3 benchmarks/profile_step.py --rows 40 --preset louiskv --context 131072 --batch 4 --placement gpu --trigger '{"name":"interval","n":1}' --branches node --out "$OUT/profile_reselect_128k4.txt"
step e2e_pinned_128k4 170 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_pinned_128k4.json"
step e2e_pinned_512k 170 python3 -m kvpolicy bench e2e --contexts 524288 --batches 1 --presets louiskv@cpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_pinned_512k.json"
;;
fourth)
step resident_rows 40 python3 benchmarks/resident_rows.py --rows 2048 --batches 1,4
step pariskv_select 60 python3 benchmarks/pariskv_select.py --json "$OUT/pariskv_select.json"
step e2e_pariskv_128k4 120 python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets pariskv@gpu --full-kinds full-graph --budget 2048 --steps 10 --compiled-layers --json "$OUT/e2e_pariskv_128k4.json"
step capacity 150 python3 -m kvpolicy bench capacity --contexts 131072 --steps 5 --compiled-layers --json "$OUT/capacity.json"
;;
esac
