"""The score-gap ops' kernels compile for an H100/H200 (sm_90), on any machine: ``hopper_compile.py``
in a process without ``TRITON_INTERPRET`` (the interpreter that runs the other kernel tests on a CPU
accepts code the compiler refuses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).with_name("hopper_compile.py")
ROOT = Path(__file__).resolve().parents[3]


# The GPU image's Triton (3.6) refuses code this one accepts (session 31: a return inside a called function's
# if): a Python with that Triton, named here, runs the same check (a venv with torch and triton 3.6's wheel)
OTHER_TRITON = os.environ.get("KVPOLICY_GPU_TRITON_PYTHON")


@pytest.mark.parametrize("python", [sys.executable, pytest.param(OTHER_TRITON, marks=pytest.mark.skipif(
    not OTHER_TRITON, reason="set KVPOLICY_GPU_TRITON_PYTHON to a Python whose Triton is the GPU image's"))],
    ids=["this-triton", "gpu-image-triton"])
def test_score_gap_kernels_compile_for_sm90(python):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([python, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"a kernel does not compile for sm_90:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled for sm_90")]
    assert len(compiled) == 9, done.stdout
    # the challengers' launches were among them
    assert all(name in done.stdout for name in ("_between_kernel", "_row_parts_kernel", "_follow_kernel"))
