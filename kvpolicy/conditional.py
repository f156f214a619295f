"""Work a captured decode step skips when the device says so (CUDA graph conditional nodes).

A CUDA graph replays the same kernels every time, so without help a step that does not
re-select would still score every unit and sort them (measured on the H200 at 4 x 128K: 5 of
the 23 ms of kernel time per replayed step went to selection, mostly on steps whose result was
thrown away). A conditional IF node (CUDA 12.4+, exposed by PyTorch as
``CUDAGraph.begin_capture_to_if_node``) runs its body only when a device boolean is true at
replay time: the trigger's decision stays on the device and no host sync is needed.

Outside capture (eager steps, CPU, emulated replay) the body simply runs: its work is already
masked per sequence, so running it is correct, only slower.
"""

from __future__ import annotations

import contextlib

import torch


def conditional_nodes_supported() -> bool:
    """Whether this PyTorch build can capture a body into a conditional graph node."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return False
    version = torch.version.cuda or "0.0"
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) >= (12, 4)


@contextlib.contextmanager
def only_if(pred: torch.Tensor):
    """Run the ``with`` body only where the 0-dim bool ``pred`` is true at replay, when captured.

    The body must be correct to run whatever ``pred`` is (it runs eagerly, always), and must not
    produce anything read after the block when ``pred`` is false.
    """
    if pred.is_cuda and torch.cuda.is_current_stream_capturing() and conditional_nodes_supported():
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(pred)
        try:
            yield
        finally:
            graph.end_capture_to_conditional_node()
    else:
        yield
