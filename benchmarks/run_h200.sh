#!/usr/bin/env bash
# Every GPU measurement of BENCHMARKS.md in one device call (about 9 minutes on the H200).
# Usage on the device machine, from the repository root:
#     bash benchmarks/run_h200.sh /root/bench "$OUT/bench.tar" [STEPS]
# STEPS: a comma-separated subset of kernels,profile,profile_policy,sortbench,candidates,gather,e2e,targets,layer,paris,ttft (default: all; all of them
# take more than one 10-minute device call, so split them over two calls on a warm machine).
# Each step has its own time limit and writes its JSON into the folder as soon as it finishes,
# so a step that runs out of time costs only itself; after every step the folder is re-packed
# into the one tar file (the device tool returns only a few files per call, and nothing that
# stays on the machine survives its release). Sizes are the issue's; trim with the flags.
set -u
OUT=${1:?output folder}
TAR=${2:?tar file to re-pack after each step}
STEPS=",${3:-kernels,profile,sortbench,candidates,gather,e2e,targets,layer,paris,ttft},"
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
step() {  # step NAME SECONDS command...
    local name=$1 limit=$2; shift 2
    [[ $STEPS == *",$name,"* ]] || return 0
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
    tail -n 40 "$OUT/$name.log"
    tar cf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"
}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
step kernels 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/triton/test_attention.py tests/kernels/triton/test_gather.py \
    tests/kernels/triton/test_select.py tests/kernels/triton/test_kmeans.py tests/kernels/triton/test_write.py tests/test_graph.py tests/test_graph_ready.py \
    tests/gpu/test_pinned_pool.py tests/bench/test_static_attention.py tests/kernels/triton/test_analytic_ops.py \
    tests/kernels/triton/test_unit_append.py tests/kernels/triton/test_admit.py tests/kernels/triton/test_score.py tests/units/test_analytic_index.py \
    tests/test_store_pool_layout.py tests/test_pinned.py tests/gpu/test_bench_timing.py
step profile 150 bash -c "python3 benchmarks/profile_step.py --preset full --context 131072 --batch 4 --out $OUT/profile_full.txt &&
    python3 benchmarks/profile_step.py --preset louiskv --context 131072 --batch 4 --trigger '{\"name\":\"interval\",\"n\":9}' \
        --out $OUT/profile_louiskv.txt"
step profile_policy 150 python3 benchmarks/profile_step.py --preset louiskv --context 131072 --batch 4 \
    --trigger '{"name":"interval","n":9}' --out "$OUT/profile_louiskv.txt"
step sortbench 60 python3 benchmarks/select_sort.py
step candidates 60 python3 benchmarks/candidate_topk.py
step gather 40 python3 -m kvpolicy bench gather --batches 1,4,8 --runs 1,16 --budget 2048 --json "$OUT/gather.json"
# issue 4b's grid in one run: louiskv at both placements, the peers with the pool in pinned host memory
step e2e 300 python3 -m kvpolicy bench e2e --contexts 32768,131072 --batches 1,4 --presets louiskv,arkvale@cpu,quest@cpu \
    --placements cpu,gpu --full-kinds full-graph,full-eager --budget 2048 --steps 10 --json "$OUT/e2e.json"
# the two throughput targets' cells (each policy cell pins 77 GB of host memory: about 50 s)
step targets 340 bash -c "python3 -m kvpolicy bench e2e --contexts 131072 --batches 4 --presets louiskv,arkvale \
    --placements cpu --full-kinds full-graph --budget 2048 --steps 20 --json $OUT/e2e_128k_b4.json &&
    python3 -m kvpolicy bench e2e --contexts 524288 --batches 1 --presets louiskv --placements cpu \
    --full-kinds full-graph --budget 2048 --steps 20 --json $OUT/e2e_512k_b1.json"
# issue 4a's grid as graph replays (under 150 s on the H200 in session 4)
step layer 200 python3 -m kvpolicy bench layer --contexts 32768,131072,524288 --batches 1,4,8 --presets louiskv,quest \
    --placements cpu,gpu --repeats 20 --json "$OUT/layer.json"
# issue 5: ParisKV's decode layer at 128K and 1M tokens beside louiskv and full attention (SDPA over the same KV)
# (graph-replayed parts; if a part cannot be captured the log says so and the eager timing runs instead)
step paris 150 bash -c "python3 -m kvpolicy bench layer --contexts 131072,1048576 --batches 1,4 --presets pariskv,louiskv \
    --placements cpu --repeats 20 --json $OUT/layer_pariskv.json || python3 -m kvpolicy bench layer --eager \
    --contexts 131072,1048576 --batches 1,4 --presets pariskv,louiskv --placements cpu --repeats 20 --json $OUT/layer_pariskv_eager.json"
step ttft 100 python3 -m kvpolicy bench ttft --contexts 2048,8192,32768,65536 --batches 1 --presets louiskv \
    --placements cpu,gpu --budget 2048 --repeats 2 --json "$OUT/ttft.json"
