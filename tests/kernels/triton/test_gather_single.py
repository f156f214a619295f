"""``gather_single_rows_into`` (kernels/triton/gather_single.py) against the reference gather.

Fresh random pools and slots each case: every schedule (rows a program, warps, spread, sort)
must give exactly the reference's rows, leave sequences with ``take`` False untouched, and refuse
bad input clearly. Without CUDA the kernel runs through Triton's interpreter (conftest); with
CUDA, also from a pinned host pool at a decode's size.
"""

import pytest
import torch

from kvpolicy.kernels import reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _single():
    from kvpolicy.kernels.triton.gather_single import gather_single_rows_into

    return gather_single_rows_into


def _case(seed, batch, heads, cap, dim, count, dtype=torch.float32, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(batch, heads, cap, dim, generator=gen).to(dtype).to(device)
    # distinct slots per (sequence, head) in random order, as a selection's (and repeats allowed
    # by the op: one case draws with replacement)
    slots = torch.stack([torch.stack([torch.randperm(cap, generator=gen)[:count] for _ in range(heads)])
                         for _ in range(batch)]).to(device)
    return pool, slots


@pytest.mark.parametrize("rows,warps,spread,sort,programs", [
    (1, 1, False, False, None), (4, 1, False, False, None), (16, 4, False, False, None), (64, 4, False, False, None),
    (4, 2, True, False, None), (16, 4, True, True, None), (8, 1, False, True, None),
    # persistent walks: fewer programs than tiles (each loops), more (clipped), with sort
    (4, 1, False, False, 3), (8, 2, False, True, 5), (16, 4, False, False, 1000),
])
@pytest.mark.parametrize("dim", [16, 24])  # 24: a row narrower than its power-of-two block
def test_matches_reference(rows, warps, spread, sort, programs, dim):
    seed = torch.seed() % (1 << 31)
    pool, slots = _case(seed, batch=3, heads=2, cap=97, dim=dim, count=37)
    take = torch.tensor([True, False, True], device=DEVICE)
    sentinel = torch.full((3, 2, 37, dim), -3.5, device=DEVICE)
    out = sentinel.clone()
    _single()(pool, slots, take, out, rows=rows, warps=warps, spread=spread, sort=sort, programs=programs)
    expected = reference.gather_rows(pool, slots, DEVICE)
    assert torch.equal(out[0], expected[0]), f"seed {seed}"
    assert torch.equal(out[2], expected[2]), f"seed {seed}"
    assert torch.equal(out[1], sentinel[1]), f"seed {seed}: a sequence with take False was written"


def test_repeated_slots_and_no_take():
    seed = torch.seed() % (1 << 31)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, 3, 50, 16, generator=gen).to(DEVICE)
    slots = torch.randint(0, 50, (2, 3, 70), generator=gen).to(DEVICE)  # more rows than the pool: repeats
    out = torch.zeros(2, 3, 70, 16, device=DEVICE)
    _single()(pool, slots, None, out, rows=16, warps=4, sort=True)
    assert torch.equal(out, reference.gather_rows(pool, slots, DEVICE)), f"seed {seed}"


def test_bad_input_is_refused():
    gather = _single()
    pool, slots = _case(0, batch=1, heads=2, cap=40, dim=16, count=8)
    out = torch.empty(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="shapes do not match"):
        gather(pool, slots[:, :1], None, out)
    with pytest.raises(ValueError, match="out is"):
        gather(pool, slots, None, out.double())
    with pytest.raises(ValueError, match="rows must be a power of two"):
        gather(pool, slots, None, out, rows=3)
    with pytest.raises(ValueError, match="warps must be a power of two"):
        gather(pool, slots, None, out, warps=64)
    with pytest.raises(ValueError, match="slots must be integers"):
        gather(pool, slots.float(), None, out)
    with pytest.raises(ValueError, match="programs must be None or a positive int"):
        gather(pool, slots, None, out, programs=0)
    with pytest.raises(ValueError, match="spread does not apply"):
        gather(pool, slots, None, out, programs=4, spread=True)
    with pytest.raises(ValueError, match="take must have 1 entries"):
        gather(pool, slots, torch.ones(2, dtype=torch.bool, device=DEVICE), out)


@needs_cuda
@pytest.mark.parametrize("rows,warps,spread,programs", [(4, 1, False, None), (16, 4, True, None), (64, 4, False, None),
                                                  (16, 4, False, 264)])
def test_pinned_pool_at_decode_size(rows, warps, spread, programs):
    from kvpolicy.pinned import pinned_empty

    seed = torch.seed() % (1 << 31)
    host, slots = _case(seed, batch=2, heads=8, cap=1 << 15, dim=128, count=1980, dtype=torch.bfloat16, device="cpu")
    pool = pinned_empty(tuple(host.shape), torch.bfloat16)
    pool.copy_(host)
    slots = slots.sort(-1).values.cuda()
    out = torch.empty(2, 8, 1980, 128, dtype=torch.bfloat16, device="cuda")
    _single()(pool, slots, torch.ones(2, dtype=torch.bool, device="cuda"), out, rows=rows, warps=warps, spread=spread,
              programs=programs)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference.gather_rows(host, slots.cpu(), torch.device("cpu"))), f"seed {seed}"


@needs_cuda
def test_pageable_pool_is_refused():
    pool = torch.zeros(1, 1, 8, 16)
    out = torch.empty(1, 1, 2, 16, device="cuda")
    with pytest.raises(ValueError, match="pageable"):
        _single()(pool, torch.zeros(1, 1, 2, dtype=torch.long, device="cuda"), None, out)
