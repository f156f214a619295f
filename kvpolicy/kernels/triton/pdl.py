"""Programmatic dependent launch (PDL) for the reusing step's chain of small Triton kernels.

A reusing step runs about ten small dependent launches a layer (the token's writes, the trigger's
stages, the attention's split and combine). In a replayed graph each pays the gap between the end of
the kernel before it and its own start. Launched with PDL (sm_90 and later: Triton's ``launch_pdl``),
a kernel is scheduled while the one before it still runs. Its first act is to wait for that kernel to
finish (``griddepcontrol.wait``), so it reads only finished results: the saving is the launch gap, not
the order.

Every kernel launched this way waits before it touches memory, on every program, including programs
that return early. A kernel that skipped the wait could finish before the one ahead of it, and the
kernel after it would then wait on the wrong one: the order is kept only because each link waits.

``ENABLED`` turns it off for a side-by-side run (``benchmarks/with_settings.py
kvpolicy.kernels.triton.pdl.ENABLED=False -- ...``). Off a GPU of compute capability 9 or more, and
under Triton's interpreter, launches are plain.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def supported(device: torch.device) -> bool:
    """Whether launches on ``device`` can be programmatic (a CUDA device of sm_90 or later)."""
    if device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def launch_args(device: torch.device) -> dict:
    """The keywords of a launch on ``device``: the kernel's ``PDL`` and Triton's ``launch_pdl``."""
    on = ENABLED and supported(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: let the next kernel be scheduled, then wait until the
    one before has finished and its writes are visible. Nothing without ``PDL``."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
