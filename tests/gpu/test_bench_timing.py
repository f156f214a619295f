"""kvpolicy.bench.timing on a GPU: a replayed graph really runs the captured work.

What is checked is that the captured kernels run, counted on the device; how long they take is
a benchmark's business (benchmarks/, BENCHMARKS.md), never a test's.
"""

import pytest
import torch

from kvpolicy.bench.timing import time_replay_ms

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_replay_timing_runs_the_captured_kernels():
    device = torch.device("cuda")
    counter = torch.zeros((), device=device)
    x = torch.randn(256, 256, device=device)
    out = torch.zeros_like(x)

    def bump():
        counter.add_(1)
        out.copy_(x @ x)

    ms = time_replay_ms(bump, device, repeats=5, warmup=2)
    # 2 warm-up calls, then 1 warm-up replay and 5 timed ones (the capture itself runs nothing)
    assert int(counter.item()) == 2 + 1 + 5
    assert ms > 0
    torch.testing.assert_close(out, x @ x)
