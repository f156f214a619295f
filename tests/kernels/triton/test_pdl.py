"""Programmatic dependent launch (``kernels/triton/pdl.py``): every kernel the library launches is a
``pdl_kernel`` that waits for the kernel before it first, and launches are programmatic only where
``launches_with_pdl`` says so (by default, a reusing step's kernels on sm_90 and later)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kvpolicy import graph_branch  # noqa: E402
from kvpolicy.kernels.triton import pdl  # noqa: E402

TRITON_DIR = Path(pdl.__file__).parent


def _launched_kernels():
    """(file, function) of every ``@triton.jit`` function in kernels/triton/ that its file launches
    (``name[grid](...)``)."""
    for path in sorted(TRITON_DIR.glob("*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and re.search(rf"\b{node.name}\[", source):
                yield path.name, node


KERNELS = list(_launched_kernels())


def test_the_kernels_are_found():
    names = {node.name for _, node in KERNELS}
    # the reusing step's kernels, pariskv's selection, K-means
    assert {"_append_token_kernel", "_follow_kernel", "_outlier_gap_blocks_kernel", "_decide_kernel",
            "_append_kernel", "_admit_kernel", "_split_kernel", "_combine_kernel", "_radix_level_kernel",
            "_assign"} <= names
    assert len(KERNELS) >= 50


@pytest.mark.parametrize("where, kernel", KERNELS, ids=[f"{f}:{k.name}" for f, k in KERNELS])
def test_a_kernel_is_a_pdl_kernel_that_waits_before_anything_else(where, kernel):
    """A link that read or returned before waiting could finish before the kernel ahead of it, and the
    kernel after it would then wait on the wrong one (pdl.py)."""
    decorators = [ast.unparse(d) for d in kernel.decorator_list]
    assert decorators == ["pdl_kernel", "triton.jit"], (where, kernel.name, decorators)
    assert kernel.args.args[-1].arg == "PDL", (where, kernel.name)
    body = kernel.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    assert ast.unparse(body[0]) == "wait_for_previous(PDL)", (where, kernel.name, ast.unparse(body[0]))


def test_the_reusing_steps_kernels_are_named_as_they_are():
    """``REUSING_STEP`` names real kernels (a renamed kernel would silently launch plain)."""
    found = {(where.removesuffix(".py"), node.name) for where, node in KERNELS}
    assert pdl.REUSING_STEP <= found


def test_launches_are_plain_off_a_cuda_device_in_a_conditional_body_outside_the_scope_or_when_turned_off(
        monkeypatch):
    cpu = torch.device("cpu")
    append, assign = ("step", "_append_token_kernel"), ("kmeans", "_assign")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "SCOPE", "reusing-step")  # not the process's KVPOLICY_PDL_SCOPE
    monkeypatch.setattr(pdl, "WAVES", None)  # (no CUDA device to count SMs on)
    assert not pdl.launches_with_pdl(cpu, append)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    assert pdl.launches_with_pdl(cpu, append)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no grid dependency control
    assert not pdl.launches_with_pdl(cpu, append)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not pdl.launches_with_pdl(cpu, assign)  # not a reusing step's kernel
    monkeypatch.setattr(pdl, "SCOPE", "all")
    assert pdl.launches_with_pdl(cpu, assign)
    monkeypatch.setattr(graph_branch, "in_conditional_body", lambda: True)
    assert not pdl.launches_with_pdl(cpu, append)
    monkeypatch.setattr(graph_branch, "in_conditional_body", lambda: False)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.launches_with_pdl(cpu, append)


def test_a_grid_of_more_waves_than_the_limit_launches_plain(monkeypatch):
    cpu, append = torch.device("cpu"), ("step", "_append_token_kernel")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    monkeypatch.setattr(pdl, "_multiprocessors", lambda index: 132)
    monkeypatch.setattr(pdl, "_index", lambda device: 0)
    monkeypatch.setattr(pdl, "WAVES", None)
    assert pdl.launches_with_pdl(cpu, append, programs=10**6)
    monkeypatch.setattr(pdl, "WAVES", 1)
    assert pdl.launches_with_pdl(cpu, append, programs=132)
    assert not pdl.launches_with_pdl(cpu, append, programs=133)
    fake = FakeKernel()  # the wrapper counts a grid's programs
    kernel = pdl.pdl_kernel(fake)
    monkeypatch.setattr(pdl, "REUSING_STEP", frozenset({kernel.key}))
    kernel[(2, 66, 1)](torch.zeros(1))
    kernel[(2, 67, 1)](torch.zeros(1))
    monkeypatch.setattr(pdl, "LARGE_GRIDS", "no-early-next")  # past the limit: PDL, the next kernel scheduled late
    assert pdl.launch_mode(cpu, kernel.key, programs=133) == pdl.LATE_NEXT
    kernel[(2, 67, 1)](torch.zeros(1))
    modes = [(kwargs["PDL"], kwargs["launch_pdl"]) for _, _, kwargs in fake.seen]
    assert modes == [(pdl.EARLY_NEXT, True), (pdl.PLAIN, False), (pdl.LATE_NEXT, True)]
    monkeypatch.setattr(pdl, "LARGE_GRIDS", "late")
    with pytest.raises(ValueError, match="LARGE_GRIDS must be one of .'plain', 'no-early-next'.. got 'late'"):
        pdl.launch_mode(cpu, append)


def test_an_unknown_scope_is_an_error(monkeypatch):
    monkeypatch.setattr(pdl, "SCOPE", "everything")
    with pytest.raises(ValueError, match="must be one of .'reusing-step', 'all'.. got 'everything'"):
        pdl.launches_with_pdl(torch.device("cpu"), ("step", "_append_token_kernel"))


def _fake_jit_function():
    pass


class FakeKernel:
    """What ``pdl_kernel`` needs of a jit function: ``fn`` and ``[grid]``; it notes each launch."""

    fn = staticmethod(_fake_jit_function)

    def __init__(self):
        self.seen = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.seen.append((grid, args, kwargs))


def test_a_kernel_is_named_by_its_file_and_can_be_copied():
    import copy

    kernel = pdl.pdl_kernel(FakeKernel())
    assert kernel.key == ("test_pdl", "_fake_jit_function")
    assert copy.copy(kernel).key == kernel.key


def test_a_launch_passes_the_devices_choice(monkeypatch):
    """The wrapper hands the kernel ``PDL`` and Triton ``launch_pdl``, both from the first tensor's device."""
    fake = FakeKernel()
    kernel = pdl.pdl_kernel(fake)
    monkeypatch.setattr(pdl, "launch_mode", lambda device, kernel, programs: int(device.type == "meta"))
    meta, cpu = torch.empty(2, device="meta"), torch.empty(2)
    kernel[(3,)](7, meta, BLOCK=4)
    kernel[(1, 2)](cpu, BLOCK=8)
    assert fake.seen == [((3,), (7, meta), {"PDL": True, "launch_pdl": True, "BLOCK": 4}),
                         ((1, 2), (cpu,), {"PDL": False, "launch_pdl": False, "BLOCK": 8})]
