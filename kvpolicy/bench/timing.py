"""Device timing: CUDA events around a callable, median over repeats."""

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
