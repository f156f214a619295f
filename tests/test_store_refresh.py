"""``TieredStore.fetch`` reuses the rows its buffer (and its GPU unit cache) already holds,
without changing any result.

Over random decode sequences (appends, re-selections of some sequences, admissions) the store
is run next to a shadow that fetches the way it always did, gathering every row from the pool:
the retrieved buffers must stay bit-identical, and ``pool_rows_read`` must equal the rows a
per-row model of the buffer and the cache says were missing (fewer than a full gather when
selections overlap, all of them when they are disjoint and there is no cache).
"""

import pytest
import torch

import kvpolicy
from kvpolicy.kernels import reference
from kvpolicy.layer import PolicyLayerState
from kvpolicy.store import TieredStore

from conftest import prompt_query

CUDA = torch.cuda.is_available()
B, H, D, PROMPT, SINK, LOCAL, R = 2, 3, 16, 200, 2, 8, 12


def _stores(seed, device, pool_device, read_whole=False, by_slot=False):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, PROMPT, D, generator=gen).to(device)
    values = torch.randn(B, H, PROMPT, D, generator=gen).to(device)
    valid = torch.ones(B, PROMPT, dtype=torch.bool, device=device)
    valid[1, :5] = False  # left padding
    stores = tuple(TieredStore.from_prefill(keys, values, valid, SINK, LOCAL, R, pool_device) for _ in range(2))
    stores[0].read_whole = read_whole  # the lookup path everywhere unless a test asks otherwise
    stores[0].attend_pool = by_slot  # rows copied into the buffer unless a test asks otherwise
    return stores


def _old_fetch(store, slots, slot_valid, reselect):
    """What a fetch must leave, written out row by row (not fetch's own code): for each sequence
    that re-selects, every buffer row gathered afresh from the pool (the shadow's pool keeps
    row = slot), attended where the selection and the slot are valid, ``fill`` the selection's
    count; the other sequences untouched."""
    for b in range(slots.shape[0]):
        if not bool(reselect[b]):
            continue
        for h in range(slots.shape[1]):
            for r in range(slots.shape[2]):
                slot = int(slots[b, h, r])
                store.retrieved.keys[b, h, r] = store.pool.keys[b, h, slot]
                store.retrieved.values[b, h, r] = store.pool.values[b, h, slot]
                store.retrieved.slots[b, h, r] = slot
                store.retrieved.valid[b, h, r] = bool(slot_valid[b, h, r]) and bool(store.pool.valid[b, slot])
            store.retrieved.fill[b, h] = int(slot_valid[b, h].sum())


def _attended_rows(store):
    """The retrieved keys and values as attention reads them: the buffer's, or the pool's by slot."""
    buffer = store.retrieved
    if not store.attends_pool_by_slot:
        return {"keys": buffer.keys, "values": buffer.values}
    keys, values = reference.with_pool_rows(buffer.keys, buffer.values, store.retrieved_from_pool())
    return {"keys": keys, "values": values}


def _assert_same(store, shadow, step):
    rows = _attended_rows(store)
    for name in ("keys", "values", "slots", "valid", "fill"):
        got, want = rows.get(name, getattr(store.retrieved, name)), getattr(shadow.retrieved, name)
        if got.is_floating_point():
            got, want = got.view(torch.int32), want.view(torch.int32)
        assert torch.equal(got.cpu(), want.cpu()), f"step {step}: {name} differs from a full gather"


