"""``fetch_mapped`` (a re-selection that looks rows up in the store's slot map) on fresh random inputs.

Two copies of one store are put in a random state (the whole pool, the retrieved buffer with
repeated and unheld slots, a GPU unit cache with repeated and unheld slots, and a slot map whose
entries are partly right, partly stale, partly out of range), then fetch the same random
selections (repeats, padding at slot 0, slots not written yet), one through the reference op
and one through Triton, three times in a row: every buffer and cache row, slot, flag, fill,
cursor, map entry and counter must match bit for bit, and sequences that do not re-select must
be left as they were. Without CUDA the Triton op runs on CPU tensors through Triton's
interpreter (conftest turns it on); with CUDA the same cases run on the GPU.
"""

import copy

import pytest
import torch

from kvpolicy.kernels import dispatch
from kvpolicy.store import TieredStore

from bitwise import random_pool, same_bits

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _store(gen, batch, heads, prompt, dim, dtype, retrieval, zone_order, cache_rows):
    keys = random_pool((batch, heads, prompt, dim), dtype, DEVICE, gen)
    values = random_pool((batch, heads, prompt, dim), dtype, DEVICE, gen)
    valid = torch.ones(batch, prompt, dtype=torch.bool, device=DEVICE)
    valid[-1, :3] = False  # left padding: pool rows that are not real tokens
    store = TieredStore.from_prefill(keys, values, valid, 2, 8, retrieval, DEVICE, defer_zone=True)
    zone = store.zone_end
    order = None
    if zone_order:
        order = torch.stack([torch.randperm(zone, generator=gen, device=gen.device) for _ in range(batch * heads)])
        order = order.view(batch, heads, zone).to(DEVICE)
    store.lay_out_zone(keys, values, order)
    if cache_rows:
        store.set_cache(cache_rows)
    for _ in range(3):
        key, value = random_pool((2, batch, heads, dim), dtype, DEVICE, gen)
        store.append(key, value, "reference")
    _scramble(store, gen)
    return store


def _randint(gen, low, high, shape):
    return torch.randint(low, high, shape, generator=gen, device=gen.device).to(DEVICE)


def _scramble(store, gen):
    """A random state of every tier the fetch reads, with map entries right, stale and wrong."""
    pool, buffer, cache, where = store.pool, store.retrieved, store.cache, store.slot_map
    batch, heads, rows, dim = buffer.keys.shape
    dtype = buffer.keys.dtype
    for t in (pool.keys, pool.values):  # the slots not written yet too, so both copies agree
        t.copy_(random_pool(t.shape, dtype, DEVICE, gen))
    # few distinct slots, so rows repeat them; -1 now and then (a row that holds nothing)
    buffer.slots.copy_(_randint(gen, -1, store.length + 4, (batch, heads, rows)))
    buffer.held.copy_(_randint(gen, 0, 4, (batch, heads, rows)) > 0)
    buffer.valid.copy_(_randint(gen, 0, 2, (batch, heads, rows)) > 0)
    buffer.fill.copy_(_randint(gen, 0, rows + 1, (batch, heads)))
    buffer.keys.copy_(random_pool(buffer.keys.shape, dtype, DEVICE, gen))
    buffer.values.copy_(random_pool(buffer.keys.shape, dtype, DEVICE, gen))
    capacity = where.shape[2] - 1
    where.copy_(_randint(gen, -(cache.rows if cache else 0) - 4, rows + 4, where.shape).int())
    # right entries: a share of the buffer rows and of the cache rows (the cache's win where both)
    row = torch.arange(rows, device=DEVICE).expand(batch, heads, rows)
    pick = (_randint(gen, 0, 3, (batch, heads, rows)) > 0) & (buffer.slots >= 0)
    where.scatter_(2, torch.where(pick, buffer.slots, capacity), torch.where(pick, row, -1).int())
    if cache is not None:
        crows = cache.rows
        cache.slots.copy_(_randint(gen, -1, store.length + 4, (batch, heads, crows)))
        cache.held.copy_(_randint(gen, 0, 4, (batch, heads, crows)) > 0)
        cache.cursor.copy_(_randint(gen, 0, crows, (batch, heads)))
        cache.keys.copy_(random_pool(cache.keys.shape, dtype, DEVICE, gen))
        cache.values.copy_(random_pool(cache.keys.shape, dtype, DEVICE, gen))
        crow = torch.arange(crows, device=DEVICE).expand(batch, heads, crows)
        pick = (_randint(gen, 0, 3, (batch, heads, crows)) > 0) & (cache.slots >= 0)
        where.scatter_(2, torch.where(pick, cache.slots, capacity), torch.where(pick, -2 - crow, -1).int())


