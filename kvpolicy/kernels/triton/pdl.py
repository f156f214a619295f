"""Programmatic dependent launch (PDL) for the library's Triton kernels.

A decode step is a chain of small dependent launches (a reusing step about ten a layer: the token's
writes, the trigger's stages, the attention's split and combine; pariskv's selection about fifteen more).
In a replayed graph each pays the gap between the end of the kernel before it and its own start.
Launched with PDL (sm_90 and later: Triton's ``launch_pdl``), a kernel is scheduled while the one
before it still runs, and its first act is to wait for that kernel to finish (``griddepcontrol.wait``),
so it reads only finished results: the saving is the launch gap, not the order. Session 32 (H100,
1x128K): the louiskv preset's reusing step 0.19 ms faster, its trigger's row from 22.5% to 20.0% over
the budget floor (BENCHMARKS.md).

The contract, which ``tests/kernels/triton/test_pdl.py`` checks of every kernel here: a kernel is
declared ``@pdl_kernel`` over ``@triton.jit``, takes ``PDL: tl.constexpr`` last, and its first statement
is ``wait_for_previous(PDL)``: on every program, before any load and before any early return. A kernel
that skipped the wait could finish before the one ahead of it, and the kernel after it would then wait on
the wrong one: the order holds only because each link waits. (Each kernel lets the next be scheduled
before it waits itself, so a PDL kernel from outside the library launched next must wait before its own
work too.)

Which kernels launch with PDL (``SCOPE``): by default those of a reusing step (``REUSING_STEP``), the ones
whose GPU tests and end-to-end timing ran with it on (session 32, H100). ``SCOPE = "all"`` launches every
kernel so: the GPU tests that ran that way passed (session 33, H100: about 96% of the folder; the one failure
was a test that assumed the default scope), but it made a re-selecting step slower (louiskv at 1x128K, every
step re-selecting, one wave: 10.72 ms against 10.62 with the default scope), so it is not the default. The
environment variable ``KVPOLICY_PDL_SCOPE`` sets it for a process:
``KVPOLICY_PDL_SCOPE=all python3 -m pytest tests/kernels/triton``.

Launches are plain for a grid of more programs than ``WAVES`` waves of the device's SMs (below), on anything
but a CUDA device of compute capability 9 or more, under Triton's interpreter (``TRITON_INTERPRET=1``: it has
no grid dependency control), inside a conditional node's body (``graph_branch``: PDL there is untried), and
with ``ENABLED`` False, for a side-by-side run:
``benchmarks/with_settings.py kvpolicy.kernels.triton.pdl.ENABLED=False -- ...``.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ... import graph_branch

ENABLED = True
SCOPES = ("reusing-step", "all")
SCOPE = os.environ.get("KVPOLICY_PDL_SCOPE", "reusing-step")  # checked at each launch
# (file, kernel) of the kernels a reusing step launches (with PDL wherever they run, a re-selecting step's
# attention too): the token's append to the pool and ring, the score-gap trigger's stages, the decode unit
# append, the attention's split and combine
REUSING_STEP = frozenset({
    ("step", "_append_token_kernel"), ("score_gap", "_follow_kernel"), ("score_gap", "_gap_blocks_kernel"),
    ("score_gap", "_row_parts_kernel"), ("score_gap", "_decide_kernel"),
    ("score_gap_outlier", "_outlier_gap_blocks_kernel"), ("score_gap_outlier", "_between_kernel"),
    ("unit_append", "_append_kernel"), ("attention", "_split_kernel"), ("attention", "_combine_kernel"),
})


# A launch of more programs than ``WAVES`` times the device's SMs stays plain (None: no limit). With no
# limit, full attention at 1x128K ran 0.14-0.17 ms a step slower with PDL than without, in three runs
# (sessions 32 and 33, H100: its split is sized to fill the device, so, a guess not yet measured, the
# combine's programs scheduled early and waiting take slots from it); at one wave it ran as without PDL,
# and the preset's reusing step kept most of PDL's gain (10.03 ms off, 9.91 at one wave, 9.81 with no
# limit: BENCHMARKS.md, session 33).
WAVES: float | None = 1
# What a launch past ``WAVES`` does: "plain", or "no-early-next": launched with PDL (it may be scheduled behind
# a small kernel still running) but without letting the kernel after it be scheduled before it ends, so no
# waiting program takes a slot it would use. "no-early-next" would keep PDL's start for the trigger's blocks
# kernel (1,024 programs at 1x128K), which one wave makes plain; not yet run on a GPU, so not the default.
LARGE_GRIDS = "plain"
LARGE_GRID_CHOICES = ("plain", "no-early-next")
# a launch's mode, the kernels' ``PDL``: plain; with PDL, letting the next kernel be scheduled at its start;
# with PDL, the next kernel scheduled when it ends
PLAIN, EARLY_NEXT, LATE_NEXT = 0, 1, 2


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def supported(device: torch.device) -> bool:
    """Whether launches on ``device`` can be programmatic (a CUDA device of sm_90 or later)."""
    if device.type != "cuda":
        return False
    return _capability_major(_index(device)) >= 9


def fits_waves(device: torch.device, programs: int) -> bool:
    """Whether a grid of ``programs`` is small enough for PDL on ``device`` (``WAVES``)."""
    return WAVES is None or programs <= WAVES * _multiprocessors(_index(device))


def launch_mode(device: torch.device, kernel: tuple[str, str], programs: int = 1) -> int:
    """How a launch of ``kernel`` (its file's name, its own) over ``programs`` programs on ``device`` made
    now goes: ``PLAIN``, ``EARLY_NEXT`` or ``LATE_NEXT``."""
    if SCOPE not in SCOPES:
        raise ValueError(f"kernels.triton.pdl.SCOPE must be one of {SCOPES}, got {SCOPE!r}")
    if LARGE_GRIDS not in LARGE_GRID_CHOICES:
        raise ValueError(f"kernels.triton.pdl.LARGE_GRIDS must be one of {LARGE_GRID_CHOICES}, got {LARGE_GRIDS!r}")
    if not (ENABLED and supported(device)) or graph_branch.in_conditional_body():
        return PLAIN
    if os.environ.get("TRITON_INTERPRET") == "1" or not (SCOPE == "all" or kernel in REUSING_STEP):
        return PLAIN
    if fits_waves(device, programs):
        return EARLY_NEXT
    return LATE_NEXT if LARGE_GRIDS == "no-early-next" else PLAIN


def launches_with_pdl(device: torch.device, kernel: tuple[str, str], programs: int = 1) -> bool:
    """Whether that launch is programmatic (``launch_mode`` not ``PLAIN``)."""
    return launch_mode(device, kernel, programs) != PLAIN


class pdl_kernel:  # noqa: N801 (used as a decorator, like triton.jit)
    """A ``@triton.jit`` kernel whose launches pass ``PDL`` (``launch_mode`` on the device of the first
    tensor argument) and ``launch_pdl``. Anything else is the kernel's own (``.fn``); a direct ``.run`` or
    ``.warmup`` must pass ``PDL`` itself."""

    def __init__(self, kernel):
        self.kernel = kernel
        functools.update_wrapper(self, kernel.fn)
        self.key = (kernel.fn.__module__.rpartition(".")[2], kernel.fn.__name__)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def launch_with_pdl(*args, **kwargs):
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            programs = math.prod(grid) if isinstance(grid, tuple) else grid
            mode = PLAIN if device is None else launch_mode(device, self.key, programs)
            return launch(*args, PDL=mode, launch_pdl=mode != PLAIN, **kwargs)

        return launch_with_pdl

    def __getattr__(self, name):
        if name == "kernel":  # not set yet (a copy being made): no recursion through the lookup below
            raise AttributeError(name)
        return getattr(self.kernel, name)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A ``pdl_kernel``'s first statement: let the next kernel be scheduled (``EARLY_NEXT``), then wait until
    the one before has finished and its writes are visible. Nothing when ``PLAIN``."""
    if PDL:
        if PDL == 1:  # EARLY_NEXT (a constexpr here: the module's names are not)
            gdc_launch_dependents()
        gdc_wait()