def _run(kind, backend, device, pool_device, steps=24, seed=0, cache_rows=0, read_whole=False, by_slot=False):
    """Decode ``steps`` tokens; returns (store, expected rows read (B,), re-selections (B,)).
    ``cache_rows``: the store keeps a GPU unit cache of that many rows (0: none); ``read_whole``:
    the store reads every selected row from the pool (expected rows read stay the lookup's);
    ``by_slot``: and attends them there (the rows compared are those attention reads)."""
    store, shadow = _stores(seed, device, pool_device, read_whole, by_slot)
    if cache_rows:
        store.set_cache(cache_rows)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = [[[None] * R for _ in range(H)] for _ in range(B)]  # the slot each buffer row holds
    # the cache, first in first out: every row read from the pool is filed at the cursor
    cached = [[[None] * cache_rows for _ in range(H)] for _ in range(B)]
    cursor = [[0] * H for _ in range(B)]
    expected = [0] * B
    reselections = torch.zeros(B, dtype=torch.long)
    for step in range(steps):
        key, value = torch.randn(2, B, H, D, generator=gen).to(device)
        evicted = store.append(key, value, backend)
        shadow_evicted = shadow.append(key, value, "reference")
        reselect = torch.rand(B, generator=gen) < 0.6
        reselect[:] |= step == 0

        if kind == "disjoint":
            # a fresh block of slots each step: nothing the buffer holds (admission is off)
            slots = (step * R + torch.stack([torch.randperm(R, generator=gen) for _ in range(B * H)])).view(B, H, R)
            slot_valid = torch.ones(B, H, R, dtype=torch.bool)
        else:
            # half from what the buffer holds now (admitted tokens included), half fresh;
            # draws repeat slots, and the tail is padding at slot 0 (as a budget fill leaves it)
            fresh = torch.randint(0, store.length, (B, H, R), generator=gen)
            pick = torch.randint(0, 2 * R, (B, H, R), generator=gen)
            slots = torch.cat([shadow.retrieved.slots.cpu(), fresh], dim=-1).gather(-1, pick)
            slot_valid = torch.arange(R) < torch.randint(R // 2, R + 1, (B, H, 1), generator=gen)
            slots = torch.where(slot_valid, slots, 0)

        for b in range(B):
            if reselect[b]:
                reselections[b] += 1
                for h in range(H):
                    held = {s for s in rows[b][h] if s is not None} | {s for s in cached[b][h] if s is not None}
                    missing = [s for s in slots[b, h].tolist() if s not in held]
                    expected[b] += len(missing)
                    for s in missing if cache_rows else ():
                        cached[b][h][cursor[b][h]] = s
                        cursor[b][h] = (cursor[b][h] + 1) % cache_rows
                    rows[b][h] = slots[b, h].tolist()

        slots, slot_valid, reselect_d = slots.to(device), slot_valid.to(device), reselect.to(device)
        store.fetch(slots, slot_valid, reselect_d, backend)
        _old_fetch(shadow, slots, slot_valid, reselect_d)
        # a disjoint run admits nothing: every sequence counts as re-selected
        reselected = reselect_d if kind != "disjoint" else torch.ones_like(reselect_d)
        fill_before = shadow.retrieved.fill.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        store.admit(evicted, reselected, "reference")
        shadow.admit(shadow_evicted, reselected, "reference")
        admitted = shadow.retrieved.fill.cpu() > fill_before
        for b, h in admitted.nonzero().tolist():
            rows[b][h][int(fill_before[b, h])] = int(shadow_evicted.slot)
        _assert_same(store, shadow, step)
    return store, torch.tensor(expected), reselections


# Triton on CPU tensors runs only under its interpreter, which is off on a CUDA machine
_CASES = [("reference", "cpu", "cpu")] + ([] if CUDA else [("triton", "cpu", "cpu")])
if CUDA:
    _CASES += [("triton", "cuda", "cpu"), ("triton", "cuda", "cuda"), ("reference", "cuda", "cpu")]


@pytest.mark.parametrize("cache_rows", [0, 2 * R], ids=["no-cache", "cache"])
@pytest.mark.parametrize("backend,device,pool_device", _CASES)
def test_overlapping_selections_read_only_the_missing_rows(backend, device, pool_device, cache_rows):
    store, expected, reselections = _run("overlap", backend, torch.device(device), torch.device(pool_device),
                                         cache_rows=cache_rows)
    read = store.pool_rows_read.cpu()
    assert torch.equal(read, expected)
    assert (read < H * R * reselections).all()
    assert (reselections > 1).all()  # reuse was possible at all
    assert torch.equal(store.rows_fetched.cpu(), H * R * reselections)


@pytest.mark.parametrize("by_slot", [False, True], ids=["rows-copied", "attends-pool-by-slot"])
@pytest.mark.parametrize("backend,device,pool_device", [case for case in _CASES if case[1] == case[2]])
def test_a_store_that_reads_whole_leaves_what_a_full_gather_leaves(backend, device, pool_device, by_slot):
    """``read_whole`` (a GPU pool's fetch; ``fetch_whole`` refuses a pool on another device):
    the same buffers as the shadow (``_run`` compares them every step; attending the pool by
    slot, the rows attention reads there), every selected row counted as read from the pool."""
    store, expected, reselections = _run("overlap", backend, torch.device(device), torch.device(pool_device),
                                         read_whole=True, by_slot=by_slot)
    assert store.attends_pool_by_slot == by_slot
    assert (expected < H * R * reselections).all()  # the lookup would have read fewer
    assert torch.equal(store.pool_rows_read.cpu(), H * R * reselections)
    assert torch.equal(store.rows_fetched.cpu(), H * R * reselections)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: a pool moved off the attention device")
def test_a_pool_moved_to_the_host_is_looked_up_again():
    """A split placement moves a GPU pool to pinned host memory when it cannot grow in place
    (``plan.before_pool_growth``); the store made at prefill still says ``read_whole``, and its
    fetch must then take the lookup path (``fetch_whole`` refuses a host pool)."""
    store, shadow = _stores(3, torch.device("cuda"), torch.device("cuda"))
    store.read_whole = True
    for name in ("keys", "values"):
        setattr(store.pool, name, getattr(store.pool, name).cpu().pin_memory())
    slots = torch.randint(0, store.length, store.retrieved.slots.shape, device="cuda")
    valid = torch.ones_like(slots, dtype=torch.bool)
    every = torch.ones(B, dtype=torch.bool, device="cuda")
    store.fetch(slots, valid, every, "triton")
    _old_fetch(shadow, slots, valid, every)
    _assert_same(store, shadow, 0)


def test_only_a_pool_in_gpu_memory_is_read_whole():
    """The lookup pays off where the pool is across PCIe, or on a CPU (where the eval measures
    the miss fraction); a pool on the GPU itself is read whole."""
    assert not _stores(0, torch.device("cpu"), torch.device("cpu"))[1].read_whole
    if CUDA:
        assert _stores(0, torch.device("cuda"), torch.device("cuda"))[1].read_whole
        assert not _stores(0, torch.device("cuda"), torch.device("cpu"))[1].read_whole


@pytest.mark.parametrize("cache_rows", [0, R], ids=["no-cache", "cache"])
@pytest.mark.parametrize("backend,device,pool_device", _CASES)
def test_disjoint_selections_read_every_row(backend, device, pool_device, cache_rows):
    # a fresh block each time: a cache cannot hold what was never read
    store, expected, reselections = _run("disjoint", backend, torch.device(device), torch.device(pool_device),
                                         steps=12, cache_rows=cache_rows)
    assert torch.equal(store.pool_rows_read.cpu(), H * R * reselections)
    assert torch.equal(expected, H * R * reselections)


@pytest.mark.parametrize("backend,device,pool_device", _CASES)
def test_a_selection_that_comes_back_is_read_from_the_unit_cache(backend, device, pool_device):
    """Two blocks of slots selected in turn: with a cache of both, after the first two fetches
    nothing is read from the pool, and what is fetched really comes from the cache (the store's
    pool rows of both blocks are overwritten after they were cached; the shadow's are not)."""
    device, pool_device = torch.device(device), torch.device(pool_device)
    store, shadow = _stores(7, device, pool_device)
    store.set_cache(2 * R)
    gen = torch.Generator().manual_seed(8)
    blocks = [torch.stack([torch.randperm(R, generator=gen) for _ in range(B * H)]).view(B, H, R) + offset
              for offset in (20, 20 + R)]
    every = torch.ones(B, dtype=torch.bool, device=device)
    valid = torch.ones(B, H, R, dtype=torch.bool, device=device)
    for step in range(6):
        key, value = torch.randn(2, B, H, D, generator=gen).to(device)
        store.append(key, value, backend)
        shadow.append(key, value, "reference")
        slots = blocks[step % 2].to(device)
        store.fetch(slots, valid, every, backend)
        _old_fetch(shadow, slots, valid, every)
        _assert_same(store, shadow, step)
        if step == 1:
            read_after_both = store.pool_rows_read.clone()
            for block in blocks:  # poison: a read from the pool from now on would show
                rows = store.pool_rows(block.to(device)).to(pool_device)
                for pool in (store.pool.keys, store.pool.values):
                    pool.scatter_(2, rows.unsqueeze(-1).expand(-1, -1, -1, D), -77.0)
    assert torch.equal(read_after_both.cpu(), torch.full((B,), 2 * H * R))
    assert torch.equal(store.pool_rows_read, read_after_both)  # steps 2-5: all from the buffer or the cache
    assert torch.equal(store.rows_fetched.cpu(), torch.full((B,), 6 * H * R))


def test_a_unit_cache_smaller_than_the_retrieved_rows_is_refused():
    store, _ = _stores(0, torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match="at least the 12 retrieved rows"):
        store.set_cache(R - 1)


def test_forget_resident_makes_the_next_fetch_read_everything():
    store, _ = _stores(0, torch.device("cpu"), torch.device("cpu"))
    slots = torch.randint(0, store.zone_end, (B, H, R), generator=torch.Generator().manual_seed(3))
    every = torch.ones(B, dtype=torch.bool)
    store.fetch(slots, torch.ones_like(slots, dtype=torch.bool), every, "reference")
    after_first = store.pool_rows_read.clone()
    store.fetch(slots, torch.ones_like(slots, dtype=torch.bool), every, "reference")
    assert torch.equal(store.pool_rows_read, after_first)  # all resident: nothing read
    store.forget_resident()
    store.fetch(slots, torch.ones_like(slots, dtype=torch.bool), every, "reference")
    assert torch.equal(store.pool_rows_read, 2 * after_first)
    assert (after_first == H * R).all()


def test_forget_resident_forgets_the_unit_cache_too():
    store, _ = _stores(0, torch.device("cpu"), torch.device("cpu"))
    store.set_cache(2 * R)
    gen = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 20, (B, H, R), generator=gen) + offset for offset in (0, 40))
    every, valid = torch.ones(B, dtype=torch.bool), torch.ones(B, H, R, dtype=torch.bool)
    store.fetch(first, valid, every, "reference")
    store.fetch(second, valid, every, "reference")
    read = store.pool_rows_read.clone()
    store.forget_resident()
    store.fetch(first, valid, every, "reference")  # cached before: read afresh now
    assert torch.equal(store.pool_rows_read - read, (first != -1).flatten(1).sum(-1))


