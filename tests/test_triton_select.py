"""Triton budget fill against the reference: exactly equal outputs on fresh random inputs.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (conftest turns it
on); with CUDA the same cases run on the GPU, plus decode-sized ones.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.kernels import dispatch, reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _select_budget():
    return dispatch.get("select_budget", "triton", DEVICE)


def _random_units(batch, heads, units, tokens, max_size, seed, p_inf=0.15, p_empty=0.1, levels=None):
    """Scores (ties when ``levels`` is set, some -inf), sizes (some 0), starts and orders."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (batch, heads, units)
    if levels is None:
        scores = torch.randn(shape, generator=g, device=DEVICE)
    else:
        scores = torch.randint(0, levels, shape, generator=g, device=DEVICE).float()
    scores = scores.masked_fill(torch.rand(shape, generator=g, device=DEVICE) < p_inf, float("-inf"))
    sizes = torch.randint(1, max_size + 1, shape, generator=g, device=DEVICE)
    sizes = sizes.masked_fill(torch.rand(shape, generator=g, device=DEVICE) < p_empty, 0).clamp(max=tokens)
    starts = (torch.rand(shape, generator=g, device=DEVICE) * (tokens - sizes + 1)).long()
    order = torch.argsort(torch.rand(batch, heads, tokens, generator=g, device=DEVICE), dim=-1)
    return scores, sizes, starts, order


def _check(scores, sizes, starts, order, capacity):
    got = _select_budget()(scores, sizes, starts, order, capacity)
    want = reference.select_budget(scores, sizes, starts, order, capacity)
    for name, a, b in zip(("unit_ids", "num_units", "slots", "slot_valid"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    return got


@pytest.mark.parametrize(
    "batch, heads, units, tokens, max_size, capacity, levels",
    [
        (2, 3, 40, 300, 12, 64, None),  # budget cut inside a unit
        (1, 2, 30, 200, 9, 1000, None),  # budget larger than all tokens
        (2, 2, 50, 400, 8, 37, 3),  # many ties
        (1, 1, 12, 500, 400, 100, None),  # units larger than the budget
        (2, 2, 1500, 4000, 6, 1100, 50),  # several blocks of units and of positions
    ],
)
def test_select_budget_matches_reference(batch, heads, units, tokens, max_size, capacity, levels):
    seed = units * 7 + capacity
    _check(*_random_units(batch, heads, units, tokens, max_size, seed, levels=levels), capacity)


def test_a_large_top_unit_fills_the_whole_budget():
    scores = torch.tensor([[[0.5, 3.0, 1.0]]], device=DEVICE)
    sizes = torch.tensor([[[4, 50, 4]]], device=DEVICE)
    starts = torch.tensor([[[0, 4, 54]]], device=DEVICE)
    order = torch.arange(58, device=DEVICE).flip(0).view(1, 1, 58)
    unit_ids, num_units, slots, valid = _check(scores, sizes, starts, order, 16)
    assert unit_ids.tolist() == [[[1, -1, -1]]] and num_units.item() == 1
    assert valid.all() and slots.tolist() == [[list(range(53, 37, -1))]]


def test_nothing_selectable_leaves_an_empty_budget():
    scores = torch.full((2, 1, 5), float("-inf"), device=DEVICE)
    sizes = torch.full((2, 1, 5), 3, device=DEVICE)
    starts = torch.arange(0, 15, 3, device=DEVICE).expand(2, 1, 5)
    order = torch.arange(15, device=DEVICE).expand(2, 1, 15)
    unit_ids, num_units, _, valid = _check(scores, sizes, starts, order, 8)
    assert (unit_ids == -1).all() and (num_units == 0).all() and not valid.any()


def test_zero_capacity_and_nan_scores():
    scores, sizes, starts, order = _random_units(1, 2, 20, 100, 5, seed=5)
    scores[0, 0, :3] = float("nan")  # sorts first, never selectable (as in the reference)
    _check(scores, sizes, starts, order, 0)
    _check(scores, sizes, starts, order, 25)


def test_dispatch_reaches_the_triton_op():
    from kvpolicy.kernels.triton import select

    assert dispatch.why_unavailable("triton", "select_budget", DEVICE) is None
    assert dispatch.get("select_budget", "triton", DEVICE) is select.select_budget


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    units=st.integers(1, 70),
    max_size=st.integers(1, 40),
    capacity=st.integers(0, 300),
    levels=st.sampled_from([None, 2, 5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_budget_property(batch, heads, units, max_size, capacity, levels, seed):
    _check(*_random_units(batch, heads, units, 600, max_size, seed, levels=levels), capacity)


# ---- CUDA only: decode-sized problems --------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("levels", [None, 20])
@pytest.mark.parametrize("max_size", [1, 16, 64])
def test_select_budget_at_decode_sizes(levels, max_size):
    inputs = _random_units(4, 8, 8192, 131072, max_size, seed=max_size, levels=levels)
    _check(*inputs, 2048)
    _check(*inputs, 4096)


@needs_cuda
def test_select_budget_replays_in_a_cuda_graph():
    scores, sizes, starts, order = _random_units(4, 8, 8192, 65536, 16, seed=1)
    fill = _select_budget()
    fill(scores, sizes, starts, order, 2048)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fill(scores, sizes, starts, order, 2048)
    fresh = _random_units(4, 8, 8192, 65536, 16, seed=2)
    for dst, src in zip((scores, sizes, starts, order), fresh):
        dst.copy_(src)
    graph.replay()
    want = reference.select_budget(scores, sizes, starts, order, 2048)
    for a, b in zip(outs, want):
        assert torch.equal(a, b)
