"""A decode step that can be captured as a CUDA graph: checked on any device by emulating replay.

A captured graph re-runs the step's kernels on the tensors it was captured with; the Python
around them does not run again. So a replayable step (1) keeps every state tensor in place
(never rebinds an attribute to a new tensor) and (2) reads nothing that changes between steps
from the host. The emulation: reserve room, snapshot every host-side attribute, then before
each step restore that snapshot; the outputs must equal an ordinary run's. The emulated replay
re-runs the Python, so a host read of a device value would still give the right value here: it
runs under ``no_host_reads``, where any such read raises.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kvpolicy
from kvpolicy.layer import PolicyLayerState

from conftest import prompt_query
from every_preset import CACHED_PRESETS, RETRIEVAL_PRESETS
from host_reads import HostReadError, no_host_reads

B, HQ, H, D, PROMPT, STEPS = 2, 4, 2, 16, 150, 40


def _tensors(obj, prefix=""):
    """name -> tensor for every tensor attribute of ``obj`` (dataclass or plain object), one level down."""
    found = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            found[prefix + name] = value
        elif hasattr(value, "__dict__") and not callable(value) and name in ("store", "units", "trigger_state"):
            found.update(_tensors(value, prefix + name + "."))
    return found


def _host_state(state: PolicyLayerState) -> dict:
    """The host-side (non-tensor) attributes a replay would not update."""
    out = {"decode_steps": state.decode_steps}
    for part in ("store", "units"):
        obj = getattr(state, part)
        if obj is not None:
            out[part] = {k: copy.copy(v) for k, v in vars(obj).items() if not isinstance(v, torch.Tensor)}
    return out


def _restore(state: PolicyLayerState, host: dict) -> None:
    state.decode_steps = host["decode_steps"]
    for part in ("store", "units"):
        if part in host:
            for k, v in host[part].items():
                setattr(getattr(state, part), k, v)


def _layer(name: str, seed: int, past_context: bool = False) -> tuple[PolicyLayerState, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    name, cached = name.removesuffix("+cache"), name.endswith("+cache")
    options = {"budget": 20, "sink": 4} if name == "streaming" else {"budget": 100, "sink": 4, "local": 16}
    if past_context:
        # every tier is still growing toward the budget when the room is reserved
        options["budget"] = 2 * (PROMPT + STEPS)
    if name == "pariskv":
        # a small update buffer, so the 40 steps flush it (on a device counter) several times
        units = {"name": "analytic", "update_buffer": 8}
        options.update(prefill_units=units, decode_units=units)
    if cached:
        # a GPU unit cache of twice the retrieved rows (on the CPU too: a given size always applies)
        options["unit_cache_rows"] = 2 * (options["budget"] - options["sink"] - options.get("local", 64))
    policy = kvpolicy.preset(name, **options)
    keys = torch.randn(B, H, PROMPT, D, generator=gen)
    values = torch.randn(B, H, PROMPT, D, generator=gen)
    valid = torch.ones(B, PROMPT, dtype=torch.bool)
    valid[1, :7] = False  # left padding
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    state.prefill(keys, values, valid, HQ, last_query=prompt_query(B, HQ, D))
    steps = torch.randn(STEPS, 3, B, HQ, D, generator=gen)
    return state, steps


@pytest.mark.parametrize("past_context", [False, True], ids=["budget-within", "budget-past-context"])
@pytest.mark.parametrize("name", RETRIEVAL_PRESETS + CACHED_PRESETS)
def test_decode_step_replays_with_frozen_host_state(name, past_context):
    eager, inputs = _layer(name, seed=3, past_context=past_context)
    replayed, _ = _layer(name, seed=3, past_context=past_context)
    eager.plan.reserve(STEPS)
    replayed.plan.reserve(STEPS)
    captured = _tensors(replayed)
    pointers = {k: t.data_ptr() for k, t in captured.items()}
    host = _host_state(replayed)
    for step in range(STEPS):
        q, k, v = inputs[step, 0], inputs[step, 1, :, :H], inputs[step, 2, :, :H]
        want = eager.decode(q, k, v, D**-0.5)
        _restore(replayed, host)
        with no_host_reads(f"{name}'s decode step"):
            got = replayed.decode(q, k, v, D**-0.5)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}: step {step} differs under replay")
    now = _tensors(replayed)
    moved = [k for k, t in captured.items() if now[k] is not t or now[k].data_ptr() != pointers[k]]
    assert not moved, f"{name}: state tensors rebound during decode (a replay would not see them): {moved}"
    # and the eager run really moved on (the check above is not vacuous)
    assert int(eager.store.next_slot) == PROMPT + STEPS
    assert int(replayed.store.next_slot) == PROMPT + STEPS
    if name.endswith("+cache"):
        for state in (eager, replayed):
            assert state.store.cache is not None and int(state.store.rows_fetched.sum()) > 0
    if name == "pariskv" and not past_context:
        # one token left the (prompt-filled) ring per step: buffers of 8 flushed as the 9th, 17th,
        # 25th and 33rd arrived, 8 still buffered; the replay flushed on the device counter too
        for state in (eager, replayed):
            zone = PROMPT - 16
            assert int(state.units.next_position) == zone + STEPS
            assert int(state.units.indexed) == zone + STEPS - 8


def test_a_host_read_in_the_step_is_caught(monkeypatch):
    """The guard is not vacuous: a step that reads its slot counter on the host fails under it."""
    state, inputs = _layer("quest", seed=3)
    state.plan.reserve(2)
    store = state.store
    real_append = type(store).append

    def append_reading_the_slot(self, key, value, backend):
        int(self.next_slot)  # what a step must not do
        return real_append(self, key, value, backend)

    monkeypatch.setattr(type(store), "append", append_reading_the_slot)
    q, k, v = inputs[0, 0], inputs[0, 1, :, :H], inputs[0, 2, :, :H]
    with pytest.raises(HostReadError, match="Tensor.__int__"):
        with no_host_reads():
            state.decode(q, k, v, D**-0.5)
    for read in (lambda t: t.item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: bool(t), lambda t: float(t)):
        with pytest.raises(HostReadError), no_host_reads():
            read(torch.ones(()))
    assert torch.ones(()).item() == 1.0  # restored on exit