def test_unwritten_slots_are_never_reused():
    # a selection may name a slot the pool has not been written at yet; that row held whatever
    # the memory had, so when the slot is written and selected again it must be read afresh
    store, shadow = _stores(0, torch.device("cpu"), torch.device("cpu"))
    ahead = int(store.next_slot)  # the slot the next append writes
    slots = torch.full((B, H, R), ahead)
    every = torch.ones(B, dtype=torch.bool)
    valid = torch.ones(B, H, R, dtype=torch.bool)
    for s in (store, shadow):
        s.pool.keys[:, :, ahead] = 99.0
        s.pool.values[:, :, ahead] = 99.0
    store.fetch(slots, valid, every, "reference")
    _old_fetch(shadow, slots, valid, every)
    key, value = torch.randn(2, B, H, D)
    store.append(key, value, "reference")
    shadow.append(key, value, "reference")
    store.fetch(slots, valid, every, "reference")
    _old_fetch(shadow, slots, valid, every)
    _assert_same(store, shadow, 1)
    assert torch.equal(store.retrieved.keys[:, :, 0], key)


def test_stores_of_one_shape_share_one_scratch():
    a, b = _stores(0, torch.device("cpu"), torch.device("cpu"))
    assert all(x is y for x, y in zip(a.scratch, b.scratch)) and len(a.scratch) == 2
    assert a.scratch[0] is not a.scratch[1]  # one fill writes keys and values at once
    assert all(part.shape == a.retrieved.keys.shape for part in a.scratch)
    assert a.slot_map is b.slot_map and (a.slot_map == -1).all()


