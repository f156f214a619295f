"""Triton ``append_to_unit`` against the reference: one leaving token filed in a ``UnitTable``.

Random table states (open units or none, cuts and padding mixed per sequence) are stepped by
both backends from the same start; every tensor the op mutates must match exactly (the float32
key statistics bit for bit). Then whole tables built by ``UnitTable.append_leaving_token``
through each backend must agree.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpolicy.kernels import dispatch, reference
from kvpolicy.units import Pages, Segments
from kvpolicy.units.table import UnitTable

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
FIELDS = ("order", "start", "size", "key_sum", "key_min", "key_max", "key_mean", "selectable", "open_unit",
          "decode_units")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32 and b.dtype == torch.float32:  # bit for bit: -0.0 and 0.0 differ, infs compare
        a, b = a.view(torch.int32), b.view(torch.int32)
    if a.dtype == torch.float16 and b.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _random_state(batch, heads, dim, prompt_units, gen):
    units = prompt_units + 12
    n = 40
    state = {
        "order": torch.randint(0, 1000, (batch, heads, n), generator=gen),
        "start": torch.randint(0, n, (batch, heads, units), generator=gen),
        "size": torch.randint(0, 9, (batch, heads, units), generator=gen),
        "key_sum": torch.randn(batch, heads, units, dim, generator=gen) * 4,
        "key_min": torch.randn(batch, heads, units, dim, generator=gen) - 1,
        "key_max": torch.randn(batch, heads, units, dim, generator=gen) + 1,
        "selectable": torch.rand(batch, heads, units, generator=gen) > 0.5,
        # no open unit in the first sequence, later ones mid prompt or mid decode units
        "open_unit": torch.randint(0, prompt_units + 3, (batch,), generator=gen),
        "decode_units": torch.randint(0, 3, (batch,), generator=gen),
    }
    state["open_unit"][0] = -1
    # empty units are as a fresh table leaves them
    state["key_min"][..., -1, :] = float("inf")
    state["key_max"][..., -1, :] = float("-inf")
    # the float16 means as the table keeps them, one unit's beyond float16's range (clamped)
    state["key_sum"][..., 1, 0] = 3e5
    state["key_mean"] = reference.half_mean(state["key_sum"], state["size"])
    return state, n


def _step_both(state_ref, state_tri, position, slot, key, valid, cut, prompt_units):
    reference.append_to_unit(*(state_ref[f] for f in FIELDS), position, slot, key, valid, cut, prompt_units)
    append = dispatch.get("append_to_unit", "triton", DEVICE)
    append(*(state_tri[f] for f in FIELDS), position.to(DEVICE), slot.to(DEVICE), key.to(DEVICE),
           valid.to(DEVICE), cut.to(DEVICE), prompt_units)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,heads,dim", [(3, 8, 128), (2, 3, 64), (1, 1, 48), (2, 20, 256)])
def test_append_to_unit_matches_reference(dtype, batch, heads, dim):
    gen = torch.Generator().manual_seed(batch * 1000 + heads * 10 + dim)
    prompt_units = 5
    state_ref, n = _random_state(batch, heads, dim, prompt_units, gen)
    state_tri = {f: t.clone().to(DEVICE) for f, t in state_ref.items()}
    position = torch.tensor(7)
    steps = 6 if heads <= 8 else 2
    for step in range(steps):
        key = (torch.randn(batch, heads, dim, generator=gen) * 3).to(dtype)
        if step == 1:  # a non-contiguous key
            key = (torch.randn(batch, dim, heads, generator=gen) * 3).to(dtype).transpose(1, 2)
        valid = torch.rand(batch, generator=gen) > 0.3
        # cuts on valid and (to cover the op alone) on invalid tokens; step 0 cuts where valid
        cut = (torch.rand(batch, generator=gen) > 0.5) | (valid & (step == 0))
        slot = torch.randint(0, 5000, (), generator=gen)
        _step_both(state_ref, state_tri, position, slot, key, valid, cut, prompt_units)
        for name in FIELDS:
            assert _same(state_tri[name], state_ref[name]), f"step {step}: {name} differs"
        position = (position + 1) % n


def test_append_to_unit_without_open_unit_or_valid_token_changes_nothing_but_order():
    gen = torch.Generator().manual_seed(3)
    state_ref, _ = _random_state(2, 4, 64, 4, gen)
    state_ref["open_unit"].fill_(-1)
    before = {f: t.clone() for f, t in state_ref.items()}
    state_tri = {f: t.clone().to(DEVICE) for f, t in state_ref.items()}
    no = torch.zeros(2, dtype=torch.bool)
    key = torch.randn(2, 4, 64, generator=gen)
    _step_both(state_ref, state_tri, torch.tensor(11), torch.tensor(99), key, no, no, 4)
    for name in FIELDS:
        assert _same(state_tri[name], state_ref[name]), name
        if name != "order":
            assert _same(state_ref[name], before[name]), name
    assert (state_ref["order"][:, :, 11] == 99).all()


@pytest.mark.parametrize("builder", [Pages(size=3), Segments(max_size=4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_append_leaving_token_backends_build_the_same_table(builder, dtype):
    gen = torch.Generator().manual_seed(5)
    batch, heads, n, dim = 3, 2, 10, 64
    keys = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    valid = torch.ones(batch, n, dtype=torch.bool)
    valid[1, :4] = False
    labels = (torch.arange(n) // 4).expand(batch, heads, n)
    # one prompt table, copied: from_prompt's scatter_add sums in a different order on a GPU,
    # and this test is about the decode appends only
    start = UnitTable.from_prompt(keys, torch.arange(n), valid, labels, 3)
    tables = {}
    for backend in ("reference", "triton"):
        device = torch.device("cpu") if backend == "reference" else DEVICE
        tables[backend] = dataclasses.replace(
            start, **{f.name: getattr(start, f.name).clone().to(device) for f in dataclasses.fields(start)
                      if isinstance(getattr(start, f.name), torch.Tensor)}
        )
    padding = torch.tensor([0, 3, 1])  # leading invalid decode tokens per sequence
    for i in range(20):  # 20 > the table's 16 spare positions: the host grows it in between
        key = torch.randn(batch, heads, dim, generator=gen).to(dtype)
        token_valid = i >= padding
        boundary = torch.rand(batch, generator=gen) > 0.6
        for backend, table in tables.items():
            device = table.order.device
            table.append_leaving_token(torch.tensor(n + i, device=device), key.to(device), token_valid.to(device),
                                       boundary.to(device), builder, backend)
    ref, tri = tables["reference"], tables["triton"]
    for name in (*FIELDS, "order_next"):
        assert _same(getattr(tri, name), getattr(ref, name)), name
    counters = ("order_len", "decode_tokens", "num_prompt_units")
    assert [getattr(tri, c) for c in counters] == [getattr(ref, c) for c in counters]
    assert int(ref.decode_units.max()) > 1  # several decode units were opened


def test_append_to_unit_refuses_a_misshaped_table():
    append = dispatch.get("append_to_unit", "triton", DEVICE)
    state, _ = _random_state(2, 3, 16, 2, torch.Generator().manual_seed(0))
    state = {f: t.to(DEVICE) for f, t in state.items()}
    state["size"] = state["size"][:, :2]
    flag = torch.ones(2, dtype=torch.bool, device=DEVICE)
    scalar = torch.tensor(0, device=DEVICE)
    with pytest.raises(ValueError, match="size must be"):
        append(*(state[f] for f in FIELDS), scalar, scalar, torch.zeros(2, 3, 16, device=DEVICE), flag, flag, 2)
