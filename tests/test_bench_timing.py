"""kvpolicy.bench.timing on a GPU: a replayed graph really runs the captured work."""

import pytest
import torch

from kvpolicy.bench.timing import time_replay_ms

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_replay_timing_runs_the_captured_kernels_and_grows_with_their_work():
    device = torch.device("cuda")
    counter = torch.zeros((), device=device)
    small = torch.randn(256, 256, device=device)
    large = torch.randn(4096, 4096, device=device)

    def bump(x):
        counter.add_(1)
        return x @ x

    small_ms = time_replay_ms(lambda: bump(small), device, repeats=5, warmup=2)
    runs = int(counter.item())
    # 2 warm-up calls, then 1 warm-up replay and 5 timed ones (the capture itself runs nothing)
    assert runs == 2 + 1 + 5
    large_ms = time_replay_ms(lambda: bump(large), device, repeats=5, warmup=2)
    assert large_ms > small_ms > 0