def _decoded(name: str, steps: int, device: str = "cpu", **options) -> PolicyLayerState:
    """A layer of preset ``name`` (budget 100, GQA: two query heads per KV head) on ``device`` after a
    300-token prompt and ``steps`` random decode steps (drawn on the CPU, so every device sees the same)."""
    gen = torch.Generator().manual_seed(5)
    hq = 2 * H
    policy = kvpolicy.preset(name, budget=100, sink=4, local=16, **options)
    state = PolicyLayerState(policy, 0, torch.device(device))
    prompt = torch.randn(2, B, H, 300, D, generator=gen).to(device)
    state.prefill(prompt[0], prompt[1], torch.ones(B, 300, dtype=torch.bool, device=device), hq,
                  last_query=prompt_query(B, hq, D, device, prompt[0].dtype))
    for _ in range(steps):
        q = torch.randn(B, hq, D, generator=gen).to(device)
        k, v = torch.randn(2, B, H, D, generator=gen).to(device)
        state.decode(q, k, v, D**-0.5)
    return state


@pytest.mark.parametrize("cache_rows", [None, 160])
@pytest.mark.parametrize("name", ["quest", "louiskv"])
def test_triton_fetches_match_the_reference_and_leave_the_slot_map_clean(name, cache_rows):
    # both presets' prompt units lay the zone out unit by unit: refresh_rows translates its slots
    # Triton runs on CPU tensors only under its interpreter, which is off on a CUDA machine
    device = "cuda" if CUDA else "cpu"
    # 6 steps re-select 6 times a sequence, and the 160-row cache already spares a third of the pool reads
    want = _decoded(name, 6, device, backend="reference", unit_cache_rows=cache_rows).store
    got = _decoded(name, 6, device, backend="triton", unit_cache_rows=cache_rows).store
    assert got.pool.zone_rows is not None
    assert (got.cache is not None) == (cache_rows is not None)
    for part in ("keys", "values", "slots", "held"):
        assert torch.equal(getattr(got.retrieved, part), getattr(want.retrieved, part)), part
    assert torch.equal(got.pool_rows_read, want.pool_rows_read)
    assert (got.slot_map == -1).all()
    assert got.slot_map.shape[-1] == got.pool.capacity


@pytest.mark.parametrize("name", ["quest", "louiskv"])
def test_a_policy_decode_reads_fewer_rows_than_it_selects(name):
    state = _decoded(name, 30)
    full = H * state.store.retrieval_capacity * state.reselections
    assert (state.reselections > 1).all()
    assert (state.store.pool_rows_read < full).all(), (state.store.pool_rows_read, full)
