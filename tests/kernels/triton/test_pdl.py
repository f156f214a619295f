"""Programmatic dependent launch (``kernels/triton/pdl.py``): every kernel that can be launched with it
waits for the kernel before it first, and only a CUDA device of sm_90 or later launches that way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kvpolicy.kernels.triton import pdl  # noqa: E402

TRITON_DIR = Path(pdl.__file__).parent


def _pdl_kernels():
    """(file, kernel) of every ``@triton.jit`` function in kernels/triton/ that takes a ``PDL`` parameter."""
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            takes_pdl = isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args)
            if takes_pdl and node.name != "wait_for_previous":
                yield path.name, node


PDL_KERNELS = list(_pdl_kernels())


def test_the_reusing_steps_kernels_take_pdl():
    names = {node.name for _, node in PDL_KERNELS}
    # the kernels of a reusing step (pdl.py's docstring); admit follows a conditional node and stays plain
    assert {"_append_token_kernel", "_follow_kernel", "_outlier_gap_blocks_kernel", "_row_parts_kernel",
            "_decide_kernel", "_append_kernel", "_split_kernel", "_combine_kernel"} <= names


@pytest.mark.parametrize("where, kernel", PDL_KERNELS, ids=[f"{f}:{k.name}" for f, k in PDL_KERNELS])
def test_a_pdl_kernel_waits_before_anything_else(where, kernel):
    """A link that read or returned before waiting could finish before the kernel ahead of it, and the
    kernel after it would then wait on the wrong one (pdl.py)."""
    body = kernel.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), (where, kernel.name)
    call = first.value
    assert ast.unparse(call) == "wait_for_previous(PDL)", (where, kernel.name, ast.unparse(call))


def test_no_pdl_off_a_cuda_device_or_when_turned_off(monkeypatch):
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}

