"""The pool lays the prompt's retrieval zone out unit by unit: a unit is one run of rows."""

import torch

from kvpolicy.layer import PolicyLayerState
from kvpolicy.presets import preset

from conftest import prompt_query


def _prefilled(name: str, batch=2, heads=2, prompt=600, dim=32):
    torch.manual_seed(0)
    zones = {"sink": 4} if name == "streaming" else {"sink": 4, "local": 16}
    policy = preset(name, budget=128, backend="reference", **zones)
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    keys, values = torch.randn(batch, heads, prompt, dim), torch.randn(batch, heads, prompt, dim)
    valid = torch.ones(batch, prompt, dtype=torch.bool)
    valid[1, :37] = False  # left padding
    state.prefill(keys, values, valid, num_q_heads=4 * heads,
                  last_query=prompt_query(keys.shape[0], 4 * heads, keys.shape[-1], keys.device, keys.dtype))
    return state, keys, values


def test_every_prompt_unit_is_one_contiguous_run_of_pool_rows():
    state, _, _ = _prefilled("louiskv")
    units, store = state.units, state.store
    assert store.pool.zone_rows is not None
    runs = 0
    for b in range(2):
        for h in range(2):
            for u in range(units.num_prompt_units):
                start, size = int(units.start[b, h, u]), int(units.size[b, h, u])
                if size == 0:
                    continue
                slots = units.order[b, h, start:start + size].view(1, 1, -1).expand(2, 2, -1)
                rows = store.pool_rows(slots)[b, h]
                assert torch.equal(rows, torch.arange(start, start + size)), (b, h, u)
                runs += 1
    assert runs > 8  # K-means made several units per head


def test_pool_rows_hold_their_slots_keys_and_values():
    state, keys, values = _prefilled("louiskv")
    store = state.store
    slots = torch.arange(keys.shape[2]).expand(2, 2, -1)
    rows = store.pool_rows(slots)
    index = rows.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    assert torch.equal(store.pool.keys.gather(2, index), keys)
    assert torch.equal(store.pool.values.gather(2, index), values)
    # the zone is permuted (K-means mixes slots), the local window keeps row = slot
    zone = store.zone_end
    assert not torch.equal(rows[..., :zone], slots[..., :zone])
    assert torch.equal(rows[..., zone:], slots[..., zone:])


def test_policies_without_units_keep_row_equal_to_slot():
    state, keys, _ = _prefilled("streaming")
    assert state.store.pool.zone_rows is None
    slots = torch.arange(keys.shape[2]).expand(2, 2, -1)
    assert torch.equal(state.store.pool_rows(slots), slots)


def test_a_deferred_zone_laid_out_without_order_keeps_row_equal_to_slot():
    from kvpolicy.store import TieredStore

    keys, values = torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    valid = torch.ones(2, 300, dtype=torch.bool)
    store = TieredStore.from_prefill(keys, values, valid, 4, 16, 64, torch.device("cpu"), defer_zone=True)
    store.lay_out_zone(keys, values, None)
    assert store.pool.zone_rows is None
    assert torch.equal(store.pool.keys[:, :, :300], keys) and torch.equal(store.pool.values[:, :, :300], values)


def test_the_eval_meters_read_keys_by_slot_not_by_pool_row():
    # the recall and drift meters compute the oracle over keys_by_slot: with a unit-ordered
    # pool, reading pool rows as slots would score the wrong tokens
    from kvpolicy.eval.decode import keys_by_slot

    state, keys, _ = _prefilled("clusterkv")
    store = state.store
    assert not torch.equal(store.pool.keys[:, :, : keys.shape[2]], keys)  # the zone is permuted
    assert torch.equal(keys_by_slot(store, torch.device("cpu"))[:, :, : keys.shape[2]], keys.float())
