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


def test_score_gap_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"a kernel does not compile for sm_90:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled for sm_90")]
    assert len(compiled) == 7, done.stdout
    # the challengers' launches were among them
    assert all(name in done.stdout for name in ("_between_kernel", "_row_parts_kernel", "_follow_kernel"))
