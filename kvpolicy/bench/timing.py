"""Device timing: CUDA events around a callable (or its CUDA-graph replay), median over repeats."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()``; CUDA events on a GPU (including launch gaps), wall clock on CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - started))
    return statistics.median(samples)


def time_replay_ms(fn: Callable[[], object], device: torch.device, repeats: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of one replay of ``fn`` captured as a CUDA graph: the device time of its
    kernels without the host's launch gaps, as a graph-replayed decode step runs them.

    ``fn`` must be capturable (no host syncs); a capture error propagates, it does not fall back
    to eager timing. CUDA only.
    """
    if device.type != "cuda":
        raise ValueError(f"time_replay_ms needs a CUDA device, got {device}; time eagerly with time_ms on the CPU")
    # warm up on a side stream, as capture requires (lazy inits, Triton compiles)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, device, repeats, warmup=1)
