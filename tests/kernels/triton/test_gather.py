"""Triton row gather against the reference, bit for bit, on fresh random inputs.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (conftest turns it
on); with CUDA the same cases run on the GPU, plus the pinned-host-pool cases.
"""

import pytest
import torch

from kvpolicy.kernels import dispatch, reference

from bitwise import random_pool as _random_pool
from bitwise import same_bits as _same_bits

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")



def _gather_rows():
    return dispatch.get("gather_rows", "triton", DEVICE)


def _gather_rows_into():
    return dispatch.get("gather_rows_into", "triton", DEVICE)






@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_rows_is_bit_exact(dtype, dim):
    g = torch.Generator(device=DEVICE).manual_seed(dim)
    batch, heads, cap, rows = 2, 3, 50, 37  # rows: not a multiple of any tile
    pool = _random_pool((batch, heads, cap, dim), dtype, DEVICE, g)
    slots = torch.randint(0, cap, (batch, heads, rows), generator=g, device=DEVICE)  # repeats
    out = _gather_rows()(pool, slots, DEVICE)
    assert out.device == pool.device
    assert _same_bits(out, reference.gather_rows(pool, slots, DEVICE))


def test_gather_rows_takes_strided_inputs_and_odd_dims():
    g = torch.Generator(device=DEVICE).manual_seed(7)
    # a pool whose heads are interleaved in memory, slots transposed, D not a power of two
    pool = _random_pool((2, 40, 3, 48), torch.float32, DEVICE, g).transpose(1, 2)
    slots = torch.randint(0, 40, (2, 5, 3), generator=g, device=DEVICE).transpose(1, 2)
    out = _gather_rows()(pool, slots, DEVICE)
    assert _same_bits(out, reference.gather_rows(pool, slots, DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_into_leaves_skipped_sequences_untouched(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(3)
    batch, heads, cap, rows, dim = 4, 2, 64, 70, 64
    pool = _random_pool((batch, heads, cap, dim), dtype, DEVICE, g)
    slots = torch.randint(0, cap, (batch, heads, rows), generator=g, device=DEVICE)
    take = torch.tensor([True, False, False, True], device=DEVICE)
    sentinel = torch.full((batch, heads, rows, dim), 1234.5, dtype=dtype, device=DEVICE)
    out = sentinel.clone()
    _gather_rows_into()(pool, slots, take, out)
    expected = sentinel.clone()
    reference.gather_rows_into(pool, slots, take, expected)
    assert _same_bits(out, expected)
    assert torch.equal(out[~take], sentinel[~take])

    none = sentinel.clone()
    _gather_rows_into()(pool, slots, torch.zeros(batch, dtype=torch.bool, device=DEVICE), none)
    assert torch.equal(none, sentinel)


def test_empty_gathers():
    pool = torch.randn(2, 2, 8, 16, device=DEVICE)
    out = _gather_rows()(pool, torch.zeros(2, 2, 0, dtype=torch.long, device=DEVICE), DEVICE)
    assert out.shape == (2, 2, 0, 16)


def test_dispatch_reaches_the_triton_ops():
    from kvpolicy.kernels.triton import gather

    assert dispatch.why_unavailable("triton", "gather_rows", DEVICE) is None
    assert dispatch.get("gather_rows", "triton", DEVICE) is gather.gather_rows
    assert dispatch.get("gather_rows_into", "triton", DEVICE) is gather.gather_rows_into


def test_mismatched_out_dtype_is_refused():
    pool = torch.randn(1, 1, 8, 16, device=DEVICE)
    slots = torch.zeros(1, 1, 4, dtype=torch.long, device=DEVICE)
    out = torch.empty(1, 1, 4, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="float16"):
        _gather_rows_into()(pool, slots, torch.ones(1, dtype=torch.bool, device=DEVICE), out)


# ---- CUDA only: a pool in pinned host memory read by the GPU over PCIe -------------------

_HOST_SHAPE = (4, 8, 131072, 128)


@pytest.fixture(scope="module")
def pinned_pool():
    return _random_pool(_HOST_SHAPE, torch.bfloat16, "cpu", torch.Generator(device="cuda").manual_seed(0), pin=True)


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_gather_rows_reads_a_pinned_host_pool(pinned_pool, batch):
    pool = pinned_pool[:batch]  # still pinned: a view of the same allocation
    g = torch.Generator(device="cuda").manual_seed(batch)
    slots = torch.randint(0, pool.shape[2], (batch, 8, 2048), generator=g, device="cuda")
    out = _gather_rows()(pool, slots, torch.device("cuda"))
    assert out.device.type == "cuda"
    assert _same_bits(out, reference.gather_rows(pool, slots.cpu(), torch.device("cpu")))


@needs_cuda
def test_gather_rows_into_from_a_pinned_host_pool(pinned_pool):
    g = torch.Generator(device="cuda").manual_seed(11)
    slots = torch.randint(0, pinned_pool.shape[2], (4, 8, 2048), generator=g, device="cuda")
    take = torch.tensor([False, True, True, False], device="cuda")
    sentinel = torch.full((4, 8, 2048, 128), -7.0, dtype=torch.bfloat16, device="cuda")
    out = sentinel.clone()
    _gather_rows_into()(pinned_pool, slots, take, out)
    rows = reference.gather_rows(pinned_pool, slots.cpu(), torch.device("cpu")).cuda()
    assert _same_bits(out[take], rows[take])
    assert torch.equal(out[~take], sentinel[~take])


@needs_cuda
def test_pinned_gather_replays_in_a_cuda_graph(pinned_pool):
    slots = torch.zeros(4, 8, 512, dtype=torch.long, device="cuda")
    take = torch.ones(4, dtype=torch.bool, device="cuda")
    out = torch.zeros(4, 8, 512, 128, dtype=torch.bfloat16, device="cuda")
    _gather_rows_into()(pinned_pool, slots, take, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _gather_rows_into()(pinned_pool, slots, take, out)
    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        slots.copy_(torch.randint(0, pinned_pool.shape[2], slots.shape, generator=g, device="cuda"))
        take.copy_(torch.tensor([True, seed == 0, True, False], device="cuda"))
        before = out.clone()
        graph.replay()
        expected = before.clone()
        reference.gather_rows_into(pinned_pool, slots, take, expected)
        assert _same_bits(out, expected)


@needs_cuda
def test_pageable_host_pool_is_refused():
    pool = torch.randn(1, 2, 16, 64)
    slots = torch.zeros(1, 2, 4, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        _gather_rows()(pool, slots, torch.device("cuda"))
