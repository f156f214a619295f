#!/usr/bin/env bash
# Session 41's GPU calls. Usage: bash benchmarks/sessions/session41_call.sh OUTDIR TAR MODE
# MODE tests: the kernel and trigger test files session 40 trimmed for the interpreter (gpu_cross: a covering
# subset on the CPU, the whole cross product and the original shapes on a GPU), run on the GPU, where they had not
# run since the trim. (The target table's modes are session40_call.sh's long and huge.)
source "$(dirname "$0")/call_setup.sh" "$@"  # OUT, TAR, step, E2E, PROF
case ${3:?} in
tests)
  step trimmed_tests 420 python3 -m pytest -q -rs -n 12 -p no:cacheprovider tests/kernels/triton/test_score_gap_ops.py \
    tests/triggers/test_score_gap.py tests/kernels/triton/test_analytic_ops.py tests/kernels/triton/test_select.py \
    tests/units/test_analytic_index.py tests/test_store_refresh.py tests/test_gpu_cross.py ;;
*) echo "session41_call.sh: MODE must be tests, got '$3'" >&2; exit 2 ;;
esac
