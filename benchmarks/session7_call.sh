#!/usr/bin/env bash
# Session 7's GPU calls. Usage: bash benchmarks/session7_call.sh OUTDIR TAR MODE
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
esac
