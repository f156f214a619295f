"""The decode step's fused bookkeeping ops (kernels/triton/step.py and the rule path of
unit_append.py) against their references (kernels/reference_step.py) on fresh random inputs:
bit for bit, over enough steps that the ring wraps and units are cut."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from kvpolicy.kernels import dispatch, reference_step
from kvpolicy.store import TieredStore
from kvpolicy.units.table import UnitTable

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton needs a CUDA device or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _triton():
    return dispatch.bind("triton", DEVICE)


def _store(seed: int, batch=2, heads=3, prompt=40, dim=16, local=8, retrieval=12, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, prompt, dim, generator=gen, dtype=dtype).to(DEVICE)
    values = torch.randn(batch, heads, prompt, dim, generator=gen, dtype=dtype).to(DEVICE)
    valid = torch.ones(batch, prompt, dtype=torch.bool, device=DEVICE)
    valid[1, :5] = False
    return TieredStore.from_prefill(keys, values, valid, 4, local, retrieval, DEVICE), gen


def _tensors(store: TieredStore) -> dict:
    # fetch's shared work buffers are scratch space (unspecified contents)
    out = {}
    for name, value in vars(store).items():
        if name in ("scratch", "source"):
            continue
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif dataclasses.is_dataclass(value):  # a tier, the pool, the evicted token
            out.update({f"{name}.{k}": v for k, v in vars(value).items() if isinstance(v, torch.Tensor)})
    for name in ("pool.keys", "pool.values"):  # rows past the written slots were never initialised
        out[name] = out[name][:, :, : store.length]
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_token_matches_reference(dtype):
    ref, gen = _store(1, dtype=dtype)
    fast = copy.deepcopy(ref)
    for step in range(20):  # the ring of 8 wraps twice; the prompt filled it, so tokens leave at once
        key = torch.randn(2, 3, 16, generator=gen).to(DEVICE, dtype)
        value = torch.randn(2, 3, 16, generator=gen).to(DEVICE, dtype)
        ref.append(key, value, "reference")
        fast.append(key, value, _triton())
        _assert_same(_tensors(ref), _tensors(fast), f"step {step}")
    assert int(ref.next_slot) == 60 and bool(ref.evicted.valid.all())


def test_append_token_ring_filling_from_a_short_prompt():
    ref, gen = _store(2, prompt=3)
    fast = copy.deepcopy(ref)
    seen_invalid = False
    for step in range(12):
        key, value = torch.randn(2, 3, 16, generator=gen).to(DEVICE), torch.randn(2, 3, 16, generator=gen).to(DEVICE)
        ref.append(key, value, "reference")
        fast.append(key, value, _triton())
        seen_invalid |= not bool(ref.evicted.valid.any())
        _assert_same(_tensors(ref), _tensors(fast), f"step {step}")
    assert seen_invalid  # the ring was still filling at first: nothing left it


def test_note_decision_matches_reference():
    gen = torch.Generator().manual_seed(3)
    batch, capacity = 5, 30
    state = {
        "has_selection": torch.rand(batch, generator=gen) < 0.5,
        "reselections": torch.randint(0, 9, (batch,), generator=gen),
        "boundary": torch.rand(batch, capacity, generator=gen) < 0.5,
    }
    state = {k: v.to(DEVICE) for k, v in state.items()}
    other = {k: v.clone() for k, v in state.items()}
    for step in range(4):
        fire = (torch.rand(batch, generator=gen) < 0.5).to(DEVICE)
        slot = torch.tensor(7 + step, device=DEVICE)
        got, want = torch.zeros(batch, dtype=torch.bool, device=DEVICE), torch.zeros(batch, dtype=torch.bool, device=DEVICE)
        reference_step.note_decision(fire, state["has_selection"], state["reselections"], state["boundary"], slot, want)
        _triton().note_decision(fire, other["has_selection"], other["reselections"], other["boundary"], slot, got)
        assert torch.equal(got, want)
        _assert_same(state, other, f"step {step}")


@pytest.mark.parametrize("n", [1, 3])
def test_interval_decision_matches_reference(n):
    # fresh random inputs: some sequences have no selection yet, steps at and between intervals
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    batch, capacity = 6, 30
    state = {
        "steps": torch.randint(0, 9, (batch,), generator=gen),
        "has_selection": torch.rand(batch, generator=gen) < 0.5,
        "reselections": torch.randint(0, 9, (batch,), generator=gen),
        "boundary": torch.rand(batch, capacity, generator=gen) < 0.5,
    }
    state = {k: v.to(DEVICE) for k, v in state.items()}
    other = {k: v.clone() for k, v in state.items()}
    decided = []
    for step in range(5):
        slot = torch.tensor(7 + step, device=DEVICE)
        got, want = torch.zeros(batch, dtype=torch.bool, device=DEVICE), torch.zeros(batch, dtype=torch.bool, device=DEVICE)
        reference_step.interval_decision(state["steps"], n, state["has_selection"], state["reselections"],
                                         state["boundary"], slot, want)
        _triton().interval_decision(other["steps"], n, other["has_selection"], other["reselections"],
                                    other["boundary"], slot, got)
        assert torch.equal(got, want)
        _assert_same(state, other, f"step {step}")
        decided.append(want.cpu())
    decided = torch.stack(decided)
    assert decided.all() if n == 1 else (decided.any() and not decided.all())


@pytest.mark.parametrize("anchor", [False, True])
def test_query_cosine_fire_matches_reference(anchor):
    gen = torch.Generator().manual_seed(4)
    batch, q_heads, dim = 4, 6, 32
    previous = torch.randn(batch, q_heads, dim, generator=gen).to(DEVICE)
    has_previous = torch.tensor([True, True, False, True], device=DEVICE)
    ref_state = (previous.clone(), has_previous.clone())
    fast_state = (previous.clone(), has_previous.clone())
    fired = []
    for step in range(6):
        # a query near the previous one for some sequences, unrelated for others
        noise = torch.randn(batch, q_heads, dim, generator=gen).to(DEVICE)
        near = torch.tensor([True, False, True, False], device=DEVICE).view(-1, 1, 1)
        query = torch.where(near, ref_state[0] + 0.05 * noise, noise)
        want = reference_step.query_cosine_fire(query, *ref_state, 0.7, anchor)
        got = _triton().query_cosine_fire(query, *fast_state, 0.7, anchor)
        assert torch.equal(got, want), f"step {step}"
        torch.testing.assert_close(fast_state[0], ref_state[0], rtol=0, atol=0)
        assert torch.equal(fast_state[1], ref_state[1])
        fired.append(want)
    fired = torch.stack(fired)
    assert fired[1:, 1].all() and not fired[1:, 0].any()  # the test decides both ways


@pytest.mark.parametrize("retrieval", [12, 1300])  # one tile; several, and more than one fill block
def test_commit_selection_matches_reference(retrieval):
    ref, gen = _store(5, prompt=40 + retrieval, retrieval=retrieval)
    for _ in range(3):
        ref.append(torch.randn(2, 3, 16, generator=gen).to(DEVICE), torch.randn(2, 3, 16, generator=gen).to(DEVICE),
                   "reference")
    fast = copy.deepcopy(ref)
    rows = ref.retrieval_capacity
    assert rows == retrieval
    slots = torch.randint(0, ref.pool.valid.shape[1], (2, 3, rows), generator=gen).to(DEVICE)
    listed = (torch.rand(2, 3, rows, generator=gen) < 0.7).to(DEVICE)
    reselect = torch.tensor([True, False], device=DEVICE)
    reference_step.commit_selection(ref, slots, listed, reselect)
    _triton().commit_selection(fast, slots, listed, reselect)
    _assert_same(_tensors(ref), _tensors(fast), "commit")
    assert torch.equal(ref.retrieved.slots[0], slots[0])  # the re-selecting sequence took it


def _table(seed: int, batch=2, heads=2, dim=16, zone=24):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, zone, dim, generator=gen).to(DEVICE)
    labels = (torch.arange(zone, device=DEVICE) // 8).expand(batch, heads, zone)
    valid = torch.ones(batch, zone, dtype=torch.bool, device=DEVICE)
    table = UnitTable.from_prompt(keys, torch.arange(zone, device=DEVICE), valid, labels, 3)
    table.reserve(40)
    return table, gen


@pytest.mark.parametrize("max_size,at_boundary", [(4, True), (3, False), (64, True)])
def test_append_leaving_by_rule_matches_reference(max_size, at_boundary):
    ref, gen = _table(6)
    fast = copy.deepcopy(ref)
    capacity = 80
    boundary = (torch.rand(2, capacity, generator=gen) < 0.3).to(DEVICE)
    for step in range(14):
        slot = torch.tensor(24 + step, device=DEVICE)
        key = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
        valid = torch.tensor([True, step % 5 != 0], device=DEVICE)
        reference_step.append_leaving_by_rule(ref, slot, key, valid, boundary, max_size, at_boundary)
        _triton().append_leaving_by_rule(fast, slot, key, valid, boundary, max_size, at_boundary)
        for table in (ref, fast):
            table.order_next.add_(1)
        for name, t in vars(ref).items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, getattr(fast, name)), f"step {step}: {name} differs"
    assert int(ref.decode_units.min()) >= 2  # units were cut


def test_interval_fire_matches_reference():
    ref = torch.tensor([0, 3, 5, 8], device=DEVICE)
    fast = ref.clone()
    for step in range(7):
        want = reference_step.interval_fire(ref, 4)
        got = _triton().interval_fire(fast, 4)
        assert torch.equal(got, want) and torch.equal(fast, ref), f"step {step}"
    assert int(ref[0]) == 7
