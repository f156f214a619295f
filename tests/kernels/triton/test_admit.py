"""Triton ``admit_row`` against the reference: the token leaving the local window joins the
retrieved buffer of each (sequence, head) with room.

Random buffers (fill counts from empty to full, masked and invalid sequences) are stepped by
both backends from the same start; every mutated tensor must match bit for bit. Then
``TieredStore.admit`` through each backend, and a full buffer that admits nothing.
"""

from __future__ import annotations

import pytest
import torch
from bitwise import random_pool, same_bits

from kvpolicy.kernels import dispatch, reference
from kvpolicy.store import TieredStore
from kvpolicy.tiers import Evicted, RetrievedBuffer

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
FIELDS = ("keys", "values", "slots", "valid", "held", "fill")  # of a RetrievedBuffer


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return same_bits(a, b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _random_buffers(batch, heads, rows, dim, dtype, gen, fill_max=None):
    cpu = torch.device("cpu")
    return {
        "keys": random_pool((batch, heads, rows, dim), dtype, cpu, gen),
        "values": random_pool((batch, heads, rows, dim), dtype, cpu, gen),
        "slots": torch.randint(0, 1000, (batch, heads, rows), generator=gen),
        "valid": torch.rand(batch, heads, rows, generator=gen) > 0.5,
        "held": torch.rand(batch, heads, rows, generator=gen) > 0.5,
        # from empty to full, per (sequence, head)
        "fill": torch.randint(0, (rows if fill_max is None else fill_max) + 1, (batch, heads), generator=gen),
    }


def _admit_both(ref, tri, key, value, slot, reselected, token_valid):
    reference.admit_row(RetrievedBuffer(**ref), Evicted(slot, key, value, token_valid), reselected)
    admit = dispatch.get("admit_row", "triton", DEVICE)
    evicted = Evicted(slot.to(DEVICE), key.to(DEVICE), value.to(DEVICE), token_valid.to(DEVICE))
    admit(RetrievedBuffer(**tri), evicted, reselected.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,heads,rows,dim", [(3, 8, 6, 128), (2, 3, 5, 64), (1, 2, 1, 48), (2, 4, 9, 256)])
def test_admit_row_matches_reference(dtype, batch, heads, rows, dim):
    gen = torch.Generator().manual_seed(batch * 1000 + heads * 100 + rows * 10 + dim)
    ref = _random_buffers(batch, heads, rows, dim, dtype, gen)
    tri = {f: t.clone().to(DEVICE) for f, t in ref.items()}
    for step in range(5):
        key = random_pool((batch, heads, dim), dtype, torch.device("cpu"), gen)
        value = random_pool((batch, heads, dim), dtype, torch.device("cpu"), gen)
        if step == 1:  # non-contiguous rows
            key = random_pool((batch, dim, heads), dtype, torch.device("cpu"), gen).transpose(1, 2)
        reselected = torch.rand(batch, generator=gen) < 0.3
        token_valid = torch.rand(batch, generator=gen) > 0.3
        slot = torch.randint(0, 5000, (), generator=gen)
        _admit_both(ref, tri, key, value, slot, reselected, token_valid)
        for name in FIELDS:
            assert _same(tri[name], ref[name]), f"step {step}: {name} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_admit_row_into_full_buffers_changes_nothing(dtype):
    gen = torch.Generator().manual_seed(7)
    ref = _random_buffers(2, 3, 4, 64, dtype, gen)
    ref["fill"].fill_(4)
    before = {f: t.clone() for f, t in ref.items()}
    tri = {f: t.clone().to(DEVICE) for f, t in ref.items()}
    yes = torch.ones(2, dtype=torch.bool)
    key, value = torch.randn(2, 2, 3, 64, generator=gen).to(dtype)
    _admit_both(ref, tri, key, value, torch.tensor(123), ~yes, yes)
    for name in FIELDS:
        assert _same(tri[name], before[name]), name
        assert _same(ref[name], before[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_admit_backends_agree(dtype):
    gen = torch.Generator().manual_seed(11)
    batch, heads, prompt, dim, local, retrieval = 2, 2, 30, 64, 4, 8
    keys = torch.randn(batch, heads, prompt, dim, generator=gen).to(dtype)
    values = torch.randn(batch, heads, prompt, dim, generator=gen).to(dtype)
    valid = torch.ones(batch, prompt, dtype=torch.bool)
    valid[1, :3] = False
    stores = {}
    for backend in ("reference", "triton"):
        device = torch.device("cpu") if backend == "reference" else DEVICE
        stores[backend] = TieredStore.from_prefill(keys.to(device), values.to(device), valid.to(device), 2, local,
                                                   retrieval, device)
    for step in range(10):  # the buffers fill up part way through
        key, value = torch.randn(2, batch, heads, dim, generator=gen).to(dtype)
        reselected = torch.tensor([False, step % 3 == 0])
        for backend, store in stores.items():
            device = store.retrieved.keys.device
            evicted = store.append(key.to(device), value.to(device), "reference")
            store.admit(evicted, reselected.to(device), backend)
    ref, tri = stores["reference"], stores["triton"]
    for name in FIELDS:
        assert _same(getattr(tri.retrieved, name), getattr(ref.retrieved, name)), name
    assert (ref.retrieved.fill == retrieval).any() and (ref.retrieved.fill < retrieval).any()


def test_store_admit_without_a_retrieved_buffer_is_a_no_op():
    keys = torch.randn(1, 2, 12, 16)
    store = TieredStore.from_prefill(keys, keys.clone(), torch.ones(1, 12, dtype=torch.bool), 2, 4, 0, keys.device)
    evicted = store.append(torch.randn(1, 2, 16), torch.randn(1, 2, 16), "reference")
    store.admit(evicted, torch.zeros(1, dtype=torch.bool), "triton")
    assert store.retrieved.fill.shape == (1, 2) and int(store.retrieved.fill.sum()) == 0


def test_admit_row_refuses_mismatched_buffers():
    admit = dispatch.get("admit_row", "triton", DEVICE)
    gen = torch.Generator().manual_seed(0)
    bufs = {f: t.to(DEVICE) for f, t in _random_buffers(2, 3, 4, 16, torch.float32, gen).items()}
    bufs["fill"] = bufs["fill"][:1]
    flag = torch.ones(2, dtype=torch.bool, device=DEVICE)
    row = torch.zeros(2, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="buffer.fill must be"):
        admit(RetrievedBuffer(**bufs), Evicted(torch.tensor(0, device=DEVICE), row, row, flag), flag)


# -- admit="evict": a full buffer gives up its lowest-ranked selected row ----------------------


def _admit_both_evicting(ref, tri, counters, key, value, slot, reselected, token_valid):
    kept, admitted = counters["ref"]
    reference.admit_row(RetrievedBuffer(**ref), Evicted(slot, key, value, token_valid), reselected, kept, admitted)
    admit = dispatch.get("admit_row", "triton", DEVICE)
    evicted = Evicted(slot.to(DEVICE), key.to(DEVICE), value.to(DEVICE), token_valid.to(DEVICE))
    admit(RetrievedBuffer(**tri), evicted, reselected.to(DEVICE), *counters["tri"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,heads,rows,dim", [(3, 8, 6, 128), (2, 3, 5, 64), (1, 2, 1, 48)])
def test_admit_row_evicting_matches_reference(dtype, batch, heads, rows, dim):
    # fresh random inputs each run: full and part-full buffers, kept from 0 to full, re-selections
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref = _random_buffers(batch, heads, rows, dim, dtype, gen)
    ref["fill"][0] = rows  # at least one sequence starts full
    kept = torch.minimum(torch.randint(0, rows + 1, (batch, heads), generator=gen), ref["fill"])
    admitted = torch.randint(0, 50, (batch, heads), generator=gen)
    tri = {f: t.clone().to(DEVICE) for f, t in ref.items()}
    counters = {"ref": (kept, admitted), "tri": (kept.clone().to(DEVICE), admitted.clone().to(DEVICE))}
    for step in range(2 * rows + 3):
        key = random_pool((batch, heads, dim), dtype, torch.device("cpu"), gen)
        value = random_pool((batch, heads, dim), dtype, torch.device("cpu"), gen)
        reselected = torch.rand(batch, generator=gen) < 0.2
        token_valid = torch.rand(batch, generator=gen) > 0.2
        slot = torch.randint(0, 5000, (), generator=gen)
        _admit_both_evicting(ref, tri, counters, key, value, slot, reselected, token_valid)
        for name in FIELDS:
            assert _same(tri[name], ref[name]), f"step {step}: {name} differs"
        for got, want, name in zip(counters["tri"], counters["ref"], ("kept", "admitted")):
            assert _same(got, want), f"step {step}: {name} differs"


def test_admit_row_evicts_lowest_ranked_rows_then_stops():
    # one (sequence, head), a full buffer of 3 selected rows (slots 10, 11, 12 in score order)
    buffer = RetrievedBuffer(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), torch.ones(1, 1, 3, dtype=torch.bool),
                             slots=torch.tensor([[[10, 11, 12]]]), held=torch.ones(1, 1, 3, dtype=torch.bool),
                             fill=torch.tensor([[3]]))
    kept, admitted = torch.tensor([[3]]), torch.tensor([[0]])
    yes = torch.ones(1, dtype=torch.bool)
    for slot in (20, 21, 22, 23):
        token = torch.full((1, 1, 2), float(slot))
        reference.admit_row(buffer, Evicted(torch.tensor(slot), token, token, yes), ~yes, kept, admitted)
    # the lowest-ranked row goes first; once every selected row is replaced, nothing more is kept
    assert buffer.slots.tolist() == [[[22, 21, 20]]]
    assert buffer.keys[0, 0, :, 0].tolist() == [22.0, 21.0, 20.0]
    assert kept.tolist() == [[0]] and admitted.tolist() == [[3]] and buffer.fill.tolist() == [[3]]
    # a re-selection restarts kept from the buffer's fill, and admits nothing
    reference.admit_row(buffer, Evicted(torch.tensor(30), token, token, yes), yes, kept, admitted)
    assert kept.tolist() == [[3]] and admitted.tolist() == [[3]] and buffer.slots.tolist() == [[[22, 21, 20]]]
    # without kept (admit="room") a full buffer drops the token
    reference.admit_row(buffer, Evicted(torch.tensor(31), token, token, yes), ~yes, None, admitted)
    assert buffer.slots.tolist() == [[[22, 21, 20]]] and admitted.tolist() == [[3]]
