"""A check wrapped around every ``PolicyLayerState.decode``: what a step that keeps its selection attends.

A sequence that does not re-select at a step (its ``reselections`` count did not grow) must attend
exactly the previous step's retrieved buffer, row for row, plus the token that left the local
window this step (admitted at row ``fill`` while the buffer has room), and must read no row from the
pool. ``checking_reuse`` patches ``decode`` for the duration of a ``with`` block and counts the
steps it checked, so a test can also assert that reuse happened at all.

Host reads are fine here: this is test code around the step, never inside it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvpolicy.layer import PolicyLayerState


@dataclass
class ReuseCount:
    steps: int = 0  # (layer, sequence) decode steps seen with a selector
    reusing: int = 0  # of which kept their selection (and were checked)
    admitted: int = 0  # of which admitted the leaving token


def _snapshot(state: PolicyLayerState) -> dict | None:
    if state.policy.selector is None or state.store is None or state.reselections is None:
        return None
    store = state.store
    return {
        "slots": store.retrieved.slots.clone(),
        "valid": store.retrieved.valid.clone(),
        "fill": store.retrieved.fill.clone(),
        "keys": store.retrieved.keys.clone(),
        "read": store.pool_rows_read.clone(),
        "reselections": state.reselections.clone(),
        "has_selection": state.has_selection.clone(),
    }


def check_step(state: PolicyLayerState, before: dict, new_key: torch.Tensor, count: ReuseCount) -> None:
    """Assert the reuse rule for every sequence of ``state`` that kept its selection this step."""
    store = state.store
    capacity = store.retrieval_capacity
    local = store.local_capacity
    new_slot = int(store.next_slot) - 1
    leaving = new_slot - local  # the slot the ring pushed out this step (none while it fills)
    fired = (state.reselections - before["reselections"]).tolist()
    for b, did in enumerate(fired):
        count.steps += 1
        if did or not bool(before["has_selection"][b]):
            continue
        count.reusing += 1
        assert int(store.pool_rows_read[b]) == int(before["read"][b]), (
            f"layer {state.layer_idx} seq {b}: a step that keeps its selection read rows from the pool"
        )
        leaving_valid = leaving >= 0 and bool(store.pool.valid[b, leaving])
        for h in range(store.retrieved.slots.shape[1]):
            fill = int(before["fill"][b, h])
            rows = slice(0, fill)
            what = f"layer {state.layer_idx} seq {b} head {h} (reusing step)"
            assert torch.equal(store.retrieved.slots[b, h, rows], before["slots"][b, h, rows]), f"{what}: slots moved"
            assert torch.equal(store.retrieved.valid[b, h, rows], before["valid"][b, h, rows]), f"{what}: validity changed"
            assert torch.equal(store.retrieved.keys[b, h, rows], before["keys"][b, h, rows]), f"{what}: rows rewritten"
            admits = leaving_valid and fill < capacity
            assert int(store.retrieved.fill[b, h]) == fill + int(admits), f"{what}: fill {fill} -> {int(store.retrieved.fill[b, h])}"
            if admits:
                count.admitted += 1
                assert int(store.retrieved.slots[b, h, fill]) == leaving, f"{what}: the leaving token was not admitted"
                assert bool(store.retrieved.valid[b, h, fill]), f"{what}: the admitted token is not attended"
                # its key is the one the pool holds for that slot
                row = int(store.pool_rows(torch.tensor([[[leaving]]], device=store.next_slot.device))[0, 0, 0])
                assert torch.equal(store.retrieved.keys[b, h, fill], store.pool.keys[b, h, row].to(store.retrieved.keys.device))
            # nothing past the rows in use is attended
            used = int(store.retrieved.fill[b, h])
            assert not bool(store.retrieved.valid[b, h, used:].any()), f"{what}: rows past fill are attended"


@contextlib.contextmanager
def checking_reuse():
    """Patch ``PolicyLayerState.decode`` so every step is checked; yields the running ``ReuseCount``."""
    count = ReuseCount()
    original = PolicyLayerState.decode

    def decode(self, query, key, value, scale):
        before = _snapshot(self)
        out = original(self, query, key, value, scale)
        if before is not None:
            check_step(self, before, key, count)
        return out

    PolicyLayerState.decode = decode
    try:
        yield count
    finally:
        PolicyLayerState.decode = original