def _state(store):
    r, c = store.retrieved, store.cache
    out = {"keys": r.keys, "values": r.values, "slots": r.slots, "valid": r.valid, "held": r.held, "fill": r.fill,
           "rows_fetched": store.rows_fetched, "pool_rows_read": store.pool_rows_read,
           "slot_map": store.slot_map[:, :, :-1]}  # the last entry is a bin
    if c is not None:
        out.update({"cache keys": c.keys, "cache values": c.values, "cache slots": c.slots,
                    "cache held": c.held, "cursor": c.cursor})
    return {name: t.clone() for name, t in out.items()}


def _equal(a, b):
    return same_bits(a, b) if a.is_floating_point() else torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zone_order", [True, False], ids=["unit-ordered", "row-is-slot"])
@pytest.mark.parametrize("shape", [(2, 3, 96, 16, 40), (3, 2, 200, 24, 100)], ids=["small", "odd-dims"])
@pytest.mark.parametrize("chunk", [None, 16], ids=["one-pass", "chunked"])
def test_fetch_mapped_matches_the_reference_bit_for_bit(cached, dtype, zone_order, shape, chunk, monkeypatch):
    batch, heads, prompt, dim, retrieval = shape
    if chunk is not None:
        # the lookup program's rows in several passes: repeated slots across passes
        monkeypatch.setitem(dispatch.get("fetch_mapped", "triton", DEVICE).__globals__, "_LOCATE_BLOCK", chunk)
    cache_rows = retrieval + 17 if cached else 0  # at least the retrieved rows
    seed = hash((cached, str(dtype), zone_order, shape)) % 1000
    stores = [_store(torch.Generator(device=DEVICE).manual_seed(seed), batch, heads, prompt, dim, dtype, retrieval,
                     zone_order, cache_rows)]
    stores.append(copy.deepcopy(stores[0]))
    assert stores[0].slot_map is not None and stores[0].lookup == "map"
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    reads = 0
    for step in range(3):
        store = stores[0]
        rows = store.retrieved.slots.shape[-1]
        # from the buffer, from the cache, and fresh (slots past the last written one too)
        held = [store.retrieved.slots] + ([store.cache.slots] if store.cache is not None else [])
        fresh = _randint(gen, 0, store.length + 3, (batch, heads, rows))
        pool = torch.cat(held + [fresh], dim=-1).clamp(min=0)
        slots = pool.gather(-1, _randint(gen, 0, pool.shape[-1], (batch, heads, rows)))
        slot_valid = _randint(gen, 0, 5, (batch, heads, rows)) > 0
        slots = torch.where(slot_valid, slots, 0)  # padding at slot 0, as a budget fill leaves it
        reselect = _randint(gen, 0, 5, (batch,)) < 3
        reselect[step % batch] = True
        before = _state(stores[1])
        dispatch.get("fetch_mapped", "reference", DEVICE)(stores[0], slots, slot_valid, reselect)
        dispatch.get("fetch_mapped", "triton", DEVICE)(stores[1], slots, slot_valid, reselect)
        want, got = _state(stores[0]), _state(stores[1])
        for name in want:
            assert _equal(want[name], got[name]), f"step {step}: {name} differs from the reference"
        kept = ~reselect.cpu()
        for name in want:
            old, new = before[name].cpu(), got[name].cpu()
            if old.shape[0] == batch:
                assert _equal(old[kept], new[kept]), f"step {step}: {name} of a sequence that kept its selection changed"
        fetched = (got["rows_fetched"] - before["rows_fetched"]).cpu()
        assert torch.equal(fetched, reselect.cpu().long() * heads * rows)
        reads += int((got["pool_rows_read"] - before["pool_rows_read"]).sum())
    total = int(stores[1].rows_fetched.sum())
    assert 0 < reads < total  # both hits and misses were exercised


def test_the_map_grows_with_the_pool_and_keeps_its_entries():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    store = _store(gen, 2, 3, 96, 16, torch.float32, 40, True, 56)
    before = store.slot_map.clone()
    capacity = store.pool.capacity
    assert before.shape == (2, 3, capacity + 1) and store.slot_map_bytes() == 4 * 2 * 3 * (capacity + 1)
    store.reserve(capacity + 10)
    assert store.slot_map.shape[2] == store.pool.capacity + 1 > capacity + 1
    assert torch.equal(store.slot_map[:, :, :capacity], before[:, :, :capacity])
    assert bool((store.slot_map[:, :, capacity:-1] == -1).all())


def test_a_store_that_compares_keeps_no_map():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    keys = torch.randn(1, 2, 64, 16, generator=gen, device=gen.device).to(DEVICE)
    valid = torch.ones(1, 64, dtype=torch.bool, device=DEVICE)
    store = TieredStore.from_prefill(keys, keys, valid, 2, 8, 16, DEVICE)
    compare = TieredStore(**{**store.__dict__, "lookup": "compare", "slot_map": None, "scratch_values": None})
    assert compare.slot_map is None and compare.slot_map_bytes() == 0
    with pytest.raises(ValueError, match="lookup must be 'map' or 'compare'"):
        TieredStore(**{**store.__dict__, "lookup": "sort"})
