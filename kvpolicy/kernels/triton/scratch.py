"""Self-clearing scratch: zeroed int32 device buffers kept across calls, which the kernels that
use them leave zeroed again, so a decode step launches no fill for them.

A kernel family that needs a zeroed buffer (a histogram of atomic adds, a ticket counting the
programs done) takes one from ``zeroed``: made once per (device, name, shape), zero. The launch
that reads it last puts the zeros back (its last program, found by an atomic ticket), so the next
call finds it zeroed. Calls sharing a buffer must run one after another on one stream, as a
model's layers and decode steps do (eager or replayed): two streams running the same op at once
would share it.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _zeroed(device: torch.device, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    # made under a capture, its zeroing would be a node of that graph only: an eager call (or
    # another graph) before the first replay would find it unset. Made by the eager step that
    # precedes a capture (kvpolicy.graph's first step, the benchmarks' warm-ups)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"kvpolicy scratch {name!r} {shape}: first used inside a CUDA graph capture; "
                           f"run the step once eagerly before capturing it")
    # made outside inference mode, as the cached tables are: later steps use it in place
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=torch.int32, device=device)


def zeroed(device: torch.device, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The zeroed int32 buffer ``name`` of ``shape`` on ``device`` (made on first use; its users
    keep it zeroed)."""
    return _zeroed(torch.device(device), name, tuple(int(size) for size in shape))
